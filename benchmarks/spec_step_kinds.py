"""Per-step-kind timing of an end-to-end run (benchmarks/spec_verify_cost.py --parts e2e,
docs/ARCHITECTURE.md §5.5): where the time of a speculative run's steps goes.

`StepKindTimer(runner)` stands in for the runner behind `benchmarks.common.run_core` (it
forwards every other attribute to it) and classifies each `execute(plan)`:
- `prefill`: a seq with prompt tokens (more tokens than 1 + num_draft);
- `verify_graph` / `verify_eager`: a seq verifies drafts, the step replayed a verify graph
  (`runner.verify_graphs.replays` moved) or ran eagerly;
- `no_draft_graph` / `no_draft_eager`: a decode-only step without drafts whose seqs ask the
  proposer for some (`num_propose > 0`: the speculative run's steps after an empty proposal);
- `decode_graph` / `decode_eager`: a plain decode step (no drafts, no proposal), replayed
  from a decode CUDA graph (a `torch.cuda.CUDAGraph.replay` in the step) or eager.
Per step it measures, on the host (`time.perf_counter`): `wall` (the whole `execute`),
`before_forward` (from execute's start to the forward's first launch: a graph replay or
`runner.run_model`), `after_last_read` (from the end of the step's last device read,
`Tensor.tolist` / `Tensor.item` of a device tensor; on the CPU of any tensor, to execute's
end) and `gap_before` (from the previous step's end to this one's start: the engine's
`finish_step` and `plan_step`, which at batch 1 the device waits for). On CUDA the sum
after_last_read + gap_before + the next step's before_forward is the host time the device
sits idle between two forwards (a graph's launch itself is in neither). On CUDA also
`device` (CUDA events: one recorded just before the forward's first launch, one just
before each device read; the span from the first to the last, read once at the end so
that timing adds no sync): the device's busy span of the step, lm_head and argmax
included.

The hooks patch the runner instance's `run_model` and, for the duration of `with timer:`,
`torch.cuda.CUDAGraph.replay`, `Tensor.tolist` and `Tensor.item`; each adds about a
microsecond a call and a CUDA event record a few, so the benchmark takes its tok/s from
runs without the timer and reports the timed run's own tok/s beside its kinds.
"""

from __future__ import annotations

import statistics
import time

import torch

KINDS = ("prefill", "decode_graph", "decode_eager", "verify_graph", "verify_eager", "no_draft_graph",
         "no_draft_eager")


def step_kind(plan, verify_replayed: bool, graph_replayed: bool) -> str:
    """The kind of a step (module doc) from its plan and whether it replayed a verify graph
    or any CUDA graph."""
    seqs = plan.seqs
    if any(len(s.token_ids) > 1 + s.num_draft for s in seqs):
        return "prefill"
    if any(s.num_draft for s in seqs):
        return "verify_graph" if verify_replayed else "verify_eager"
    base = "no_draft" if any(s.num_propose > 0 for s in seqs) else "decode"
    return f"{base}_{'graph' if graph_replayed else 'eager'}"


