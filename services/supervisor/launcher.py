"""`kestrel serve`: start the engine, the worker and the frontend as supervised processes.

Order: sweep stale shm segments, write the resolved config (values and sources) for the
children, start engine + worker + frontend, wait until the frontend's /health says 200 and
print the URL. Every child asks the kernel for SIGTERM when the supervisor dies
(PR_SET_PDEATHSIG), so a kill -9 of the supervisor leaves no orphan.

Policies (docs/ARCHITECTURE.md §8):
- A frontend dies: only that frontend is restarted, under the same name (`frontend-<i>`),
  so the engine aborts the dead one's requests at its hello. `--frontends N` runs N of them
  on one port (SO_REUSEPORT); the others keep serving. With N > 1 the frontends keep their
  request metrics in prometheus_client's multiprocess mode (`PROMETHEUS_MULTIPROC_DIR` =
  `<runtime_dir>/metrics`, emptied at start), so the /metrics of any one of them sums all.
- The engine or a worker dies: the rest of the engine group is stopped (the engine fails its
  requests in flight), stale segments are swept, and engine + workers start again. The
  frontends answer 503 + Retry-After meanwhile and re-attach to the new engine by themselves.
- Restarts back off exponentially (restart.py). A unit that fails more than restart_max
  times within restart_window_s makes `serve` stop everything and exit 1. Restart counts
  per process are in `<runtime_dir>/restarts.json` (shared.restart_counts).
- An engine that exits with EXIT_CONFIG (2: it refused its configuration, e.g. a
  max_model_len over the KV cache; it also leaves CONFIG_REFUSED in the runtime folder, as
  its exit code is lost when the supervisor's SIGTERM finds it exiting), or a worker that
  refused its own (a model it cannot load: it leaves the same note), would refuse it
  again: `serve` stops at once and exits 2 with the note's reason as its last line on
  stderr, and a server that never became ready has no requests to drain (frontends get
  GRACE_S, not --shutdown-timeout; one still waiting for the engine exits at once).
- The kvstore (when kv_offload_cpu_gib > 0; its settings are checked before anything
  starts by the kvstore's own check, which `kestrel serve` hands to `serve`
  (services.kvstore.settings.check): exit 2 with the message when they cannot work) is its
  own restart unit: it starts first, is not touched when the engine group restarts (a
  restarted engine finds its prefixes warm), and is restarted alone when it dies (the
  engine carries on without tiers meanwhile and reconnects). It stops last.
- A watchdog thread (watchdog.py) writes stack dumps of processes that stop making progress,
  and of the workers the engine gives up on, before they are killed (dump, then kill).
- With cfg.engine_standby (default on), a restart of the engine group activates a spare
  engine and worker that already imported their modules (standby.py), made once the group
  has served for a while; without a spare a fresh process starts.

Stop (SIGTERM or Ctrl-C): the frontends drain (they keep listening and answer new requests
with 503 + Retry-After; requests in flight get up to --shutdown-timeout seconds), then the
engine (which tells the workers to exit and unlinks its ring), then the workers; SIGKILL
after a grace period. Then the instance's runtime folder and any of its shm segments are
removed; the exit code is 0. Ctrl-C in a terminal sends SIGINT to the whole process group:
the children ignore SIGINT when started by a supervisor (KESTREL_SUPERVISOR_PID), so only
this orderly drain happens.

The runtime folder and the watchdog's dump folder are private (shared/runtime_dir.py):
made with mode 0700 at start, or, when they exist, taken only if they are real folders of
this user with no group/other bits; otherwise `serve` exits 2 naming the folder and the
problem, before it writes anything. Files in the runtime folder (config.json with the API
key, owner.json, restarts.json) are written as new private files renamed into place, never
through a planted symlink. The runtime folder holds `owner.json`; at start, the folders of
instances whose supervisor is dead (kill -9) are removed, never a live one's. At stop the
runtime folder goes, and the dump folder too when it is empty.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable

from services.supervisor.restart import RestartPolicy
from services.supervisor.standby import STANDBY_DELAY_S, IdleGate, Standby
from services.supervisor.watchdog import Watchdog, WatchdogConfig, load_watchdog_config
from shared.config import KestrelConfig, check_cpu_kv_cache
from shared.gguf_source import require_gguf
from shared.model_spec import model_spec_for
from shared.procutil import (CONFIG_REFUSED, EXIT_CONFIG, set_title, setup_logging,
                             spawn_supervised)
from shared.restart_counts import write_restart_counts
from shared.runtime_dir import (private_dir, remove_if_empty, sweep_dead_runtime_dirs,
                                write_owner, write_private_file)

log = logging.getLogger("kestrel.supervisor")

GRACE_S = 10.0
WORKER_OWN_EXIT_S = 5.0  # at stop: time for workers to exit after the engine's shutdown message


class Child:
    """One supervised process: its role name, command line and Popen handle."""

    def __init__(self, role: str, argv: list[str], env: dict[str, str], standby: bool = False):
        self.role = role
        self.argv = argv
        self.env = env
        self.proc: subprocess.Popen | None = None
        self.standby = Standby(role, argv, env) if standby else None

    def start(self) -> None:
        """Start (or start again) the process, from its standby when one is ready; the
        previous handle is dropped."""
        spare = self.standby.take() if self.standby is not None else None
        self.proc = spare or spawn_supervised(self.argv, env=self.env)
        log.info("started %s (pid %d%s)", self.role, self.proc.pid,
                 ", its standby" if spare else "")

    def alive(self) -> bool:
        """Started and not exited yet."""
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        """Send `sig` if the process runs; a process that just exited is no error."""
        proc = self.proc
        if proc is not None and proc.poll() is None:
            try:
                proc.send_signal(sig)
            except ProcessLookupError:
                pass

    def exit_info(self) -> tuple[int, int | None]:
        """(pid, exit code or None while it runs) of the last start; (0, None) before one."""
        return (0, None) if self.proc is None else (self.proc.pid, self.proc.returncode)

    def wait(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the exit; True once exited (or never started)."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout=max(timeout, 0.0))
            return True
        except subprocess.TimeoutExpired:
            return False


METRICS_DIR = "metrics"  # <runtime_dir>/metrics: the frontends' shared request metrics


def _frontend_env(cfg: KestrelConfig, env: dict[str, str]) -> dict[str, str]:
    """The frontends' environment. With several frontends on one port a scrape of /metrics
    reaches any one of them, so they share their request metrics: prometheus_client's
    multiprocess mode, in a private folder of the runtime folder emptied now (counts of a
    restarted frontend stay, as the engine's do)."""
    if cfg.frontends <= 1:
        return env
    folder = os.path.join(cfg.runtime_dir, METRICS_DIR)
    shutil.rmtree(folder, ignore_errors=True)
    private_dir(folder)
    return dict(env, PROMETHEUS_MULTIPROC_DIR=folder)


def _health_url(cfg: KestrelConfig) -> str:
    host = "127.0.0.1" if cfg.host in ("0.0.0.0", "", "::") else cfg.host
    return f"http://{host}:{cfg.port}/health"


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1.0) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def _sweep_runtime_dirs(base: str) -> None:
    """Remove the runtime folders under `base` of instances whose supervisor is dead
    (shared.runtime_dir)."""
    try:
        for path in sweep_dead_runtime_dirs(base=base):
            log.info("removed the runtime folder of a dead instance: %s", path)
    except Exception as e:  # never block startup on the sweep
        log.warning("runtime folder sweep failed: %s", e)


