"""The restart-count file of an instance: `<runtime_dir>/restarts.json`.

Written by the supervisor after every restart (`write_restart_counts`), read by the
frontends for /metrics (`read_restart_counts`); a JSON object of process role -> restarts,
e.g. `{"engine": 1, "worker-0": 1, "frontend-0": 0}`. It lives in shared/ because two
services use it (docs/ARCHITECTURE.md §8).
"""

from __future__ import annotations

import json
import os

RESTARTS_FILE = "restarts.json"


def write_restart_counts(runtime_dir: str, counts: dict[str, int]) -> None:
    """Write `counts` (process role -> restarts) to <runtime_dir>/restarts.json atomically
    (a temporary file renamed into place). Raises OSError when the folder is not writable."""
    path = os.path.join(runtime_dir, RESTARTS_FILE)
    tmp = path + ".tmp"
    with open(tmp, "w") as fh:
        json.dump(counts, fh)
    os.replace(tmp, path)


def read_restart_counts(runtime_dir: str) -> dict[str, int]:
    """Restarts per process role of the instance at `runtime_dir` ({} before the first
    write, or when the supervisor is gone). Never raises for a missing or malformed file."""
    try:
        with open(os.path.join(runtime_dir, RESTARTS_FILE)) as fh:
            return {str(k): int(v) for k, v in json.load(fh).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
