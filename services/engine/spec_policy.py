"""How many drafts each request verifies in a step, and how many it asks for next.

docs/ARCHITECTURE.md §5.5. The scheduler asks, per step: `begin_step` (the step's size
before drafts), `choose` (k per request holding drafts), `num_propose` (drafts each sampled
seq asks the workers for, after the step); after the step, `observe_result` per seq that
verified or proposed, and the engine core feeds the measured step durations (`cost`,
services/engine/step_cost.py).

"fixed": every request verifies min(k, its drafts) and always asks for k.

"adaptive" (the default) never speculates where it does not pay:
- Acceptance: per request, moving averages of accepted drafts and of trials (drafts
  verified up to and including the first rejected one; a proposal that came back empty
  counts one failed trial), so a = accepted / trials estimates the per-draft acceptance
  rate. A new request starts from the engine-wide average. With per-draft acceptance a,
  verifying k drafts gains sum_{i=1..k} a^i tokens on average (the bonus token comes
  either way; Leviathan et al. 2023, arXiv 2211.17192, §3.1).
- Cost: the step's expected duration from the measured curves: `spec_cost(N + K)` for a
  step of N tokens plus K drafts that verifies or proposes (device time, plus the engine's
  own time between result and plan, `overhead`, which such a step waits for), against
  `plain_cost(N)` for the same step without drafts (its decode-only or, with prefill
  tokens expected, its mixed curve; plus `overhead` only where the pipeline is
  synchronous anyway: async scheduling off, or a request with penalties or a grammar
  running). In a step with prefill tokens the break-even acceptance and the probe test
  hold for a step of its decodes alone too (drafts found now may verify in the next step,
  which may have none).
- Choice: the step's output rate (tokens emitted / expected duration) is what is
  maximised. The i-th draft of a request with acceptance a adds a^i tokens; the drafts
  are taken in decreasing order of that gain and the best total K is kept (for a given K
  the top-K gains are optimal, since the cost depends on K alone), K at most what the
  step's token budget leaves (drafts past it would push decodes or prefill tokens out of
  the step, a loss their gains do not count). Speculation goes on
  only where that rate beats the plain step's by MARGIN; otherwise every k is 0 and the
  step is a plain one (async scheduling again).
- Proposals: a request asks for k drafts after its seq when it verifies drafts now, or
  when its acceptance alone would pay for verifying at the current batch
  (`break_even_acceptance`) and its last EMPTY_RUN proposals did not all come back empty
  (every asking seq is synchronous, and with cheap-looking drafts the estimate, which an
  empty proposal only scales by 1 - ALPHA, stays above a near-zero break-even for long:
  n-gram with nothing to copy). The others are probed together, in probe steps: after
  PROBE_MIN steps without one, every sampled seq that asks for none asks for k once and
  verifies up to PROBE_DRAFTS of what comes back in its next seq (whatever its acceptance
  says), asking again in that seq (synchronous anyway), so a probe that hits resumes
  speculation at once; a probe's outcome weighs PROBE_ALPHA in the request's estimate (its text may have
  changed since), so a request whose text turns repetitive starts speculating again. Each
  probe step doubles the interval to the next, up to PROBE_MAX steps; a step that
  speculates on its merits sets it back to PROBE_MIN. A step only probes where
  speculation could pay at all: every sampled seq verifying k drafts, all accepted, beats
  the plain step by MARGIN on the measured curves (at a large batch, or where verify steps
  run eagerly, it does not, and nothing is probed; a probe's drafts held in such a step
  are dropped). Probing all requests in one step pays
  the synchronous steps (a proposal, then a verify) once per interval: probes of requests
  one by one, each on its own clock, made almost every step at 256 concurrent requests
  synchronous (H200, spec_serve.py: 0.54-0.64x of plain).
Switched off (`set_enabled(False)`, the engine's set_speculation utility, only with
--debug-utilities): every decision short-circuits to the plain step's (no k, no lookup, no
proposal, no probe) and nothing is counted or measured, so the engine does exactly the work
of a server without speculation; switched on again, the policy goes on from the state it
had (acceptance, costs, probe interval). benchmarks/spec_serve.py --one-server measures
both sides on one server this way.
Counters (`stats`): vLLM's spec_decode_num_drafts (seqs that verified drafts),
num_draft_tokens, num_accepted_tokens, num_accepted_tokens_per_pos, plus proposals, empty
proposals, probe steps, steps that verified or proposed, n-gram lookups and the lookups that
made the next plan wait; the policy's inputs (the curves, overhead, the engine-wide
acceptance) and its last choice.
"""