def _sweep(instance_id: str | None) -> None:
    try:
        from shared.shm_tool import sweep_stale

        removed = sweep_stale(instance_id)
        if removed:
            log.info("removed stale shm segments: %s", ", ".join(removed))
    except Exception as e:  # never block startup on the sweep
        log.warning("stale segment sweep failed: %s", e)


class Supervisor:
    """The children of one `kestrel serve` and the policies that restart them.

    Restart units: the engine group (engine + workers, always restarted together, with
    the instance's stale shm segments swept in between) and each frontend alone.
    """

    def __init__(self, cfg: KestrelConfig, resolved: str, env: dict[str, str]):
        self.cfg = cfg
        base = [sys.executable, "-m", "services.cli"]
        spare = bool(cfg.engine_standby)
        self.engine_group = [
            Child("engine", base + ["engine", "--resolved-config", resolved], env, spare),
            Child("worker-0", base + ["worker", "--rank", "0", "--resolved-config", resolved], env,
                  spare),
        ]
        self.group_started = time.monotonic()  # the engine group's last (re)start
        self.standby_gate = IdleGate(cfg.standby_idle_wait_s)  # spares wait for an idle group
        fe_env = _frontend_env(cfg, env)
        self.frontends = [
            Child(f"frontend-{i}", base + ["frontend", "--frontend-index", str(i),
                                           "--resolved-config", resolved], fe_env)
            for i in range(max(cfg.frontends, 1))]
        self.kvstore = [Child("kvstore", base + ["kvstore", "--resolved-config", resolved], env)
                        ] if (cfg.kv_offload_cpu_gib or 0) > 0 else []
        self.children = self.kvstore + self.engine_group + self.frontends
        self.policies = {u: RestartPolicy(cfg.restart_max, cfg.restart_window_s)
                         for u in ["engine"] + [c.role for c in self.kvstore + self.frontends]}
        self.restarts = {c.role: 0 for c in self.children}
        self.pending: dict[str, float] = {}  # unit -> time.monotonic() to start it at
        self.gave_up = False
        self.config_refused = False  # gave up because the engine group refused its configuration
        self.refusal: str | None = None  # then: who refused and why (the CONFIG_REFUSED note)

    def start_all(self) -> None:
        """Start every child (kvstore, engine group, frontends) and write the restart counts."""
        for c in self.children:
            c.start()
        self._write_counts()

    def _write_counts(self) -> None:
        try:
            write_restart_counts(self.cfg.runtime_dir, self.restarts)
        except OSError as e:
            log.warning("could not write restart counts: %s", e)

    def _schedule(self, unit: str) -> None:
        delay = self.policies[unit].on_failure()
        if delay is None:
            log.error("%s failed %d times within %.0f s: giving up", unit,
                      self.cfg.restart_max + 1, self.cfg.restart_window_s)
            self.gave_up = True
            return
        log.info("restarting %s in %.1f s", unit, delay)
        self.pending[unit] = time.monotonic() + delay

    def poll(self) -> None:
        """Notice dead children, schedule and run restarts. Sets gave_up when a unit
        failed more than restart_max times within restart_window_s."""
        for f in self.frontends:
            if f.role not in self.pending and not f.alive():
                log.error("%s (pid %d) exited with code %s; the engine keeps running",
                          f.role, *f.exit_info())
                self._schedule(f.role)
        for k in self.kvstore:
            if k.role not in self.pending and not k.alive():
                log.error("kvstore (pid %d) exited with code %s; the engine carries on without "
                          "KV tiers until it is back", *k.exit_info())
                self._schedule(k.role)
        if "engine" not in self.pending:
            dead = [c for c in self.engine_group if not c.alive()]
            if dead:
                for c in dead:
                    log.error("%s (pid %d) exited with code %s", c.role, *c.exit_info())
                self._stop_engine_group()  # the engine's own exit code is known after this
                engine = self.engine_group[0].proc
                note = _refusal_note(self.cfg.runtime_dir)
                if note is not None or (engine is not None and engine.returncode == EXIT_CONFIG):
                    self.refusal = note or f"the engine refused its configuration (exit code {EXIT_CONFIG})"
                    log.error("%s: not restarting the engine group", self.refusal)
                    self.gave_up = self.config_refused = True
                    return
                self._schedule("engine")
        now = time.monotonic()
        for unit, at in list(self.pending.items()):
            if now < at or self.gave_up:
                continue
            del self.pending[unit]
            group = self.engine_group if unit == "engine" else \
                [c for c in self.kvstore + self.frontends if c.role == unit]
            for c in group:
                self.restarts[c.role] += 1
                c.start()
            if unit == "engine":
                self.group_started = time.monotonic()
            self._write_counts()

    def wants_standbys(self) -> bool:
        """Whether spares are missing while the engine group has run STANDBY_DELAY_S
        without a restart pending and is idle, or cfg.standby_idle_wait_s more seconds have
        passed (`IdleGate`; then `make_standbys` once /health says 200)."""
        return ("engine" not in self.pending
                and time.monotonic() - self.group_started >= STANDBY_DELAY_S
                and all(c.alive() for c in self.engine_group)
                and any(c.standby is not None and not c.standby.alive()
                        for c in self.engine_group)
                and self.standby_gate.open([c.proc.pid for c in self.engine_group if c.proc is not None],
                                           self.group_started + STANDBY_DELAY_S))

    def make_standbys(self) -> None:
        """Start the missing spares of the engine group (standby.py)."""
        for c in self.engine_group:
            if c.standby is not None and not c.standby.alive():
                c.standby.spawn()

    def _stop_engine_group(self) -> None:
        """Stop what is left of the engine group (the engine first: it fails the requests
        in flight and unlinks its ring), then sweep the instance's stale segments."""
        _stop_group(self.engine_group[:1], 5.0)
        _stop_group(self.engine_group[1:], 3.0)
        _sweep(self.cfg.instance_id)

    def stop_all(self, drain: bool = True) -> None:
        """Graceful stop: frontends drain for up to cfg.shutdown_timeout seconds (drain
        False: a server that never served has nothing to drain, GRACE_S only), then the
        engine, then the workers; SIGKILL for any that outstay their grace."""
        self.pending.clear()
        for c in self.engine_group:
            if c.standby is not None:
                c.standby.stop()
        _stop_group(self.frontends, (self.cfg.shutdown_timeout if drain else 0.0) + GRACE_S)
        _stop_group(self.engine_group[:1], GRACE_S)
        # The engine told its workers to exit: let them finish on their own (a SIGTERM in
        # the middle of interpreter shutdown would end one with -15), then signal.
        _stop_group(self.engine_group[1:], GRACE_S, own_exit_s=WORKER_OWN_EXIT_S)
        _stop_group(self.kvstore, GRACE_S)  # last: it finishes its queued disk writes


