"""A request's work in a model worker (service/worker/batcher.py queues and runs it) and its
outcome.

The rules of an outcome (`ItemResult`):
- it is set once: by the device thread when the item's model call ends (its rows, or the
  batch's error), or by a withdrawal (Cancelled, Closed); a second setting is ignored;
- the worker reads it once the whole batch is resolved (the batcher's on_done): on the delivery
  thread it was handed to, or on the device thread itself (small outputs), so in the service
  nobody waits on it;
- a caller that does wait (tests, an in-process user of the batcher) gets an event made on
  demand.

Why not `concurrent.futures.Future`: one was made, set and read per request, and its Condition
and notify cost ~5 us of the worker's interpreter lock each time (2-core Xeon, 2026-11-29), a
tenth of the worker's cost per one-image request.
"""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Hashable

import numpy as np

#: a model call: stacked inputs (rows on axis 0) -> an array or a dict of arrays/None, rows on axis 0
ModelCall = Callable[[np.ndarray], Any]

# One lock for every outcome: it orders a waiter making its event against the setter reading it,
# and is held for a few bytecodes at a time.
_LOCK = threading.Lock()


class ItemResult:
    """A request's outcome: its rows or its error (the rules above)."""

    __slots__ = ("_done", "_value", "_error", "_event")

    def __init__(self) -> None:
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None
        self._event: threading.Event | None = None

    def done(self) -> bool:
        return self._done

    def set(self, value: Any = None, error: BaseException | None = None) -> bool:
        """Set it (False: it was set already, and keeps its first outcome)."""
        with _LOCK:
            if self._done:
                return False
            self._value, self._error, self._done = value, error, True
            event = self._event
        if event is not None:
            event.set()
        return True

    def _wait(self, timeout: float | None) -> None:
        if self._done:
            return
        with _LOCK:
            if not self._done and self._event is None:
                self._event = threading.Event()
            event = self._event
        if not self._done and not event.wait(timeout):
            raise TimeoutError(f"no outcome in {timeout} s")

    def exception(self, timeout: float | None = None) -> BaseException | None:
        """The error (None for rows), waiting up to `timeout` for the outcome."""
        self._wait(timeout)
        return self._error

    def result(self, timeout: float | None = None) -> Any:
        """The rows, or the error raised, waiting up to `timeout` for the outcome."""
        self._wait(timeout)
        if self._error is not None:
            raise self._error
        return self._value


@dataclass(eq=False)
class WorkItem:
    model: str
    #: items batch together only when their keys are equal (model, op, row shape, options)
    key: Hashable
    inputs: np.ndarray
    call: ModelCall
    outcome: ItemResult = field(default_factory=ItemResult)
    enqueued: float = field(default_factory=time.perf_counter)
    cancelled: bool = False
    started: bool = False
    #: runs alone and at once: a step of a stateful generator (streaming) has nothing to batch with
    solo: bool = False
    #: the submitter's own reference (the worker: which front end and request it answers)
    tag: Any = None
    #: inputs made on another thread's device stream: the event the call's stream waits for first
    ready: Any = None
    #: the inputs' rows (axis 0), read once: the queue's counts, the batching and the split read it
    #: five or more times an item, and as a property it was 4 % of the device thread's interpreter
    #: lock under one-image requests (one H200, 2026-11-30). Fixed for the item's life: the JPEG
    #: stage swaps a file's one row for its one decoded image row.
    rows: int = field(init=False)
    #: where `inputs` lie in this process's memory (a host array's first byte), or 0: unknown. Known
    #: where the item is made from an arena block (the block's offset from the mapping's start), so
    #: the device thread's gather needs no `ndarray.ctypes` a row (2-3 us each); whoever swaps
    #: `inputs` (the JPEG stage) sets it back to 0.
    host_address: int = 0

    def __post_init__(self) -> None:
        self.rows = int(self.inputs.shape[0])
