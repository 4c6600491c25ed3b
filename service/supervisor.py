"""`convserve serve`'s processes: one model worker per device (service/worker/model_worker.py) and the
HTTP front ends (service/frontend/app.py) in front of them, all started here and kept running
(`serve`; the CLI, service/cli/main.py, checks the settings, the models and the port, then calls it).

    main process        supervisor + HTTP front end 0 (uvicorn), the one signals go to
    front ends 1..F-1   more uvicorn servers on the port, each on its own socket (service/listen_sockets.py)
    model workers       one per GPU (CONVSERVE_DEVICES), or one for the CPU / Apple GPU

Front ends and workers meet through Unix sockets in a private run directory (0700), and tensors
travel in each front end's shared-memory arena (service/ipc/shm.py). SIGTERM drains every front end
(in-flight work finishes, up to SHUTDOWN_GRACE_S), then stops the workers.

The rules this module keeps for its children (it alone starts, kills and reaps them):
- A child that dies is reaped at once (no zombie), its exit code or signal is logged, and it is
  started again: at once if it had lived STABLE_AFTER_S, else after a pause that doubles while
  it keeps dying. The requests a dead worker held are answered 503 `worker-died` by their front
  ends, which reconnect when it is back; a dead front end's arena leaves the workers with its link.
- A worker that is hung (service/ipc/heartbeat.py: no heartbeat, or one model call running, past the
  hang limit) is killed here, with SIGKILL (a stopped or deadlocked process answers nothing
  else), then reaped and restarted as any dead child. Front ends never kill: they stop sending
  to a worker whose heartbeat is late, and it is ready again if it beats before the limit.
- One watch thread (`_watch`) does all of the above, so it must outlive anything one of its turns
  meets: an error in a turn is logged and the next turn comes, and a child's process is visible
  to it only once started (a Process still being spawned has no sentinel to wait on).
- Nothing starts again once a drain or stop has begun: a restart and the stop take one lock, so
  a stop either comes first or waits for the start and then signals the child it made.
- A worker's first load that fails, or its death before that load is done, ends start-up
  (`_first_loads`: `convserve serve` exits 2 with one line); a restarted worker whose load
  fails stays up, not ready, and its requests get 503s."""
from __future__ import annotations

import logging
import multiprocessing
import os
import shutil
import signal
import socket
import tempfile
import threading
import time
from contextlib import contextmanager
from dataclasses import replace
from multiprocessing.connection import wait
from typing import Iterator

from . import listen_sockets, metrics, threads
from .ipc import heartbeat
from .process_plan import frontend_priority_warning, frontends_for, pins, plan_devices
from .settings import Settings
from .worker.model_worker import STOP_SIGNAL, WorkerSpec
from .worker.model_worker import main as worker_main

log = logging.getLogger("convserve.supervisor")

#: a process that lived this long before dying is restarted at once; sooner, after a pause that
#: doubles each time (up to MAX_PAUSE_S), so a crash loop does not spin
STABLE_AFTER_S = 60.0
MAX_PAUSE_S = 30.0
#: how often the supervisor looks for dead and hung children
WATCH_S = 0.5
#: a child whose sentinel fired has closed its last descriptor and is exiting: its exit status
#: is there within milliseconds (joining with no wait saw it still running, and left a zombie)
REAP_S = 5.0


class _Child:
    """One kept-running child process: how to start it and its restart pause."""

    def __init__(self, name: str, target, args: tuple, fresh_args=None):  # fresh_args: made at each start
        self.name, self.target, self.args, self.fresh_args = name, target, args, fresh_args
        self.proc: multiprocessing.Process | None = None
        self.started = 0.0
        self.pause = 1.0
        self.restarts = 0
        #: a worker's heartbeat record (service/ipc/heartbeat.py); None for a front end
        self.beat: heartbeat.BeatReader | None = None
        #: why it was killed here (hung), for the line that reports its death
        self.killed_for: str | None = None

    def start(self, ctx) -> None:
        self.started = time.monotonic()  # before it starts: its first beat is later than this
        self.killed_for = None
        args = self.fresh_args() if self.fresh_args else self.args
        proc = ctx.Process(target=self.target, args=args, name=self.name, daemon=False)
        proc.start()
        # published only once started: the watch thread reads `proc.sentinel`, which a Process
        # still being spawned (tens of ms on a loaded box) does not have yet
        self.proc = proc
        if self.fresh_args:  # the child has its own copies now (listen_sockets.OwnSocketArgs)
            self.fresh_args.started()