from __future__ import annotations

from operator import itemgetter

from services.engine.request import Request
from services.engine.step_cost import StepCostModel
from shared.spec_config import SpeculativeConfig

MARGIN = 0.02        # speculation must beat the plain step's rate by 2%
ALPHA = 0.3          # weight of a new verify in a request's acceptance averages
GLOBAL_ALPHA = 0.05  # ... in the engine-wide acceptance (the prior of new requests)
PRIOR_WEIGHT = 1.0   # trials the prior of a new request is worth
PROBE_MIN = 16       # sampled seqs without speculation before the first probe
PROBE_MAX = 256      # the longest probe interval
PROBE_DRAFTS = 1     # drafts a probe verifies
PROBE_ALPHA = 0.5    # weight of a probe's outcome (the text may have changed since the last)
EMPTY_RUN = 4        # empty proposals in a row after which a request stops asking (until a probe)
MIN_GAIN = 1e-3      # draft gains below this are never considered
SCAN_DENSE = 32      # every K up to this is evaluated, then K grows by 25%


def expected_accepted(a: float, k: int) -> float:
    """sum_{i=1..k} a^i = a (1 - a^k) / (1 - a): the expected accepted drafts of k drafts
    at per-draft acceptance a (0 <= a <= 1)."""
    if a >= 1.0:
        return float(k)
    return a * (1.0 - a ** k) / (1.0 - a)


class SpecState:
    """One request's speculation state (module doc).

    accepted, trials: moving averages (acceptance = accepted / trials). probing: a probe's
    drafts are on their way or due to be verified. empty: its proposals in a row that came
    back empty.
    """

    __slots__ = ("accepted", "trials", "probing", "empty", "declined", "verifying")

    def __init__(self, prior: float):
        self.accepted = prior * PRIOR_WEIGHT
        self.trials = PRIOR_WEIGHT
        self.probing = False
        self.empty = 0
        self.declined = False  # `choose` took none of its drafts last time it held some
        self.verifying = False  # ... took some (its next step looks up again)

    @property
    def acceptance(self) -> float:
        """The estimated per-draft acceptance rate, 0..1."""
        return self.accepted / self.trials if self.trials > 0 else 0.0

    def observe(self, accepted: int, trials: int, alpha: float = ALPHA) -> None:
        """One verify's outcome, with weight alpha in the moving averages."""
        self.accepted += alpha * (accepted - self.accepted)
        self.trials += alpha * (trials - self.trials)


