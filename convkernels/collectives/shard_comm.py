"""How the shards of one decode talk to each other: the three collectives a spatially sharded
conv model needs, behind one small interface.

A decode split by rows over N devices runs the same model code on every shard; where a layer
needs what another shard holds, it calls its communicator:
- `exchange_rows(top, bottom)`: send this shard's first rows up and its last rows down, and get
  the neighbours' in return (a conv's halo); the first and last shard get None from outside;
- `allreduce_sum(a)`: the element-wise sum over shards (exact GroupNorm statistics);
- `allgather(a, lengths)`: every shard's array, in rank order (attention over the whole image);
  `lengths`, every shard's size along axis 1 where the caller knows them, saves asking for them
  (a recorded CUDA graph cannot wait on the host for an answer).

`ThreadShards` is the emulation: N threads of one process, one per shard, meeting at a barrier.
It has the semantics NCCL collectives have (every rank calls, in the same order, and all return
together), so code tested against it on the CPU runs unchanged on a communicator over NCCL.
"""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Protocol, Sequence


class ShardComm(Protocol):
    rank: int
    size: int

    def exchange_rows(self, top: Any, bottom: Any) -> tuple[Any | None, Any | None]: ...

    def allreduce_sum(self, a: Any) -> Any: ...

    def allgather(self, a: Any, lengths: Sequence[int] | None = None) -> list[Any]: ...


class _Meeting:
    """The state the threads of one emulated group share: one slot per rank, and a barrier that
    every collective passes twice (after writing its slot, after reading the others')."""

    def __init__(self, size: int):
        self.size = size
        self.slots: list[Any] = [None] * size
        self.barrier = threading.Barrier(size)

    def gather(self, rank: int, value: Any) -> list[Any]:
        self.slots[rank] = value
        self.barrier.wait()
        seen = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return seen


class ThreadShards:
    """One rank of an emulated group (see the module docstring)."""

    def __init__(self, meeting: _Meeting, rank: int):
        self._meeting, self.rank, self.size = meeting, rank, meeting.size

    def exchange_rows(self, top, bottom):
        seen = self._meeting.gather(self.rank, (top, bottom))
        from_above = seen[self.rank - 1][1] if self.rank > 0 else None
        from_below = seen[self.rank + 1][0] if self.rank < self.size - 1 else None
        return from_above, from_below

    def allreduce_sum(self, a):
        seen = self._meeting.gather(self.rank, a)
        total = seen[0]
        for other in seen[1:]:
            total = total + other
        return total

    def allgather(self, a, lengths=None):
        seen = self._meeting.gather(self.rank, a)
        # the emulation checks what a real communicator must trust: a caller's wrong lengths
        # would cut or pad the others' arrays there
        if lengths is not None and [int(x.shape[1]) for x in seen] != [int(n) for n in lengths]:
            raise ValueError(f"allgather told lengths {list(lengths)}, the shards hold "
                             f"{[int(x.shape[1]) for x in seen]}")
        return seen


def thread_group(size: int) -> list[ThreadShards]:
    """The communicators of one emulated group, rank order (for work done in several steps,
    run_together each step; run_sharded does a single one)."""
    meeting = _Meeting(size)
    return [ThreadShards(meeting, r) for r in range(size)]


def run_sharded(size: int, fn: Callable[[ThreadShards, int], Any]) -> list[Any]:
    """fn(comm, rank) on `size` emulated shards at once; their results in rank order. A shard
    that raises breaks the barrier, so the others raise too instead of waiting forever; its
    error is the one raised here."""
    comms = thread_group(size)
    return run_together(comms, [lambda c=c: fn(c, c.rank) for c in comms])


def run_together(comms: Sequence[ThreadShards], calls: Sequence[Callable[[], Any]]) -> list[Any]:
    """calls[r]() on its own thread for every rank of one emulated group (comms), at once: their
    results in rank order, or the first shard's error (see run_sharded)."""
    meeting = comms[0]._meeting

    def one(call):
        try:
            return call()
        except BaseException:
            meeting.barrier.abort()
            raise

    with ThreadPoolExecutor(len(calls)) as pool:
        futures = [pool.submit(one, call) for call in calls]
        errors = [f.exception() for f in futures]
    # the shard that failed first, not the others' broken barriers
    causes = [e for e in errors if e is not None and not isinstance(e, threading.BrokenBarrierError)]
    if causes or any(errors):
        raise (causes or [e for e in errors if e is not None])[0]
    return [f.result() for f in futures]


def split_rows(height: int, size: int, align: int = 1) -> list[tuple[int, int]]:
    """[start, stop) rows of each shard: as even as `align` allows (every start a multiple of it,
    so a stride-`align` layer's output rows fall on whole shards), earlier shards taking the
    remainder. Every shard gets at least `align` rows."""
    if height < size * align:
        raise ValueError(f"{height} rows cannot make {size} shards of at least {align} rows")
    units, extra = divmod(height // align, size)
    bounds, start = [], 0
    for r in range(size):
        stop = start + (units + (1 if r < extra else 0)) * align
        bounds.append((start, stop))
        start = stop
    bounds[-1] = (bounds[-1][0], height)  # the rows past the last whole unit
    return bounds


def split(a, bounds: Sequence[tuple[int, int]], axis: int = 1) -> list:
    index = [slice(None)] * a.ndim
    out = []
    for lo, hi in bounds:
        index[axis] = slice(lo, hi)
        out.append(a[tuple(index)])
    return out