def exit_text(code: int | None) -> str:
    """multiprocessing's exit code as words: a negative code is the signal that ended it."""
    if code is None:
        return "no exit status yet"
    if code < 0:
        try:
            return f"signal {signal.Signals(-code).name}"
        except ValueError:
            return f"signal {-code}"
    return f"exit code {code}"


class Supervisor:
    def __init__(self, settings: Settings):
        self.settings = settings
        self.ctx = multiprocessing.get_context("spawn")
        self.devices = plan_devices(settings)
        self.pins = pins(settings, self.devices)  # PIN_WORKERS: applied when the workers start
        self.run_dir = tempfile.mkdtemp(prefix="convserve-run-")  # 0700: only this user connects
        self.endpoints = [(d.label, os.path.join(self.run_dir, f"worker-{i}.sock"))
                          for i, d in enumerate(self.devices)]
        self.workers: list[_Child] = []
        self.frontends: list[_Child] = []
        self._stopping = threading.Event()
        self._lock = threading.Lock()
        #: why start-up failed (a worker's first load did), and what to call then (the CLI's:
        #: it ends the server, which exits 2 with this line)
        self.fatal: str | None = None
        self.on_fatal = lambda: None

    # ---- workers ---------------------------------------------------------------------------------
    def start_workers(self) -> None:
        group = tuple(address for _, address in self.endpoints)  # shards=N: the first N (service/worker/shard_leader.py)
        if self.pins is not None:  # this process and all it starts on the rest; each worker moves to its own core
            threads.pin_process(self.pins.rest)
            log.info("model workers pinned to cores %s, the front ends to the other %d (PIN_WORKERS=on)",
                     ", ".join(str(min(c)) for c in self.pins.workers), len(self.pins.rest))
        for i, (device, (label, address)) in enumerate(zip(self.devices, self.endpoints)):
            cpus = tuple(sorted(self.pins.workers[i])) if self.pins is not None else ()
            spec = WorkerSpec(label, device.cuda_visible, address, self.settings, os.getpid(), group, cpus=cpus)
            child = _Child(f"convserve-worker-{label}", worker_main, (spec,))
            heartbeat.create(heartbeat.beat_path(address))
            child.beat = heartbeat.BeatReader(heartbeat.beat_path(address))
            self.workers.append(child)
        reports = {}
        for child in self.workers:
            spec = child.args[0]
            reports[spec.device], sender = self.ctx.Pipe(duplex=False)
            child.args = (replace(spec, report=sender),)
            child.start(self.ctx)  # (spawn pickles the args here, the sender with them)
            child.args = (spec,)  # a restart reports nothing: its load failure is served as 503s
            sender.close()  # the worker's copy only: its death before reporting reads as EOF
            metrics.WORKER_UP.labels(self._device_of(child)).set(1)
        threads.start(self._watch, "convserve-supervisor")
        threads.start(self._first_loads, "convserve-first-loads", (reports,))

    def _first_loads(self, reports: dict) -> None:
        """Each worker's first load, as it reports it (service/worker/model_host.py): one that failed
        (weights that do not parse, a backend or dtype that cannot run), or a worker that died
        before reporting, fails start-up: `fatal` says why, `on_fatal` ends the server. Serving
        on, live but never ready, would leave an orchestrator nothing to restart."""
        pending = {conn: device for device, conn in reports.items()}
        while pending and not self._stopping.is_set():
            for conn in wait(list(pending), timeout=0.5):  # then looks at _stopping again
                device = pending.pop(conn)
                try:
                    error = conn.recv()
                except (EOFError, OSError):
                    error = "it exited while loading (the log above says how)"
                conn.close()
                if error is not None and not self._stopping.is_set():
                    self.fatal = f"model worker {device} failed to load its models: {error}"
                    self._stopping.set()  # no restarts now: a front end killed while starting stays down
                    self.on_fatal()
                    return

    def add_frontend(self, name: str, target, args: tuple, fresh_args=None) -> None:
        child = _Child(name, target, args, fresh_args)
        self.frontends.append(child)
        child.start(self.ctx)

    def _device_of(self, child: _Child) -> str:
        return child.args[0].device if child in self.workers else child.name

    def _watch(self) -> None:
        """Reaps each child that dies and starts it again when its pause is over. The pauses run
        side by side, never one after another in this loop: waiting one out here held back every
        other death (a shard group's two workers came back 2 s apart, a crash-looping worker kept
        a dead front end down for up to MAX_PAUSE_S) and the hang checks meanwhile."""
        limit = heartbeat.hang_limit(self.settings)
        due: dict[_Child, float] = {}  # dead children, each waiting out its pause: when it starts again
        while not self._stopping.is_set():
            try:
                self._watch_once(limit, due)
            except Exception:  # noqa: BLE001 - this thread alone reaps and restarts: it must outlive any one error
                log.exception("the supervisor's watch failed; watching on")
                time.sleep(WATCH_S)

    def _watch_once(self, limit: float, due: dict) -> None:
        """One turn of `_watch`: reaps what died, starts what is due, kills what is hung."""
        with self._lock:
            children = [c for c in (*self.workers, *self.frontends) if c.proc is not None and c not in due]
        sentinels = {c.proc.sentinel: c for c in children}
        soonest = min(due.values(), default=time.monotonic() + WATCH_S)
        for sentinel in wait(list(sentinels), timeout=min(WATCH_S, max(0.0, soonest - time.monotonic()))):
            if self._stopping.is_set():
                return
            child = sentinels[sentinel]
            due[child] = time.monotonic() + self._reap(child)
        now = time.monotonic()
        for child in [c for c, at in due.items() if at <= now]:
            if self._stopping.is_set():
                return
            try:
                self._start_again(child)
            except Exception:  # noqa: BLE001 - e.g. out of descriptors: tried again after its pause
                log.exception("%s could not be started again; trying again in %gs", child.name, child.pause)
                due[child] = time.monotonic() + child.pause
                continue
            del due[child]
        if not self._stopping.is_set():
            self._kill_hung(limit, skip=due)

    def _kill_hung(self, limit: float, skip=()) -> None:
        """skip: dead workers waiting to start again (their pid may be another process's now)."""
        now = time.monotonic()
        for child in self.workers:
            if child in skip:
                continue
            why = None if child.killed_for else child.beat.hung(now, limit, child.started)
            if why is None:
                continue
            log.error("%s (pid %s) is hung: %s (the limit is %gs, CONVSERVE_WORKER_HANG_S); killing it",
                      child.name, child.proc.pid, why, limit)
            child.killed_for = f"hung: {why}"
            try:
                os.kill(child.proc.pid, signal.SIGKILL)  # its sentinel fires: _watch reaps and restarts it
            except ProcessLookupError:
                pass

    def _reap(self, child: _Child) -> float:
        """A dead child reaped, logged and counted; returns its pause before it starts again."""
        proc = child.proc
        proc.join(REAP_S)  # reaped now: no zombie, and its real exit status
        lived = time.monotonic() - child.started
        worker = child in self.workers
        log.error("%s (pid %s) died (%s%s) after %.1fs; restarting", child.name, proc.pid, exit_text(proc.exitcode),
                  f", killed here: {child.killed_for}" if child.killed_for else "", lived)
        if os.environ.get(metrics.MULTIPROC_ENV):
            from prometheus_client import multiprocess
            multiprocess.mark_process_dead(proc.pid)  # its live gauges leave the sums
        if worker:
            metrics.WORKER_UP.labels(self._device_of(child)).set(0)
            metrics.WORKER_RESTARTS.labels(self._device_of(child)).inc()
        child.pause = 1.0 if lived >= STABLE_AFTER_S else min(MAX_PAUSE_S, child.pause * 2)
        return 0.0 if lived >= STABLE_AFTER_S else child.pause

    def _start_again(self, child: _Child) -> None:
        # under the lock that stopping takes (_no_more_restarts): a stop either comes first, and
        # nothing starts, or waits for this start and then signals the child it made
        with self._lock:
            if self._stopping.is_set():
                return
            child.restarts += 1
            child.start(self.ctx)
        if child in self.workers:
            metrics.WORKER_UP.labels(self._device_of(child)).set(1)

    def _no_more_restarts(self) -> None:
        with self._lock:
            self._stopping.set()

    # ---- stopping --------------------------------------------------------------------------------
    def drain(self) -> None:
        """The server drains (front end 0 got the first SIGTERM or Ctrl-C): the other front ends are
        told to drain too. From now on a child that exits has been told to, not died: nothing is
        restarted. (Set first: 11 of 13 idle front ends once exited before front end 0 had ended
        its own drain and were started again, each logged as a death.)"""
        self._no_more_restarts()
        self.signal_frontends()

    def signal_frontends(self, sig: int = signal.SIGTERM) -> None:
        for child in self.frontends:
            if child.proc is not None and child.proc.is_alive():
                os.kill(child.proc.pid, sig)

    def stop(self, grace_s: float) -> None:
        """Front ends first (they drain: in-flight work still needs its worker), then workers."""
        self._no_more_restarts()
        self.signal_frontends()
        deadline = time.monotonic() + grace_s + 5
        for child in self.frontends:
            if child.proc is not None:
                child.proc.join(max(0.0, deadline - time.monotonic()))
                if child.proc.is_alive():
                    child.proc.kill()
        for child in self.workers:  # SIGTERM would be ignored (model_worker.main): their own stop signal
            if child.proc is not None and child.proc.is_alive():
                os.kill(child.proc.pid, STOP_SIGNAL)
        for child in self.workers:
            if child.proc is not None:
                child.proc.join(10)
                if child.proc.is_alive():
                    child.proc.kill()
                    child.proc.join(5)
        shutil.rmtree(self.run_dir, ignore_errors=True)


