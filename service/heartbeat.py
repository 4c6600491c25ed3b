"""A model worker's heartbeat: how its front ends and the supervisor tell a hung worker (stopped,
deadlocked, stuck in one device call) from a busy one.

Each worker has a beat record: a 16-byte file beside its socket in the server's private run
directory (service/supervisor.py makes it), mapped shared by:

    the worker (one writer)  its heartbeat thread (`Beat`), every `interval()` seconds: the time
                             of the beat, and when the model call running on its device started
                             (0 while none runs)
    each front end (reader)  service/engine.py: a worker whose last beat is older than
                             CONVSERVE_WORKER_HEARTBEAT_S is *unresponsive*: not ready (/readyz
                             503 for a model no other worker serves), new requests 503
                             `worker-unresponsive` with Retry-After (or to another device's
                             worker), its requests in flight answered so at once
    the supervisor (reader)  a worker whose last beat, or whose running model call, is older than
                             `hang_limit()` is *hung*: the supervisor, and only it, kills it
                             (SIGKILL) and starts another, as for any worker that dies

A worker that beats again (SIGCONT, a lock let go) before the hang limit is ready again.

Why shared memory and not a message on the worker's socket: a send blocks once a front end that
stopped reading has a full socket buffer, and a heartbeat thread blocked there would silence the
worker for every front end; a store into a mapped page never blocks, and one record serves every
reader. Times are time.monotonic(), the system-wide monotonic clock (CLOCK_MONOTONIC on Linux,
mach_absolute_time on macOS), so they compare across processes. The worker's threads share the
interpreter lock: a C call that holds it longer than the heartbeat limit silences the beat just as
a stopped process does, and is treated the same."""
from __future__ import annotations

import logging
import mmap
import os
import struct
import threading
import time
from typing import Callable

log = logging.getLogger("convserve.heartbeat")

_RECORD = struct.Struct("=dd")  # last beat, start of the running model call (0: none)
#: a worker that has not beaten since it started is given at least this long (an interpreter
#: starting and importing NumPy and the models on a loaded machine) before it counts as hung
START_S = 60.0


def beat_path(address: str) -> str:
    """The beat record of the worker listening on `address`."""
    return address + ".beat"


def create(path: str) -> None:
    """A zeroed record (the supervisor's, before it starts the worker: readers may map it at once)."""
    with open(path, "wb") as f:
        f.write(bytes(_RECORD.size))


def interval(heartbeat_s: float) -> float:
    """How often the worker beats: several beats within the limit, so one late beat is no silence."""
    return min(0.5, heartbeat_s / 5)


def hang_limit(settings) -> float:
    """CONVSERVE_WORKER_HANG_S, or (0, auto) max(180 s, 3x the request timeout): past the request
    timeout (a batch whose requesters all left stops at its next tile or frame group, so a model
    call beyond it serves nobody), past a shard group's deadline (max(120 s, 2x the request
    timeout), service/shard_leader.py), with room for one long tile on a CPU."""
    return settings.worker_hang_s or max(180.0, 3 * settings.request_timeout_s)


def _map(path: str, write: bool) -> mmap.mmap:
    fd = os.open(path, (os.O_RDWR | os.O_CREAT) if write else os.O_RDONLY, 0o600)
    try:
        if write and os.fstat(fd).st_size < _RECORD.size:
            os.ftruncate(fd, _RECORD.size)
        return mmap.mmap(fd, _RECORD.size, prot=mmap.PROT_READ | (mmap.PROT_WRITE if write else 0))
    finally:
        os.close(fd)  # the mapping keeps what it needs


class Beat:
    """The worker's heartbeat thread: `busy()` is when the running model call started (0: none)."""

    def __init__(self, path: str, heartbeat_s: float, busy: Callable[[], float]):
        self._map = _map(path, write=True)
        self._every, self._busy = interval(heartbeat_s), busy
        self.beat()  # at once: a worker that restarts is not taken for its silent predecessor
        threading.Thread(target=self._run, name="convserve-heartbeat", daemon=True).start()

    def beat(self) -> None:
        _RECORD.pack_into(self._map, 0, time.monotonic(), self._busy())

    def _run(self) -> None:
        while True:
            time.sleep(self._every)
            self.beat()


class BeatReader:
    """A front end's or the supervisor's view of one worker's record (mapped once it exists)."""

    def __init__(self, path: str):
        self.path = path
        self._map: mmap.mmap | None = None

    def read(self) -> tuple[float, float] | None:
        """(last beat, start of the running model call or 0), or None without a record (no
        supervisor made one: nothing to judge by)."""
        if self._map is None:
            try:
                self._map = _map(self.path, write=False)
            except (FileNotFoundError, ValueError):  # not there, or not yet its full size
                return None
        return _RECORD.unpack_from(self._map, 0)

    def silent_s(self, now: float, since: float = 0.0) -> float:
        """Seconds without a beat (counted from `since` at the earliest: when the worker started)."""
        record = self.read()
        return 0.0 if record is None else now - max(record[0], since)

    def hung(self, now: float, limit: float, started: float) -> str | None:
        """Why the worker that started at `started` counts as hung, or None."""
        record = self.read()
        if record is None:
            return None
        beat, busy = record
        if beat < started:  # not beaten yet since it started
            silent = now - started
            return f"no heartbeat in {silent:.0f}s since it started" if silent > max(limit, START_S) else None
        if now - beat > limit:
            return f"no heartbeat for {now - beat:.0f}s (stopped, deadlocked, or a call holding the interpreter lock)"
        # as of its last beat (a silent worker is judged by its silence above, not by a call that
        # its last beat, up to one interval old, still showed running)
        if busy and beat - busy > limit:
            return f"one model call running for {beat - busy:.0f}s"
        return None