class SpecPolicy:
    """k per request and step (module doc), from `cfg` (`--speculative-config`).

    async_scheduling: the engine plans ahead when it may (a plain step then hides the
    engine's own time). cost: the measured step costs, fed by the engine core. enabled:
    False while speculation is switched off (`set_enabled`, module doc).
    """

    def __init__(self, cfg: SpeculativeConfig, async_scheduling: bool):
        self.cfg = cfg
        self.kmax = cfg.num_speculative_tokens
        self.fixed = cfg.policy == "fixed"
        self.async_scheduling = async_scheduling
        self.cost = StepCostModel()
        self.enabled = True
        self.acceptance = 0.5  # engine-wide moving average: the prior of new requests
        # counters (cumulative)
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * self.kmax
        self.k_hist = [0] * (self.kmax + 1)  # verify seqs by the k they verified
        self.num_proposals = 0
        self.num_empty_proposals = 0
        self.num_probes = 0  # probe steps
        self.num_spec_steps = 0  # steps planned with a seq that verifies or proposes
        self.num_lookups = 0  # engine-side drafter lookups (n-gram)
        self.num_lookup_waits = 0  # lookups that marked `lookup_due` (the next plan waits)
        self._since_probe = 0  # steps since the last probe step
        self._probe_interval = PROBE_MIN
        self._probe_step = False  # this step probes (begin_step)
        # this step (begin_step)
        self._n = 1
        self._b = 1
        self._base: float | None = None  # the plain step's rate, tokens/s (None: unknown)
        self._async = async_scheduling
        self._mixed = False
        self._pays: bool | None = None  # could_pay, once per step
        self._a_star: float | None = None
        self._room: int | None = None
        self.last: dict = {}

    def set_enabled(self, enabled: bool) -> None:
        """Switch speculation on or off at runtime (module doc): off, every request's k is 0
        and nothing is looked up, proposed, probed, counted or measured; on again, the
        learned state (acceptance, costs, probe interval) is used as it was. Seqs planned
        before the switch still report their results (`observe_result`: that work ran)."""
        self.enabled = bool(enabled)

    def state(self, req: Request) -> SpecState:
        """The request's state, made on first use from the engine-wide prior."""
        st = req.spec
        if st is None:
            st = req.spec = SpecState(self.acceptance)
        return st

    # ------------------------------------------------------------------ per step

    def begin_step(self, num_tokens: int, num_sampled: int, async_ok: bool, room: int | None = None,
                   mixed: bool = False) -> None:
        """A step of about `num_tokens` tokens before drafts, `num_sampled` of its seqs
        emitting tokens, is being planned. async_ok: a plain step could be planned ahead
        (nothing else forces the pipeline to wait). room: the drafts its token budget
        leaves room for (None: no bound); the adaptive choice stays within it (drafts past
        it would displace decodes or prefill tokens, which their gains do not count).
        mixed: prefill tokens are expected in it (its plain cost is the mixed curve's,
        services/engine/step_cost.py). Switched off: nothing (no probe step, and the probe
        interval does not advance)."""
        self._probe_step = False
        if not self.enabled:
            return
        self._n, self._b = max(1, num_tokens), max(1, num_sampled)
        self._room = room
        self._a_star = None
        self._async = async_ok and self.async_scheduling
        self._mixed = mixed
        self._base = self._plain_rate(self._n, mixed)
        self._pays = None
        if not self.fixed:
            self._since_probe += 1
            if self._since_probe >= self._probe_interval and self.could_pay():
                self._probe_step, self._since_probe = True, 0
                self._probe_interval = min(PROBE_MAX, 2 * self._probe_interval)
                self.num_probes += 1

    def _plain_rate(self, n: int, mixed: bool) -> float | None:
        """The plain step's rate at n tokens, tokens/s (None: nothing measured); with the
        engine's overhead where the pipeline waits anyway."""
        t = self.cost.plain_cost(n, mixed)
        if t is None:
            return None
        if not self._async:
            t += self.cost.overhead
        # a measured 0 s (a coarse or fake clock) counts as a nanosecond, as in _spec_rate
        return self._b / max(t, 1e-9)

    def could_pay(self) -> bool:
        """Whether speculation could pay in this step at all: every sampled seq verifying
        kmax drafts, all of them accepted, beats the plain rate by MARGIN, and, in a step
        with prefill tokens, also beats a step of its decodes alone (a probe's drafts
        found now may verify in the next step, without them). True while the costs are
        unknown, or no step with drafts was measured yet: a plain curve of one size would
        extrapolate the drafts in proportion, and with no proposal steps, n-gram drafting
        would never measure one. Computed once per step."""
        if self._pays is None:
            self._pays = self._pays_at(self._n, self._base)
            if self._pays and self._mixed:
                self._pays = self._pays_at(self._b, self._plain_rate(self._b, False))
        return self._pays

    def _pays_at(self, n: int, base: float | None) -> bool:
        if base is None or not self.cost.spec:
            return True
        d = self._b * self.kmax if self._room is None else min(self._room, self._b * self.kmax)
        if d <= 0:
            return False
        r = self._spec_rate(d, float(d), n)
        return r is not None and r > base * (1.0 + MARGIN)

    def _spec_rate(self, drafts: int, gain: float, n: int | None = None) -> float | None:
        t = self.cost.spec_cost((self._n if n is None else n) + drafts)
        # a measured 0 s (a coarse or fake clock) counts as a nanosecond: free, not a fault
        return None if t is None else (self._b + gain) / max(t + self.cost.overhead, 1e-9)

    def break_even_acceptance(self) -> float:
        """The least per-draft acceptance at which one request verifying some k drafts
        alone beats this step's plain rate by MARGIN, and in a step with prefill tokens
        also a step of its decodes alone (the drafts a lookup finds now may verify in the
        next step, which may have none; and a match found while tokens are in flight makes
        that step wait); 0 while the costs are unknown; 2 when no acceptance would.
        Computed once per step."""
        if self._a_star is None:
            a = 0.0 if self._base is None else self._break_even(self._base, self._n)
            if self._mixed and self._base is not None and a < 2.0:
                base = self._plain_rate(self._b, False)
                if base is not None:
                    a = max(a, self._break_even(base, self._b))
            self._a_star = a
        return self._a_star

    def _break_even(self, base: float, n: int) -> float:
        best = 2.0
        for k in range(1, self.kmax + 1):
            r = self._spec_rate(k, 0.0, n)
            assert r is not None  # a plain cost is known, so a spec one is too
            # (B + E) / T1 > (1 + MARGIN) * base  <=>  E > (1 + MARGIN) * base * T1 - B
            need = (1.0 + MARGIN) * base * (self._b / r) - self._b
            if need <= 0:
                return 0.0
            if need >= k:
                continue  # k drafts gain at most k
            lo, hi = 0.0, 1.0
            for _ in range(30):  # E_k(a) increases with a: bisect for E_k(a) = need
                mid = (lo + hi) / 2
                if expected_accepted(mid, k) > need:
                    hi = mid
                else:
                    lo = mid
            best = min(best, hi)
        return best

    def choose(self, cands: list[tuple[Request, int]]) -> dict[str, int]:
        """k per request id for `cands` ((request, usable drafts) of this step's decodes that
        hold drafts); requests left out verify none (module doc). Switched off: none."""
        if not self.enabled:
            return {}
        room = self._room
        if self.fixed:
            return {r.request_id: u for r, u in cands if u > 0}
        ks: dict[str, int] = {}
        forced_k, forced_gain = 0, 0.0
        gains: list[tuple[float, str]] = []
        for req, usable in cands:
            if usable <= 0:
                continue
            st = self.state(req)
            if st.probing:  # a probe's drafts: verified whatever the acceptance says
                k = min(usable, PROBE_DRAFTS, room - forced_k if room is not None else PROBE_DRAFTS)
                if k <= 0 or not self.could_pay():
                    st.probing = False  # no room, or a step where nothing could pay: dropped
                    continue
                ks[req.request_id] = k
                forced_k += k
                forced_gain += expected_accepted(st.acceptance, k)
                continue
            a, g = st.acceptance, 1.0
            for _ in range(usable):
                g *= a
                if g < MIN_GAIN:
                    break
                gains.append((g, req.request_id))
        gains.sort(key=itemgetter(0), reverse=True)
        if room is not None:
            del gains[max(0, room - forced_k):]
        best_k, best_rate = 0, self._base
        if self._base is None:
            best_k = len(gains)  # nothing measured yet: speculate, and measure it
        elif gains:
            ref = self._spec_rate(forced_k, forced_gain) if forced_k else self._base
            assert ref is not None
            need = ref if forced_k else ref * (1.0 + MARGIN)
            best_rate = ref
            total, k = forced_gain, 0
            for k_next in _scan(len(gains)):
                while k < k_next:
                    total += gains[k][0]
                    k += 1
                r = self._spec_rate(forced_k + k, total)
                assert r is not None
                if r > need and r > best_rate:
                    best_k, best_rate = k, r
        for _, rid in gains[:best_k]:
            ks[rid] = ks.get(rid, 0) + 1
        if best_k:  # speculation pays on its merits here: probe the others often again
            self._probe_interval = PROBE_MIN
        for req, _ in cands:
            if req.spec is not None:
                req.spec.verifying = req.request_id in ks
                req.spec.declined = not req.spec.verifying
        self.last = {"tokens": self._n, "seqs": self._b, "candidates": len(cands),
                     "drafts": forced_k + best_k, "probe_drafts": forced_k,
                     "rate_plain": self._base, "rate_chosen": best_rate}
        return ks

    def may_ask(self, req: Request) -> bool:
        """Whether `req`, holding no drafts, could ask for some after this step (`num_propose`
        with k 0 and a positive limit would be > 0): the scheduler's cheap test, so that a
        step in which nobody speculates costs the engine nearly what a plain one does.
        Switched off: False."""
        if not self.enabled:
            return False
        if self.fixed or self._probe_step:
            return True
        st = req.spec
        a = self.acceptance if st is None else st.acceptance
        return (st is None or st.empty < EMPTY_RUN) and a > self.break_even_acceptance()

    def lookups_quiet(self) -> bool:
        """Whether `wants_lookup` holds in this step only for requests whose probe is on its
        way or that verified drafts last time: not "fixed", no probe step, and no acceptance
        would pay on its own at this batch (break-even above 1). Switched off: True (and
        `wants_lookup` is False for all)."""
        if not self.enabled:
            return True
        return not self.fixed and not self._probe_step and self.break_even_acceptance() > 1.0

    def wants_lookup(self, req: Request, exact: bool) -> bool:
        """Whether the engine-side drafter looks `req` up in this step (docs/ARCHITECTURE.md
        §5.5): always with "fixed"; in a probe step, while its probe is on its way, and
        after a step in which it verified drafts;
        otherwise where its acceptance alone would pay (`may_ask`). exact: the lookup's
        drafts may verify now (no token in flight); when not, a hit makes the next plan wait
        for the results in flight, which a request whose drafts `choose` declined last time
        does not do (it is looked up only in steps planned after their results, and in
        probe steps). Switched off: False."""
        if not self.enabled:
            return False
        if self.fixed or self._probe_step:
            return True
        st = req.spec
        if st is not None:
            if st.probing or st.verifying:
                return True
            if st.declined and not exact:
                return False
        return self.may_ask(req)

    def observe_lookup(self, req: Request, found: bool, exact: bool = True) -> None:
        """The engine-side drafter looked `req` up and `found` drafts (or none). exact: the
        drafts may verify in this step; a hit that may not (a token in flight) is counted
        at the next lookup. An empty lookup is one failed trial (as an empty proposal). A
        hit in a probe step, of a request that would not look up on its merits, makes its
        next seq a probe (it verifies PROBE_DRAFTS of the drafts, whatever its estimate)."""
        self.num_lookups += 1
        st = self.state(req)
        if found:
            if self._probe_step and not self.fixed and not st.probing:
                if st.declined or st.empty >= EMPTY_RUN or st.acceptance <= self.break_even_acceptance():
                    st.probing = True
            if exact:
                self.num_proposals += 1
                st.empty = 0
            return
        self.num_proposals += 1
        self.num_empty_proposals += 1
        st.observe(0, 1, PROBE_ALPHA if st.probing else ALPHA)
        st.probing = st.verifying = False
        st.empty += 1
        self.acceptance -= GLOBAL_ALPHA * self.acceptance

    def num_propose(self, req: Request, k: int, limit: int, declined: bool = False) -> int:
        """Drafts `req` asks for after this step's seq (which verifies k drafts); at most
        `limit` (what it could still use). declined: it held drafts and `choose` took none
        (then it asks only in a probe step). Switched off: 0."""
        if limit <= 0 or not self.enabled:
            return 0
        n = min(self.kmax, limit)
        if self.fixed:
            return n
        st = self.state(req)
        if k > 0 or (not declined and st.empty < EMPTY_RUN and st.acceptance > self.break_even_acceptance()):
            return n  # (a probe's verify seq asks again: it is synchronous anyway)
        if self._probe_step and not st.probing:
            st.probing = True
            return n
        return 0

    # ------------------------------------------------------------------ after the step

    def observe_result(self, req: Request, num_draft: int, accepted: int, num_propose: int,
                       num_returned: int) -> None:
        """A seq of `req` verified `num_draft` drafts of which `accepted` were accepted, and
        asked for `num_propose` drafts of which `num_returned` came back."""
        st = self.state(req)
        if num_draft:
            self.num_drafts += 1
            self.num_draft_tokens += num_draft
            self.num_accepted_tokens += accepted
            for i in range(accepted):
                self.accepted_per_pos[i] += 1
            self.k_hist[num_draft] += 1
            trials = accepted + (accepted < num_draft)
            st.observe(accepted, trials, PROBE_ALPHA if st.probing else ALPHA)
            st.probing = False
            self.acceptance += GLOBAL_ALPHA * (accepted / trials - self.acceptance)
        if num_propose:
            self.num_proposals += 1
            if num_returned == 0:  # nothing to verify: one failed trial
                self.num_empty_proposals += 1
                st.observe(0, 1, PROBE_ALPHA if st.probing else ALPHA)
                st.probing = False
                st.empty += 1
                self.acceptance -= GLOBAL_ALPHA * self.acceptance
            else:
                st.empty = 0

    def observe_step(self, tokens: int, seconds: float, speculative: bool, mixed: bool = False) -> None:
        """A step of `tokens` tokens (drafts included) took `seconds`; speculative: a seq
        verified or proposed; mixed: it ran a prefill chunk. Not measured while switched off
        (the policy's state stays as it was, module doc)."""
        if self.enabled:
            self.cost.observe(tokens, seconds, speculative, mixed)

    def observe_overhead(self, seconds: float) -> None:
        """The engine spent `seconds` between a step's result and the next plan
        (`StepCostModel.overhead`); not measured while switched off."""
        if self.enabled:
            self.cost.observe_overhead(seconds)

    def stats(self) -> dict:
        """Counters, inputs and the last choice (module doc), for `EngineCore.stats`."""
        acc_len = 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0
        return {
            "spec_method": self.cfg.method, "spec_policy": self.cfg.policy,
            "spec_num_speculative_tokens": self.kmax,
            "spec_disabled": not self.enabled,
            "spec_decode_num_drafts": self.num_drafts,
            "spec_decode_num_draft_tokens": self.num_draft_tokens,
            "spec_decode_num_accepted_tokens": self.num_accepted_tokens,
            "spec_decode_num_accepted_tokens_per_pos": list(self.accepted_per_pos),
            "spec_decode_mean_acceptance_length": acc_len,
            "spec_decode_num_proposals": self.num_proposals,
            "spec_decode_num_empty_proposals": self.num_empty_proposals,
            "spec_decode_num_probes": self.num_probes,
            "spec_decode_num_spec_steps": self.num_spec_steps,
            "spec_ngram_lookups": self.num_lookups,
            "spec_ngram_lookup_waits": self.num_lookup_waits,
            "spec_decode_k_hist": list(self.k_hist),
            "spec_policy_inputs": {"acceptance": self.acceptance, **self.cost.stats(),
                                   "last_step": dict(self.last)},
        }


def _scan(n: int) -> list[int]:
    """The K evaluated among n gains: 1..SCAN_DENSE, then 25% apart, and n."""
    ks = list(range(1, min(n, SCAN_DENSE) + 1))
    k = SCAN_DENSE
    while k < n:
        k = min(n, max(k + 1, int(k * 1.25)))
        ks.append(k)
    return ks
