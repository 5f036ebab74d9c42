"""The JIT-compile watch: Triton compiles and CUDA graph captures once the worker serves.

A Triton kernel compiles once per new key: a new constexpr value, a new integer
specialisation (Triton specialises int arguments equal to 1 and divisible by 16 unless they
are in `do_not_specialize`), a new dtype or pointer alignment. A compile met while serving
stalls its step for 0.1-0.5 s (a CUDA graph capture too), which halves a short benchmark
round and, before step_cost.py dropped such samples, poisoned the policy's cost curves
(docs/ARCHITECTURE.md §5.5, §6.5). The startup warm-ups (cuda_graphs.py, verify_graphs.py,
`kernels.attention.warm_up_attention`, `kernels.sampling_triton.warm_up_sampler`) compile
every launch the serving paths can meet; this watch says when one was missed.

`WATCH` (one per process: Triton's hooks are process-wide) counts compiles through
Triton's JIT hooks: `triton.knobs.runtime.jit_cache_hook` (called before a compile, to time
it) and `jit_post_compile_hook` (after it), where `triton.knobs` has them (Triton 3.4+:
the device's 3.6, this machine's 3.9), else the older class attributes
`JITFunction.cache_hook` / `compiled_hook`; hooks already set are chained, never replaced.
A hook fires for every new key of a JITFunction's in-process cache, a compile served from
Triton's disk cache too (that still costs the load, and says the key was not warmed).
Under the interpreter (TRITON_INTERPRET=1) and on the CPU's torch references nothing
compiles, so the counts stay 0. Captures are reported by the capture sites (`note_capture`).

What a compile is keyed on is described from the hook's `compile` dict (its `signature`: each
argument's type, its `configs[0]`: the attributes Triton specialised on, `tt.divisibility` 16
for an aligned pointer or an int divisible by 16, `tt.equal_to` for an int equal to 1), not
from its `repr`, whose argument list Triton 3.6+ builds by zipping the parameters with a
character of the string cache key (so it names single characters). A serving compile's log
line names what differs from the closest earlier compile of the same kernel (`describe`,
`difference`): the argument whose alignment or value class changed, or the constexpr.

`ModelRunner` installs the hooks before loading, `arm`s the watch when its warm-ups are
done (the server is ready), and puts `take()` (compiles and captures since the last step)
in each `StepResult.jit_compiles`; the first `LOG_FIRST` after arming are logged as a
warning with the kernel, its signature and constexprs. Counts before arming are the
startup's (`startup_compiles`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

log = logging.getLogger("kestrel.worker.jit")

LOG_FIRST = 8  # compiles and captures after arming logged as warnings; the rest counted only


class JitWatch:
    """Counts of Triton compiles and CUDA graph captures, split at `arm` (module doc)."""

    def __init__(self) -> None:
        self.armed = False
        self.startup_compiles = 0   # before arm
        self.compiles = 0           # Triton compiles after arm
        self.captures = 0           # CUDA graph captures after arm
        self.compile_seconds = 0.0  # time in compiles after arm (where the pre-hook timed them)
        self.logged = 0
        self._taken = 0
        self._started: dict[Any, float] = {}
        self._seen: dict[str, list[dict]] = {}  # kernel name -> descriptions of its compiles
        self.serving: list[str] = []  # the first LOG_FIRST serving compiles, as logged
        self._lock = threading.Lock()

    def arm(self) -> None:
        """From now on, compiles and captures are the serving's (counted, the first logged)."""
        with self._lock:
            self.armed = True
            self._taken = self.compiles + self.captures

    def compile_started(self, key: Any) -> None:
        """Triton is about to compile `key` (times the compile)."""
        self._started[_hashable(key)] = time.perf_counter()

    def compiled(self, name: str, signature: str, constexprs: Any, key: Any = None,
                 desc: dict | None = None) -> None:
        """Triton compiled kernel `name` (its launch repr `signature`, its `constexprs`, and
        `desc`: what the compile is keyed on, from `describe`)."""
        t0 = self._started.pop(_hashable(key), None)
        seconds = time.perf_counter() - t0 if t0 is not None else 0.0
        with self._lock:
            seen = self._seen.setdefault(name, [])
            diff = difference(desc, seen) if desc is not None else None
            if desc is not None and len(seen) < 64:
                seen.append(desc)
            if not self.armed:
                self.startup_compiles += 1
                return
            self.compiles += 1
            self.compile_seconds += seconds
            first = self.logged < LOG_FIRST
            self.logged += first
            if first:
                line = (f"Triton compiled {name} while serving ({seconds:.3f} s; compile {self.compiles} after "
                        f"ready): " + (f"differs from its closest earlier compile in {diff}" if diff is not None
                                      else f"{signature} constexprs {constexprs}"))
                self.serving.append(line)
        if first:
            log.warning("%s", line)

    def note_capture(self, what: str) -> None:
        """A CUDA graph `what` was captured (counted only after arming)."""
        with self._lock:
            if not self.armed:
                return
            self.captures += 1
            first = self.logged < LOG_FIRST
            self.logged += first
        if first:
            log.warning("CUDA graph captured while serving: %s", what)

    def take(self) -> int:
        """Compiles + captures after arming since the last take (0 before arming)."""
        with self._lock:
            now = self.compiles + self.captures if self.armed else self._taken
            n, self._taken = now - self._taken, now
            return max(0, n)

    def stats(self) -> dict:
        """Counts for the startup report / stats: startup, serving compiles and captures."""
        return {"startup_compiles": self.startup_compiles, "compiles": self.compiles,
                "captures": self.captures, "compile_seconds": round(self.compile_seconds, 3),
                "serving": list(self.serving)}


