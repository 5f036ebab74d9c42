"""The `kestrel` command: serve, frontend, engine, worker, kvstore, fetch-model, shm."""

from __future__ import annotations

import argparse
import sys

from shared.config import add_cli_arguments, build_config

USAGE = """kestrel <command> [options]

commands:
  serve        start engine, worker and frontend on this host (supervised)
  frontend     run one API frontend process (connects to a running engine)
  engine       run the engine core process
  worker       run one model worker process
  kvstore      run the KV tier store (CPU pool in shm, disk tier; outlives engine restarts)
  fetch-model  download and convert the default model (SmolLM2-135M-Instruct)
  shm          inspect Kestrel shared-memory segments (ls, inspect, watch, clean)
"""


def _config_parser(prog: str, extra=None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog)
    add_cli_arguments(p)
    if extra:
        extra(p)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if argv else 2
    cmd, rest = argv[0], argv[1:]
    if cmd == "fetch-model":
        from services.worker.fetch_model import main as fetch_main

        return fetch_main(rest)
    if cmd == "shm":
        from shared.shm_tool import main as shm_main

        return shm_main(rest)
    if cmd not in ("serve", "frontend", "engine", "worker", "kvstore"):
        print(f"kestrel: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    extra = None
    if cmd == "worker":
        extra = lambda p: p.add_argument("--rank", type=int, default=0)  # noqa: E731
    elif cmd == "frontend":  # the supervisor's index: name frontend-<i>, SO_REUSEPORT if > 1
        extra = lambda p: p.add_argument("--frontend-index", type=int, default=0)  # noqa: E731
    args = _config_parser(f"kestrel {cmd}", extra).parse_args(rest)
    try:
        cfg = build_config(vars(args))
    except (ValueError, OSError) as e:
        print(f"kestrel {cmd}: {e}", file=sys.stderr)
        return 2
    if cmd == "serve":
        from services.supervisor.launcher import serve

        return serve(cfg)
    if cmd == "engine":
        from services.engine.core import run_engine

        return run_engine(cfg)
    if cmd == "kvstore":
        from services.kvstore.server import run_kvstore

        return run_kvstore(cfg)
    if cmd == "worker":
        from services.worker.worker import run_worker

        return run_worker(cfg, args.rank)
    from services.frontend.server import run_frontend

    return run_frontend(cfg, args.frontend_index) or 0


if __name__ == "__main__":
    sys.exit(main())
