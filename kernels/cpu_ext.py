"""Building and loading Kestrel's CPU C++ extensions (kernels/csrc/*.cpp): the CPU's flags, ninja
on PATH, `torch.utils.cpp_extension.load` with one warning where it fails, a module loaded once a
process. Used by `kernels.cpu_int4_vnni` and `kernels.cpu_decode`.

Each extension is built on first use (ninja and a C++ compiler; cached in torch's extensions
folder, `TORCH_EXTENSIONS_DIR`, under a lock that makes concurrent first builds safe; ~30 s on the
2-core VM, well under a second to load once built). Where the CPU lacks a required flag or the build
fails, the loader returns None after one logged warning and the caller keeps its torch path.
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import threading
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

CSRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc")


@functools.cache
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags (the first `flags` line of /proc/cpuinfo); empty where it cannot be
    read (not Linux, or another architecture's format)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH; a venv's own (the `ninja` package, a dependency)
    is not on it when the venv's python runs without the venv activated: put its folder last."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # cpp_extension.load then raises, and build() warns
    os.environ["PATH"] = os.pathsep.join(p for p in (os.environ.get("PATH", ""), ninja.BIN_DIR) if p)


def build(name: str, source: str, cflags: Sequence[str], what: str, fallback: str,
          required: Sequence[str] = (), logger: logging.Logger | None = None) -> Any:
    """Load (building if needed) the extension `name` from `source` (a path) with `cflags` (plus
    -fopenmp for at::parallel_for's OpenMP body, binding to the libgomp torch has loaded). None,
    after one warning naming `what` and the `fallback` kept, where the CPU lacks one of the
    `required` /proc/cpuinfo flags or the build fails (a missing compiler or ninja, an error).
    logger: where the messages go (default this module's)."""
    lg = logger or log
    if required and not all(f in cpu_flags() for f in required):
        lg.warning("%s off: the CPU lacks one of %s; %s", what, ", ".join(required), fallback)
        return None
    try:
        from torch.utils import cpp_extension

        ninja_on_path()
        ext = cpp_extension.load(name=name, sources=[source], extra_cflags=[*cflags, "-fopenmp"],
                                 extra_ldflags=["-fopenmp"], verbose=False)
        lg.info("%s loaded (%s)", what, ext.__file__)
        return ext
    except Exception as e:  # a missing compiler or ninja, a failed build: serve without it
        lg.warning("%s off: building %s failed (%s: %s); %s", what, source, type(e).__name__,
                    str(e).strip()[-300:], fallback)
        return None


class Loader:
    """An extension loaded once a process, by `make()` (a `build` call) on first use, under a lock.
    `get()` -> the module or None; `state`: {"ext": module or None} once tried (tests may set it)."""

    def __init__(self, make: Callable[[], Any]):
        self.make = make
        self.state: dict[str, Any] = {}
        self._lock = threading.Lock()

    def get(self) -> Any:
        """The loaded module (built on the first call), or None where it cannot be had."""
        st = self.state
        if "ext" not in st:
            with self._lock:
                if "ext" not in st:
                    st["ext"] = self.make()
        return st["ext"]
