"""A model worker's heartbeat: how its front ends and the supervisor tell a hung worker (stopped,
deadlocked, stuck in one device call) from a busy one.

Each worker has a beat record: a 24-byte file beside its socket in the server's private run
directory (service/supervisor.py makes it), mapped shared by:

    the worker (writers)     its heartbeat thread (`Beat`), every `interval()` seconds: the time
                             of the beat; its device thread (the batcher), when a model call
                             starts and ends (0 while none runs); its pid, once
    each front end (reader)  service/frontend/engine.py judges a *ready* worker: one whose last beat is
                             older than CONVSERVE_WORKER_HEARTBEAT_S while it runs no model call,
                             or whose process is stopped (SIGSTOP, a debugger; read from /proc), is
                             *unresponsive*: not ready (/readyz 503 for a model no other worker
                             serves), new requests 503 `worker-unresponsive` with Retry-After (or to
                             another device's worker), its requests in flight answered so at once
    the supervisor (reader)  a worker whose last beat, or whose running model call, is older than
                             `hang_limit()` is *hung*: the supervisor, and only it, kills it
                             (SIGKILL) and starts another, as for any worker that dies

A worker that beats again (SIGCONT, a lock let go) before the hang limit is ready again.

Why a late beat during a model call is not enough for the front ends: the worker's threads share
the interpreter lock, and a C call that holds it (NVRTC compiling a kernel, the cuDNN frontend
building a plan for a new shape: over 3 s on an H200) silences the heartbeat thread exactly as a
stopped process does. Such a worker is busy, not hung, and its request must not get a 503. The
process state tells the two apart where /proc exists; elsewhere a call is judged by the hang
limit alone. The device thread writes the call's start itself, before it takes the lock for the
call, so the record shows the call even when the heartbeat thread never runs during it.

Why shared memory and not a message on the worker's socket: a send blocks once a front end that
stopped reading has a full socket buffer, and a heartbeat thread blocked there would silence the
worker for every front end; a store into a mapped page never blocks, and one record serves every
reader. Times are time.monotonic(), the system-wide monotonic clock (CLOCK_MONOTONIC on Linux,
mach_absolute_time on macOS), so they compare across processes."""
from __future__ import annotations

import logging
import mmap
import os
import struct
import time

from .. import threads

log = logging.getLogger("convserve.heartbeat")

_RECORD = struct.Struct("=ddq")  # last beat, start of the running model call (0: none), the worker's pid
_TIME = struct.Struct("=d")
_CALL_AT = 8  # the offset of the running call's start
_PID_AT = 16
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
    timeout), service/worker/shard_leader.py), with room for one long tile on a CPU."""
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
    """The worker's side: a heartbeat thread, and `call()` for the device thread."""

    def __init__(self, path: str, heartbeat_s: float):
        self._map = _map(path, write=True)
        self._every = interval(heartbeat_s)
        struct.pack_into("=q", self._map, _PID_AT, os.getpid())
        self.call(0.0)  # a restarted worker starts idle, whatever its predecessor was doing
        self.beat()  # at once: a worker that restarts is not taken for its silent predecessor
        threads.start(self._run, "convserve-heartbeat")

    def beat(self) -> None:
        _TIME.pack_into(self._map, 0, time.monotonic())

    def call(self, started: float) -> None:
        """A model call started at `started` (time.monotonic()), or none runs (0)."""
        _TIME.pack_into(self._map, _CALL_AT, started)

    def _run(self) -> None:
        while True:
            time.sleep(self._every)
            self.beat()


def stopped(pid: int) -> bool:
    """Whether the process is stopped (SIGSTOP, a tracer): its state in /proc/PID/stat. False where
    there is no /proc, or no such process (its death is seen on its socket)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2:].split()  # the name, in parentheses, may hold spaces
    return bool(fields) and fields[0] in (b"T", b"t")


class BeatReader:
    """A front end's or the supervisor's view of one worker's record (mapped once it exists)."""

    def __init__(self, path: str):
        self.path = path
        self._map: mmap.mmap | None = None

    def read(self) -> tuple[float, float, int] | None:
        """(last beat, start of the running model call or 0, the worker's pid), or None without a
        record (no supervisor made one: nothing to judge by)."""
        if self._map is None:
            try:
                self._map = _map(self.path, write=False)
            except (FileNotFoundError, ValueError):  # not there, or not yet its full size
                return None
        return _RECORD.unpack_from(self._map, 0)

    def unresponsive(self, now: float, limit: float) -> float:
        """A front end's judgement of a ready worker: the seconds it has been silent where that
        counts (past `limit` with no model call running, or at all while its process is stopped),
        else 0."""
        record = self.read()
        if record is None:
            return 0.0
        beat, busy, pid = record
        silent = now - beat
        if silent <= limit:
            return 0.0
        return silent if not busy or stopped(pid) else 0.0

    def hung(self, now: float, limit: float, started: float) -> str | None:
        """Why the worker that started at `started` counts as hung, or None."""
        record = self.read()
        if record is None:
            return None
        beat, busy, _ = record
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