def _refusal_note(runtime_dir: str) -> str | None:
    """Who refused the configuration and why, from the note the engine or a worker leaves in
    the runtime folder before it exits EXIT_CONFIG (CONFIG_REFUSED: "the engine refused its
    configuration: <why>", "worker <rank> refused ..."), or None when there is none."""
    try:
        with open(os.path.join(runtime_dir, CONFIG_REFUSED), encoding="utf-8") as fh:
            return fh.read().strip() or None
    except OSError:
        return None


def _stop_group(group: list[Child], grace: float, own_exit_s: float = 0.0) -> None:
    """Wait up to `own_exit_s` seconds for the children of `group` to exit by themselves,
    then SIGTERM every live one, wait up to `grace` seconds, then SIGKILL."""
    own_deadline = time.monotonic() + own_exit_s
    for c in group:
        c.wait(own_deadline - time.monotonic())
    deadline = time.monotonic() + grace
    for c in group:
        c.signal(signal.SIGTERM)
    for c in group:
        c.wait(deadline - time.monotonic())
    for c in group:
        if c.alive():
            log.warning("%s did not stop in %.0f s: killing it", c.role, grace)
            c.signal(signal.SIGKILL)
            c.wait(5.0)
        if c.proc is not None and c.proc.returncode is not None:
            log.info("%s (pid %d) stopped with exit code %d", c.role, c.proc.pid,
                     c.proc.returncode)


