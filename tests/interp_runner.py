"""Run a file of Triton kernel checks under the Triton interpreter, in a subprocess.

TRITON_INTERPRET must be set before triton is imported, so the checks run in a child
process of their own (`tests/unit/*_interp_checks.py`, or a test module run as a script);
such a script prints one line `RESULT <json>` with its measured errors, which the test
modules compare against their bounds. Every fixture of tests/unit that reads such a line
calls `run_interp_checks`.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
from typing import Any

ROOT = pathlib.Path(__file__).resolve().parents[1]


def run_interp_checks(script: str, *args: str, timeout_s: float = 300.0) -> dict[str, Any]:
    """Run `script` (a path relative to the repo root, or absolute) with its command-line
    `args` under TRITON_INTERPRET=1 (PYTHONPATH and cwd the repo root) and return the JSON
    object of its last `RESULT ` line: case name -> measured error (a float for most
    scripts; a list or a dict where the calling test module says so). Fails the test
    (AssertionError with the child's output tails) when the child exits non-zero or prints
    no result; subprocess.TimeoutExpired past timeout_s seconds."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(ROOT / script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout_s)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-2000:] + proc.stderr[-4000:]
    result: dict[str, Any] = json.loads(lines[-1][len("RESULT "):])
    return result
