"""The restart-count file of an instance: `<runtime_dir>/restarts.json`.

Written by the supervisor after every restart (`write_restart_counts`), read by the
frontends for /metrics (`read_restart_counts`); a JSON object of process role -> restarts,
e.g. `{"engine": 1, "worker-0": 1, "frontend-0": 0}`. It lives in shared/ because two
services use it (docs/ARCHITECTURE.md §8).
"""

from __future__ import annotations

import json
import os

from shared.runtime_dir import write_private_file

RESTARTS_FILE = "restarts.json"


def write_restart_counts(runtime_dir: str, counts: dict[str, int]) -> None:
    """Write `counts` (process role -> restarts) to <runtime_dir>/restarts.json atomically
    (`write_private_file`: a private temporary file renamed into place, mode 0600).
    Raises OSError when the folder is not writable."""
    write_private_file(runtime_dir, RESTARTS_FILE, json.dumps(counts))


def read_restart_counts(runtime_dir: str) -> dict[str, int]:
    """Restarts per process role of the instance at `runtime_dir` ({} before the first
    write, or when the supervisor is gone). Never raises for a missing or malformed file."""
    try:
        with open(os.path.join(runtime_dir, RESTARTS_FILE)) as fh:
            return {str(k): int(v) for k, v in json.load(fh).items()}
    except (OSError, ValueError, AttributeError, TypeError):
        return {}