def _log_startup_report(cfg: KestrelConfig, ready_s: float) -> None:
    """Print the engine's startup report (`<runtime_dir>/startup_report.json`, written by
    EngineProcess.start) with the supervisor's own phase `ready` (seconds from the start of
    the children to the first healthy /health) and the source of the worker's thread count
    (`num_threads`: "cli", or "derived: <how>" from shared.cpu_budget) added."""
    from shared.startup_report import format_startup_report

    try:
        with open(os.path.join(cfg.runtime_dir, "startup_report.json")) as fh:
            report = json.load(fh)
    except (OSError, ValueError) as e:
        log.warning("no startup report from the engine: %s", e)
        return
    report.setdefault("phases", {})["ready"] = round(ready_s, 3)
    source = cfg.source("num_threads")
    report["threads_source"] = f"{source}: {cfg.threads_detail}" if cfg.threads_detail else source
    for line in format_startup_report(report):
        log.info("%s", line)


def _private_folders(cfg: KestrelConfig, wc: WatchdogConfig) -> bool | None:
    """Make (or check) the dump folder and the runtime folder, private to this user
    (shared.runtime_dir.private_dir). Returns whether the dump folder was made now, or None
    after logging and printing why a folder is refused (nothing written then: a dump folder
    made by this call is removed again)."""
    made_dumps = False
    try:
        made_dumps = private_dir(wc.dump_dir)
        private_dir(cfg.runtime_dir)
        return made_dumps
    except OSError as e:
        log.error("%s", e)
        print(f"kestrel serve: {e}", file=sys.stderr, flush=True)
        if made_dumps:
            remove_if_empty(wc.dump_dir)
        return None