# ---- `convserve serve` -------------------------------------------------------------------------------
class StartupFailed(Exception):
    """Why the server could not start, as one line: devices the host does not have, or a model
    worker's first load that failed (the CLI prints it and exits 2)."""


@contextmanager
def _environment(values: dict[str, str]) -> Iterator[None]:
    """`values` in the environment while the block runs (children started meanwhile inherit them)."""
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def serve(settings: Settings, sock: socket.socket, environment: dict[str, str] | None = None) -> None:
    """The server on the listening socket `sock`: the model workers, the further front ends, then
    front end 0 in this process until a drain (SIGTERM, Ctrl-C) ends it; then every child is
    stopped and `sock` closed. environment: variables the children inherit (HF_HUB_OFFLINE once
    the CLI has fetched Hub weights). StartupFailed says why the server could not start."""
    import _thread

    from .frontend.memory_budget import auto_budget_bytes
    from .frontend.server import frontend_main, run_frontend

    try:
        sup = Supervisor(settings)
    except ValueError as exc:
        sock.close()
        raise StartupFailed(str(exc)) from None
    with _environment(environment or {}):
        # A worker whose first load fails ends start-up (Supervisor._first_loads) from another
        # thread: it interrupts this one as Ctrl-C would. While uvicorn serves, its handler drains
        # every front end and run_frontend returns; before that, the SIGINT handler set here raises
        # KeyboardInterrupt (also where the shell started us with SIGINT ignored). Either way the
        # workers are stopped and StartupFailed carries the supervisor's one line.
        sup.on_fatal = lambda: _thread.interrupt_main(signal.SIGINT)
        previous = signal.signal(signal.SIGINT, signal.default_int_handler)
        try:
            count = frontends_for(settings, sup.devices)  # before the workers' cores leave this process's set
            sup.start_workers()
            if (warning := frontend_priority_warning(settings, sup.devices)) is not None:
                logging.getLogger("convserve").warning(warning)
            if not settings.memory_budget_bytes:  # auto: the front ends share it
                settings = settings.model_copy(update={"memory_budget_bytes": auto_budget_bytes(count)})
            own = listen_sockets.in_group(sock)  # each front end a socket of its own (the module's rules)
            make = lambda socks, s=settings, pid=os.getpid(): (s, sup.endpoints, socks, pid)  # noqa: E731
            for i in range(1, count):
                sup.add_frontend(f"convserve-frontend-{i}", frontend_main, make([sock]),
                                 listen_sockets.OwnSocketArgs(sock, make) if own else None)
            logging.getLogger("convserve").info("serving on http://%s:%d: %d front end(s), model workers on %s",
                                                settings.host, settings.port, count,
                                                ", ".join(d.label for d in sup.devices))
            run_frontend(settings, sup.endpoints, [sock], on_drain=sup.drain)
        except KeyboardInterrupt:
            if sup.fatal is None:
                raise
        finally:
            signal.signal(signal.SIGINT, previous)
            sup.stop(settings.shutdown_grace_s)
            sock.close()
    if sup.fatal is not None:
        raise StartupFailed(sup.fatal)
