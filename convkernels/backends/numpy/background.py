"""Background measurement of the NumPy backend's conv paths, off the request path.

A new conv shape runs on the cost model's choice (cost_model.py); its work key is queued here,
and one thread per backend times the valid paths (autotune.time_paths: best of three interleaved
rounds) while the process is idle. The winner is handed back (the backend persists it in its path
store and drops the memoised estimate), so the next call of that shape runs the measured choice.

Bounds, so that it never competes with the requests it serves:
- one thread per backend, started on demand and ended when the queue is empty; at most
  MAX_PENDING work keys wait (more are dropped: those shapes keep the model's choice);
- a timed run starts only after the backend has run no conv or linear for IDLE_S and while the
  machine is not oversubscribed (1-minute load average below its CPU count), and a run during
  which a conv or linear started is thrown away and repeated (at most MAX_RETRIES times per key,
  then the key is given up); the thread runs at the lowest CPU priority where the OS allows it.
  The load gate is there because timings taken while other jobs run are noise (one Winograd conv:
  15 ms idle, 370-1500 ms so), and a noisy winner would be persisted: on a box that other jobs
  keep busy, shapes keep the cost model's choice;
- a key whose operands and output would take more than MAX_OPERAND_BYTES is not measured;
- a request arriving mid-run shares the CPU with at most that one candidate run.
"""
from __future__ import annotations

import logging
import os
import threading
import time
from collections import OrderedDict
from typing import Callable

from ...paths import ConvPath
from ...spec import ConvKey, prod
from .autotune import run_timed, time_paths

log = logging.getLogger("convkernels.numpy.paths")

IDLE_S = 0.5
MAX_PENDING = 64
MAX_RETRIES = 30
MAX_OPERAND_BYTES = 512 << 20


class Activity:
    """The backend's heavy ops in flight and when the last one ended (`with activity:` around each)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.busy = 0
        self.started = 0
        self.last = time.monotonic()

    def __enter__(self):
        with self._lock:
            self.busy += 1
            self.started += 1

    def __exit__(self, *exc):
        with self._lock:
            self.busy -= 1
            self.last = time.monotonic()

    def idle_for(self) -> float:
        with self._lock:
            return 0.0 if self.busy else time.monotonic() - self.last


def _load() -> float:
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):  # no load average on this OS: the idle check alone
        return 0.0


class Busy(Exception):
    """The process never stayed idle long enough to time a run."""


class BackgroundTuner:
    def __init__(self, activity: Activity, done: Callable[[ConvKey, list[ConvPath], ConvPath, dict], None],
                 idle_s: float = IDLE_S):
        self.activity = activity
        self.done = done  # (key, valid, winner, {path name: best seconds}) once a key is measured
        self.idle_s = idle_s
        self.max_load = float(os.cpu_count() or 1)  # 1-minute load average a timed run waits below
        self._pending: OrderedDict[tuple, tuple[ConvKey, list[ConvPath]]] = OrderedDict()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._working: tuple | None = None  # the work key being measured
        self._closed = False
        self.measured = 0  # keys measured, for tests and /v1/kernels

    def submit(self, work: tuple, key: ConvKey, valid: list[ConvPath]) -> bool:
        """Queue a key for measurement; False when it is not (too large, queue full, closed)."""
        item = 8 if key.dtype == "float64" else 4
        if (prod(key.x_shape) + prod(key.out_shape)) * item > MAX_OPERAND_BYTES:
            return False
        with self._cond:
            if self._closed or work in self._pending or work == self._working:
                return False
            if len(self._pending) >= MAX_PENDING:
                log.info("path tuner: queue full, %s keeps the cost model's path", key.describe()["input_shape"])
                return False
            self._pending[work] = (key, valid)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="convkernels-path-tuner", daemon=True)
                self._thread.start()
            return True

    def wait(self, timeout: float) -> bool:
        """Block until nothing is queued or being measured (benchmarks, tests); False on timeout."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._pending or self._working:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(left)
            return True

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._pending.clear()
            self._cond.notify_all()

    def _loop(self) -> None:
        try:  # this thread only (Linux: a thread id is a process id to setpriority)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except (AttributeError, OSError):
            pass
        while True:
            with self._cond:
                if not self._pending or self._closed:
                    self._thread, self._working = None, None
                    self._cond.notify_all()
                    return
                self._working, (key, valid) = self._pending.popitem(last=False)
            try:
                timings: dict = {}
                winner = time_paths(key, valid, self._run_one, timings)
                self.measured += 1
                self.done(key, valid, winner, timings)
            except Busy:
                log.info("path tuner: never idle long enough, %s keeps the cost model's path",
                         key.describe()["input_shape"])
            except Exception:  # a failing candidate must not end the thread; the estimate stays
                log.exception("path tuner: measuring %s failed", key.describe())
            with self._cond:
                self._working = None
                self._cond.notify_all()

    def _run_one(self, p: ConvPath, key: ConvKey, x, w) -> float:
        for _ in range(MAX_RETRIES):
            self._wait_idle()
            before = self.activity.started
            t = run_timed(p, key, x, w)
            if self.activity.started == before and self.activity.busy == 0:
                return t
        raise Busy()

    def _wait_idle(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    raise Busy()
            idle = self.activity.idle_for()
            if idle >= self.idle_s and _load() < self.max_load:
                return
            time.sleep(max(0.01, min(0.1, self.idle_s - idle)))