def _port_refusal(host: str, port: int) -> str | None:
    """Why the frontends could not listen on host:port, or None. A test bind without
    SO_REUSEPORT: it fails both for a plain listener and for another Kestrel whose frontends
    share the port with SO_REUSEPORT (which ours would otherwise silently join)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind((host, port))
    except OSError as e:
        return (f"cannot listen on {host}:{port} ({e.strerror or e}): another process (perhaps "
                "another Kestrel) holds that port, or the address is not this host's; stop it, "
                "or choose another --port / --host")
    return None


def serve(cfg: KestrelConfig, check_kvstore: Callable[[KestrelConfig], str]) -> int:
    """Run the whole server on this host until SIGTERM/SIGINT. Returns the exit code:
    0 after a signal, 1 when a process kept failing (restart policy gave up) or the server
    was not ready within cfg.startup_timeout_s, 2 for a bad model folder (under gguf: a GGUF
    file cut short, `require_gguf(data=True)`), a CPU KV cache too small for max_model_len
    (`check_cpu_kv_cache`), watchdog config or kvstore settings, a host:port
    the frontends could not listen on (`_port_refusal`), a runtime
    or dump folder that is not private (`_private_folders`), or a configuration the engine
    group refused (its reason is the last line on stderr). check_kvstore: the kvstore's check of its settings (a summary line;
    raises ValueError with the message when they cannot work), run when offload is on; the
    caller passes it so that the supervisor imports no other service."""
    set_title("kestrel:supervisor")
    setup_logging("supervisor", cfg.log_level)
    log.info("effective settings:\n%s", cfg.table())
    if cfg.profile_detail:
        log.info("%s", cfg.profile_detail)
    try:
        model_spec_for(cfg)
        check_cpu_kv_cache(cfg)  # max_model_len in the CPU KV cache: before loading the weights
        if cfg.quantization == "gguf":  # the whole file, not only the config builder's header check
            require_gguf(cfg.model, data=True)
    except ValueError as e:  # a ModelFolderError, or the GGUF (shared.gguf_source)
        log.error("%s", e)
        print(f"kestrel serve: {e}", file=sys.stderr, flush=True)
        return 2
    try:
        wc = load_watchdog_config(cfg)
    except ValueError as e:
        log.error("%s", e)
        return 2
    if (cfg.kv_offload_cpu_gib or 0) > 0:
        try:
            summary = check_kvstore(cfg)
        except ValueError as e:
            log.error("%s", e)
            print(f"kestrel serve: {e}", file=sys.stderr, flush=True)
            return 2
        log.info("kvstore: %s", summary)
    why = _port_refusal(cfg.host, cfg.port)
    if why:
        log.error("%s", why)
        print(f"kestrel serve: {why}", file=sys.stderr, flush=True)
        return 2
    _sweep(None)
    _sweep_runtime_dirs(os.path.dirname(os.path.abspath(cfg.runtime_dir)))
    made_dumps = _private_folders(cfg, wc)
    if made_dumps is None:
        return 2
    write_owner(cfg.runtime_dir, cfg.instance_id)  # lets a later serve remove it if we die
    resolved = write_private_file(cfg.runtime_dir, "config.json", cfg.to_json())
    env = dict(os.environ, KESTREL_SUPERVISOR_PID=str(os.getpid()))
    sup = Supervisor(cfg, resolved, env)
    watchdog = Watchdog(cfg.runtime_dir, wc)
    stop = {"sig": None}

    def on_signal(signum, frame):
        stop["sig"] = signum

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    t0 = time.monotonic()
    code = 0
    url = _health_url(cfg)
    ready = False
    try:
        sup.start_all()
        watchdog.start()
        while stop["sig"] is None:
            sup.poll()
            if sup.gave_up:
                code = EXIT_CONFIG if sup.config_refused else 1
                break
            if ready and sup.wants_standbys() and _healthy(url):
                sup.make_standbys()
            if not ready:
                if _healthy(url):
                    ready = True
                    base_url = url[: -len("/health")]
                    log.info("ready in %.1f s", time.monotonic() - t0)
                    _log_startup_report(cfg, time.monotonic() - t0)
                    print(f"Kestrel is serving {cfg.served_model_name} at {base_url}/v1", flush=True)
                elif time.monotonic() - t0 > cfg.startup_timeout_s:
                    log.error("not ready after %.0f s", cfg.startup_timeout_s)
                    code = 1
                    break
            time.sleep(0.1)
        if stop["sig"] is not None:
            log.info("%s received: draining for up to %.0f s (new requests get 503)",
                     signal.Signals(stop["sig"]).name, cfg.shutdown_timeout)
    finally:
        watchdog.stop()
        sup.stop_all(drain=ready)
        shutil.rmtree(cfg.runtime_dir, ignore_errors=True)
        if made_dumps:
            remove_if_empty(wc.dump_dir)
        _sweep(cfg.instance_id)
    log.info("stopped (exit code %d)", code)
    if sup.refusal is not None:  # the reason, last: the lines above are the stop's
        print(f"kestrel serve: {sup.refusal}", file=sys.stderr, flush=True)
    return code