class StepKindTimer:
    """The runner behind `run_core`, timed per step kind (module doc). `steps`: one dict a
    step (kind, wall, before_forward, after_last_read, gap_before in seconds, and on CUDA
    the event pair of its device span); `summary()` groups them."""

    def __init__(self, runner):
        self._runner = runner
        self.cuda = runner.device.type == "cuda"
        self.steps: list[dict] = []
        self._last_end: float | None = None
        self._reset_step()

    def __getattr__(self, name):  # everything else is the runner's (run_core reads device, kv_layout)
        return getattr(self._runner, name)

    def _reset_step(self) -> None:
        self._fwd_t: float | None = None
        self._read_end: float | None = None
        self._ev_first = self._ev_last = None
        self._graph_replays = 0

    def _mark_forward(self) -> None:
        if self._fwd_t is None:
            self._fwd_t = time.perf_counter()
            if self.cuda:
                self._ev_first = torch.cuda.Event(enable_timing=True)
                self._ev_first.record()

    def __enter__(self):
        timer, r = self, self._runner
        run_model = r.run_model

        def timed_run_model(*a, **kw):
            timer._mark_forward()
            return run_model(*a, **kw)

        def reading(fn):
            def call(t, *a, **kw):
                device = t.device.type != "cpu" or not timer.cuda
                if device and timer.cuda and timer._fwd_t is not None:
                    timer._ev_last = torch.cuda.Event(enable_timing=True)
                    timer._ev_last.record()
                try:
                    return fn(t, *a, **kw)
                finally:
                    if device:
                        timer._read_end = time.perf_counter()
            return call

        self._saved = (torch.Tensor.tolist, torch.Tensor.item)
        r.run_model = timed_run_model
        torch.Tensor.tolist, torch.Tensor.item = reading(torch.Tensor.tolist), reading(torch.Tensor.item)
        if self.cuda:
            replay = torch.cuda.CUDAGraph.replay
            self._saved_replay = replay

            def timed_replay(g):
                timer._mark_forward()
                timer._graph_replays += 1
                return replay(g)

            torch.cuda.CUDAGraph.replay = timed_replay  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.item = self._saved
        if self.cuda:
            torch.cuda.CUDAGraph.replay = self._saved_replay  # type: ignore[method-assign]
        del self._runner.__dict__["run_model"]  # back to the class method

    def execute(self, plan):
        r = self._runner
        vg = r.verify_graphs
        replays = vg.replays if vg is not None else 0
        self._reset_step()
        t0 = time.perf_counter()
        result = r.execute(plan)
        t1 = time.perf_counter()
        verify_replayed = vg is not None and vg.replays != replays
        fwd = self._fwd_t if self._fwd_t is not None else t1
        read_end = self._read_end if self._read_end is not None and self._read_end >= fwd else t1
        self.steps.append({
            "kind": step_kind(plan, verify_replayed, self._graph_replays > 0 or verify_replayed),
            "wall": t1 - t0, "before_forward": fwd - t0, "after_last_read": t1 - read_end,
            "gap_before": t0 - self._last_end if self._last_end is not None else None,
            "events": (self._ev_first, self._ev_last) if self._ev_first is not None and self._ev_last is not None
            else None})
        self._last_end = t1
        return result

    def summary(self) -> dict:
        """Per kind (those that occurred, `KINDS` order): steps; wall_ms median and total;
        before_forward_ms, after_last_read_ms and gap_before_ms medians (gap: the steps with a
        step before them); idle_host_ms_total (the kind's before_forward + after_last_read +
        gap_before, summed: the host time the device waits for around these steps, on CUDA);
        on CUDA device_ms median and total (module doc). Plus `total`: steps, wall_ms and
        idle_host_ms over all kinds. Call after the run (on CUDA it reads the events; the
        run ended with a sync)."""
        out: dict = {}
        ms = 1e3
        for kind in KINDS:
            xs = [s for s in self.steps if s["kind"] == kind]
            if not xs:
                continue
            walls = [s["wall"] for s in xs]
            gaps = [s["gap_before"] for s in xs if s["gap_before"] is not None]
            idle = sum(s["before_forward"] + s["after_last_read"] + (s["gap_before"] or 0.0) for s in xs)
            row = {"steps": len(xs), "wall_ms_median": round(statistics.median(walls) * ms, 4),
                   "wall_ms_total": round(sum(walls) * ms, 3),
                   "before_forward_ms_median": round(statistics.median(s["before_forward"] for s in xs) * ms, 4),
                   "after_last_read_ms_median": round(statistics.median(s["after_last_read"] for s in xs) * ms, 4),
                   "gap_before_ms_median": round(statistics.median(gaps) * ms, 4) if gaps else None,
                   "idle_host_ms_total": round(idle * ms, 3)}
            if self.cuda:
                dev = [a.elapsed_time(b) for a, b in (s["events"] for s in xs if s["events"] is not None)]
                row.update(device_ms_median=round(statistics.median(dev), 4) if dev else None,
                           device_ms_total=round(sum(dev), 3) if dev else None)
            out[kind] = row
        out["total"] = {"steps": len(self.steps),
                        "wall_ms": round(sum(s["wall"] for s in self.steps) * ms, 3),
                        "idle_host_ms": round(sum(r["idle_host_ms_total"] for k, r in out.items()
                                                  if k != "total"), 3)}
        return out