def describe(comp: dict) -> dict | None:
    """What a compile is keyed on, from the hooks' `compile` dict (Triton 3.4+): {argument name
    or index: its type plus the specialised attributes ("*bf16 div16", "i32 eq1"), constexpr
    name: value}; None where the dict has no signature (older Triton)."""
    sig = comp.get("signature")
    if not isinstance(sig, dict):
        return None
    names = list(sig)
    attrs: dict[str, list[str]] = {}
    configs = comp.get("configs") or [{}]
    for path, values in (configs[0] or {}).items():
        idx = path[0] if isinstance(path, tuple) and path else path
        name = names[idx] if isinstance(idx, int) and idx < len(names) else str(path)
        for v in values or []:
            a, val = (v[0], v[1]) if isinstance(v, (list, tuple)) and len(v) > 1 else (v, "")
            attrs.setdefault(name, []).append({"tt.divisibility": f"div{val}", "tt.equal_to": f"eq{val}"}
                                              .get(str(a), f"{a}={val}"))
    out = {n: " ".join([str(t)] + attrs.get(n, [])) for n, t in sig.items()}
    for k, v in (comp.get("constants") or {}).items():
        idx = k[0] if isinstance(k, tuple) and k else k
        out[f"{names[idx] if isinstance(idx, int) and idx < len(names) else idx}="] = repr(v)
    for opt in ("num_warps", "num_stages"):
        if opt in comp:
            out[opt] = str(comp[opt])
    return out


def difference(desc: dict, earlier: list[dict]) -> str:
    """The entries of `desc` that differ from the closest of `earlier` (the fewest
    differences), as "name: old -> new; ..."; "no earlier compile" when there is none, and
    "nothing (the same key again: a cache miss)" when one equals it."""
    if not earlier:
        return "nothing: no earlier compile of this kernel"
    best: list[str] | None = None
    for e in earlier:
        d = [f"{k}: {e.get(k)} -> {desc.get(k)}" for k in sorted(set(desc) | set(e), key=str)
             if e.get(k) != desc.get(k)]
        if best is None or len(d) < len(best):
            best = d
    return "; ".join(best) if best else "nothing (the same key again: a cache miss)"


def _hashable(key: Any) -> Any:
    try:
        hash(key)
        return key
    except TypeError:
        return repr(key)


WATCH = JitWatch()
_installed: str | None = None


def _name(fn: Any) -> str:
    """A kernel's name from the hook's `fn` (a JitFunctionInfo or a JITFunction)."""
    for attr in ("name", "__name__"):
        v = getattr(fn, attr, None)
        if isinstance(v, str):
            return f"{getattr(fn, 'module', '')}.{v}".lstrip(".")
    inner = getattr(fn, "fn", None)
    return getattr(inner, "__qualname__", repr(fn))


def cache_hook(prev=None):
    """A `jit_cache_hook` that times the compile and then defers to `prev` (a hook already
    set; its answer, True = skip the compile, is returned)."""
    def hook(*args, **kwargs):
        WATCH.compile_started(kwargs.get("key"))
        return prev(*args, **kwargs) if prev is not None else False
    return hook


def post_compile_hook(prev=None):
    """A `jit_post_compile_hook` that counts the compile in `WATCH`, then calls `prev`."""
    def hook(*args, **kwargs):
        comp = kwargs.get("compile") or {}
        WATCH.compiled(_name(kwargs.get("fn")), str(kwargs.get("repr", "")),
                       comp.get("constants", comp.get("constexprs")), kwargs.get("key"), describe(comp))
        return prev(*args, **kwargs) if prev is not None else None
    return hook


def install() -> str:
    """Install the hooks once per process. Returns where: "knobs" (triton.knobs.runtime),
    "jitfunction" (older Triton's class attributes) or "none" (no Triton)."""
    global _installed
    if _installed is not None:
        return _installed
    try:
        import triton
    except ImportError:
        _installed = "none"
        return _installed
    rt = getattr(getattr(triton, "knobs", None), "runtime", None)
    if rt is not None and hasattr(rt, "jit_post_compile_hook") and hasattr(rt, "jit_cache_hook"):
        rt.jit_cache_hook = cache_hook(rt.jit_cache_hook)
        rt.jit_post_compile_hook = post_compile_hook(rt.jit_post_compile_hook)
        _installed = "knobs"
        return _installed
    from triton.runtime.jit import JITFunction
    if hasattr(JITFunction, "compiled_hook"):
        JITFunction.cache_hook = cache_hook(getattr(JITFunction, "cache_hook", None))
        JITFunction.compiled_hook = post_compile_hook(JITFunction.compiled_hook)
        _installed = "jitfunction"
    else:
        _installed = "none"
    log.debug("jit watch hooks: %s", _installed)
    return _installed
