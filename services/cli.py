"""The `kestrel` command: serve, frontend, engine, worker, kvstore, fetch-model, shm."""

from __future__ import annotations

import argparse
import os
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


STANDBY_HELP = ("import, then wait for 'go' on stdin before starting (the supervisor's spare "
                "for a fast restart: services/supervisor/standby.py)")

SIGPIPE_EXIT = 141  # 128 + SIGPIPE: what a shell reports for a tool whose reader went away


def _quiet_broken_pipe() -> int:
    """The reader of stdout went away (`kestrel shm watch X | head`): point stdout at
    /dev/null so the flush at exit raises nothing, and return SIGPIPE_EXIT."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):
        pass
    return SIGPIPE_EXIT


def _tool(cmd: str, rest: list[str]) -> int | None:
    """Run a short-lived command that writes to stdout (help, fetch-model, shm); None if
    `cmd` is a server process. Stdout is flushed here, so a closed pipe shows up inside."""
    if cmd in ("-h", "--help"):
        print(USAGE)
        return 0
    if cmd == "fetch-model":
        from services.worker.fetch_model import main as fetch_main

        return fetch_main(rest)
    if cmd == "shm":
        from shared.shm_tool import main as shm_main

        return shm_main(rest)
    if cmd not in ("serve", "frontend", "engine", "worker", "kvstore"):
        print(f"kestrel: unknown command {cmd!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return None


def main(argv: list[str] | None = None) -> int:
    """`kestrel <command> [options]`: argv without the program name (default sys.argv[1:]).
    Returns the exit code (2 for a usage or configuration error)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:
        print(USAGE)
        return 2
    cmd, rest = argv[0], argv[1:]
    if cmd in ("engine", "worker", "kvstore", "frontend"):
        # Under `kestrel serve`, Ctrl-C is the supervisor's: ignore it before the imports.
        from shared.procutil import ignore_sigint_if_supervised

        ignore_sigint_if_supervised()
    else:
        try:
            code = _tool(cmd, rest)
            if code is not None:
                sys.stdout.flush()
                return code
        except BrokenPipeError:
            return _quiet_broken_pipe()
    def extra(p: argparse.ArgumentParser) -> None:
        if cmd == "worker":
            p.add_argument("--rank", type=int, default=0)
        if cmd in ("engine", "worker"):
            p.add_argument("--standby", action="store_true", help=STANDBY_HELP)
        if cmd == "frontend":  # the supervisor's index: name frontend-<i>, SO_REUSEPORT if > 1
            p.add_argument("--frontend-index", type=int, default=0)

    try:
        args = _config_parser(f"kestrel {cmd}", extra).parse_args(rest)
    except SystemExit as e:  # --help or a usage error: argparse printed and exits
        try:
            sys.stdout.flush()
        except BrokenPipeError:
            return _quiet_broken_pipe()
        return int(e.code or 0) if not isinstance(e.code, str) else 2
    try:
        cfg = build_config(vars(args))
    except (ValueError, OSError) as e:
        print(f"kestrel {cmd}: {e}", file=sys.stderr)
        return 2
    if cmd == "serve":  # the supervisor checks the kvstore's settings before it starts any
        from services.kvstore.settings import check as check_kvstore
        from services.supervisor.launcher import serve

        return serve(cfg, check_kvstore)
    if cmd == "engine":
        from services.engine.process import run_engine  # the heavy imports (torch, xgrammar)
        from shared.procutil import await_activation, exit_now

        if args.standby and not await_activation("kestrel:engine-standby"):
            exit_now(0)
        exit_now(run_engine(cfg))  # the engine group's restart waits for this exit
    if cmd == "kvstore":
        from services.kvstore.server import run_kvstore

        return run_kvstore(cfg)
    if cmd == "worker":
        from services.worker.worker import run_worker
        from shared.procutil import await_activation, exit_now

        if args.standby:
            import services.worker.model_runner  # noqa: F401 (run_worker's heavy import, done now)

            if not await_activation(f"kestrel:worker-standby:{args.rank}"):
                exit_now(0)
        exit_now(run_worker(cfg, args.rank))
    from services.frontend.server import run_frontend

    run_frontend(cfg, args.frontend_index)
    return 0


if __name__ == "__main__":
    sys.exit(main())
