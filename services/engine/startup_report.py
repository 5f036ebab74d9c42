"""The engine's startup report (docs/ARCHITECTURE.md §8): the device, each worker's report
(weights, KV cache, CUDA graphs, timings), the KV cache's size and the startup phases, logged
once and written to `<runtime_dir>/startup_report.json` for the supervisor to print."""

from __future__ import annotations

import json
import logging

from shared import protocol as P
from shared.device import detect_device
from shared.config import KestrelConfig
from shared.runtime_dir import write_private_file

log = logging.getLogger("kestrel.engine")


def write_startup_report(cfg: KestrelConfig, workers: list[P.WorkerReady], num_blocks: int,
                         kv_tokens: int, max_model_len: int, phases: dict[str, float]) -> None:
    """Log the startup report and write it to
    `<runtime_dir>/startup_report.json` (mode 0600) for the supervisor to print.
    phases: seconds since this engine started, per phase. Never raises."""
    try:
        report = {
            "device": detect_device().describe(),
            "workers": [dict(w.report, rank=w.rank, pid=w.pid)
                        for w in sorted(workers, key=lambda w: w.rank)],
            "num_blocks": num_blocks, "block_size": cfg.block_size,
            "kv_tokens": kv_tokens, "max_model_len": max_model_len,
            "phases": {k: round(v, 3) for k, v in phases.items()}}
        # One line here; the supervisor prints it formatted once the server is ready.
        log.info("startup report: %s", json.dumps(report, default=str))
        write_private_file(cfg.runtime_dir, "startup_report.json",
                           json.dumps(report, default=str))
    except Exception as e:  # the report must never stop the engine
        log.warning("startup report failed: %s", e)
