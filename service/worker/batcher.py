"""Dynamic batcher, inside a model worker process (service/worker/model_worker.py): one thread runs the
device's model calls; requests for the same model and compatible shapes are stacked along the
batch axis, up to `max_batch` rows, waiting at most `max_queue_delay_ms` after the oldest one
arrived. The front ends bound what waits (admission, before the body: service/frontend/pipeline.py), so
this queue holds whatever they admitted; queued work whose requester gave up (client gone, timeout) is
dropped before it runs. Results go to each item's outcome (service/worker/work_item.py), which the
worker reads once the batch is handed over and any other thread may wait on."""
from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Hashable

import numpy as np

from models.nn import interrupt

from .. import metrics, threads
from ..ipc.worker_errors import Cancelled, Closed
from ..model_stats import BatchTimes, ModelStats, ns
from .work_item import ModelCall, WorkItem

log = logging.getLogger("convserve.batcher")

#: how often at most the queue-depth gauge is written (Batcher._publish_depth)
DEPTH_PUBLISH_S = 0.02


def _rows_of(out: Any, start: int, stop: int) -> Any:
    if isinstance(out, dict):
        return {k: (None if v is None else v[start:stop]) for k, v in out.items()}
    return out[start:stop]


class Batcher:
    def __init__(self, *, max_batch: int, max_queue_delay_ms: float,
                 after_batch: Callable[[], None] | None = None, name: str = "device0",
                 stats: ModelStats | None = None, before_call: Callable[[np.ndarray], None] | None = None,
                 on_start: Callable[[list[WorkItem]], None] | None = None,
                 on_busy: Callable[[float], None] | None = None,
                 on_done: Callable[[list[WorkItem]], None] | None = None,
                 host_batch: Callable[[tuple, Any], np.ndarray | None] | None = None,
                 gather: Callable[[list[WorkItem]], Any] | None = None):
        """before_call(inputs) runs before every model call, and what it raises is the call's error
        (the seam of the injected model-call faults, service/worker/fault_injection.py). on_start(batch):
        told which items a model call is about to run (the worker tells their front ends).
        on_busy(started): on the device thread, when a model call starts (time.monotonic()) and
        ends (0.0): the worker's heartbeat record carries it (service/ipc/heartbeat.py).
        on_done(batch): on the device thread, once every item of a model call is resolved (a
        result or the call's error): one hand-off per batch where a future's callback is one per item.
        host_batch(shape, dtype): where to stack a batch's inputs (the backend's host_batch), or None.
        gather(batch): the batch's inputs joined on the device straight from where they lie, or None
        (the worker's, for calls marked `device_input`: see _inputs)."""
        self.host_batch, self.on_done, self.on_start, self.stats = host_batch, on_done, on_start, stats
        self.gather = gather
        self.on_busy = on_busy or (lambda started: None)
        self.max_batch, self.delay_s, self.name = max_batch, max_queue_delay_ms / 1000.0, name
        self.after_batch, self.before_call = after_batch, before_call
        self._pending: deque[WorkItem] = deque()
        #: queued rows per batching key, queued items per model (kept by _enqueue/_dequeued)
        self._rows: dict[Hashable, int] = {}
        self._depth: dict[str, int] = {}
        self._cond = threading.Condition()
        self._stopped = False
        self.row_seconds = 0.0
        #: the device thread: every model call runs on it
        self._depth_changed = threading.Event()
        self.thread = threads.start(self._loop, f"convserve-worker-{name}")
        threads.start(self._publish_depth, f"convserve-depth-{name}")

    # ---- producer side ------------------------------------------------------------
    def submit(self, model: str, key: Hashable, inputs: np.ndarray, call: ModelCall, *,
               solo: bool = False, tag: Any = None) -> WorkItem:
        """Refused only by a stopped worker (Closed). solo: see WorkItem.solo. (Admission, with its
        reservations before the body, is the front ends' job: service/frontend/pipeline.py.)"""
        item = WorkItem(model, key, inputs, call, solo=solo, tag=tag)
        self.submit_many([item])
        return item

    def submit_many(self, items: list[WorkItem]) -> None:
        """Queue `items` together: one take of the queue's lock, and the device thread woken only
        when it has something new to do (it waited on an empty queue, or a batch is now full: it
        would otherwise wake for every item to find its batching window still open). Closed when
        stopped. An item withdrawn before it came (a JPEG file cancelled on its decode thread,
        service/worker/jpeg_stage.py) is left out: answered already, and a cancelled item at the
        queue's head would stall it."""
        with self._cond:
            if self._stopped:
                raise Closed()
            wake = not self._pending
            for item in items:
                if item.cancelled:  # cancel() set it under this lock: it never runs
                    continue
                self._enqueue(item)
                wake = wake or self._rows[item.key] >= self.max_batch
            self._depth_moved()
            if wake:
                self._cond.notify()

    def cancel(self, item: WorkItem) -> bool:
        """Withdraw `item`: True when it had not started (it never runs, and its outcome gets
        Cancelled), False when its model call already runs (its result still comes). Decided
        under the queue's lock, so the answer cannot race the worker picking the item up."""
        with self._cond:
            item.cancelled = True
            if item.started:
                return False
            if item in self._pending:
                self._pending.remove(item)
                self._dequeued(item)
                self._depth_moved()
        item.outcome.set(None, Cancelled())
        return True

    def stop(self, timeout: float = 5.0) -> None:
        with self._cond:
            self._stopped = True
            for item in self._pending:
                item.outcome.set(None, Closed())
                self._dequeued(item)
            self._pending.clear()
            self._cond.notify_all()
        self.thread.join(timeout)

    # ---- worker thread --------------------------------------------------------------------------
    def _bucket(self, rows: int) -> int:
        """Rows to run now: the largest power of two <= rows (capped by max_batch); the rest go
        in the next batch at once. Backends choose (and may autotune) a kernel path per input
        shape, so few distinct batch sizes mean few first-call costs (Triton's preferred sizes)."""
        if rows >= self.max_batch:
            return self.max_batch
        return 1 << (max(rows, 1).bit_length() - 1)

    # The queue's counts (rows per batching key, items per model) are kept as items come and go:
    # the worker wakes on every submit, and a scan of hundreds of queued items per wake-up was
    # the device thread's largest cost with one image a request.
    def _enqueue(self, item: WorkItem) -> None:
        self._pending.append(item)
        self._rows[item.key] = self._rows.get(item.key, 0) + item.rows
        self._depth[item.model] = self._depth.get(item.model, 0) + 1

    def _dequeued(self, item: WorkItem) -> None:
        """Count out an item that has left `_pending`."""
        left = self._rows[item.key] - item.rows
        if left:
            self._rows[item.key] = left
        else:
            del self._rows[item.key]
        self._depth[item.model] -= 1

    def _depth_moved(self) -> None:
        """Wake the depth publisher (under the queue's lock). An Event's set takes its lock and
        notifies every time; it is already set for most submits between two publications."""
        if not self._depth_changed.is_set():
            self._depth_changed.set()

    def _publish_depth(self) -> None:
        """The queue-depth gauge, at most every DEPTH_PUBLISH_S: a multiprocess gauge write costs
        ~10 us of the worker's interpreter lock, which a write per queued item would spend."""
        while not self._stopped:
            if self._depth_changed.wait(0.5):
                self._depth_changed.clear()
                with self._cond:
                    depths = dict(self._depth)
                for model, depth in depths.items():
                    metrics.QUEUE_DEPTH.labels(model).set(depth)
                time.sleep(DEPTH_PUBLISH_S)

    def _next_batch(self, wait: bool = True) -> list[WorkItem] | None:
        """The next batch to run; None once stopped. wait=False (a batch is still on its way):
        [] at once where none is ready yet (nothing queued, or its batching window still open)."""
        with self._cond:
            while True:
                if self._stopped:
                    return None
                if self._pending:
                    break
                if not wait:
                    return []
                self._cond.wait(0.5)
            first = self._pending[0]
            deadline = first.enqueued + self.delay_s
            while True:
                if first.cancelled or self._stopped:
                    # the oldest went away: start over with the new oldest
                    return []
                left = deadline - time.perf_counter()
                if self._rows[first.key] >= self.max_batch or left <= 0 or first.solo:
                    break
                if not wait:
                    return []
                self._cond.wait(left)
            batch, rows = [], 0
            target = self._bucket(self._rows[first.key])
            for it in [first] if first.solo else self._pending:
                if it.key == first.key and (not batch or rows + it.rows <= target):
                    batch.append(it)
                    rows += it.rows
                    if rows >= target:
                        break
            for it in batch:
                it.started = True
                self._dequeued(it)
            self._depth_moved()
            if len(batch) == 1:
                self._pending.popleft()  # the oldest: the common case of a solo or lone item
            else:
                self._pending = deque(it for it in self._pending if not it.started)
            return batch

    def _loop(self) -> None:
        """Batches one after another; a call whose result is still on its way (Later) stays
        `ahead` while the next batch is stacked and started, and is finished (its result waited
        for, split, delivered) right after: the host's work for batch k+1 overlaps the device's
        for batch k, and results still leave in batch order. Nothing ready to start: the batch
        ahead is finished at once, so a lone request waits for nothing."""
        ahead: _Started | None = None
        while True:
            batch = self._next_batch(wait=ahead is None)
            if batch is None:
                if ahead is not None:
                    self._finish(ahead)
                return
            if not batch:
                if ahead is not None:
                    self._finish(ahead)
                    ahead = None
                    self.on_busy(0.0)
                continue
            self.on_busy(time.monotonic())
            started = self._start(batch)
            batch = None  # its inputs (views of front ends' arenas) go with the call, not with the loop
            if ahead is not None:
                self._finish(ahead)
                ahead = None
            if started is not None and isinstance(started.out, Later):
                ahead = started
            elif started is not None:
                self._finish(started)
            if ahead is None:
                self.on_busy(0.0)

    def _done(self, batch: list[WorkItem]) -> None:
        """Every item of the batch is resolved: the worker's hand-off (on_done)."""
        if self.on_done is not None:
            try:
                self.on_done(batch)
            except Exception:
                log.exception("on_done hook failed")

    def _after_call(self) -> None:
        if self.after_batch is not None:
            try:
                self.after_batch()
            except Exception:  # timings are best effort; never fail requests over them
                log.exception("after_batch hook failed")

    def _stacked(self, batch: list[WorkItem]) -> np.ndarray:
        """The inputs stacked where the backend uploads them cheapest (host_batch: CUDA's pinned
        buffers), else by NumPy (a lone request's input as it is)."""
        first, rows = batch[0].inputs, sum(it.rows for it in batch)
        where = self.host_batch((rows, *first.shape[1:]), first.dtype) if self.host_batch else None
        if where is None:
            return first if len(batch) == 1 else np.concatenate([it.inputs for it in batch], axis=0)
        return np.concatenate([it.inputs for it in batch], axis=0, out=where)

    def _inputs(self, batch: list[WorkItem]) -> Any:
        """The call's stacked inputs: gathered on the device where the call takes a device array
        (`device_input`) and the gather can (no host copy), else stacked on the host. Never
        gathered while faults are injected: they inspect the inputs' values on the host. Inputs on
        the device already (JPEG files decoded there) are always joined by the gather."""
        if self.gather is not None and not isinstance(batch[0].inputs, np.ndarray):
            return self.gather(batch)
        if self.gather is not None and self.before_call is None and getattr(batch[0].call, "device_input", False):
            gathered = self.gather(batch)
            if gathered is not None:
                return gathered
        return self._stacked(batch)

    def _start(self, batch: list[WorkItem]) -> "_Started | None":
        """Stack the batch and make its model call. None: the call ended it already (its error,
        or stopped with its requesters gone), every item resolved and handed off."""
        model = batch[0].model
        if self.on_start is not None:
            try:
                self.on_start(batch)
            except Exception:
                log.exception("on_start hook failed")
        now = time.perf_counter()
        waits = [now - it.enqueued for it in batch]
        metrics.observe_many(metrics.QUEUE_WAIT_SECONDS.labels(model), waits)
        try:
            inputs = self._inputs(batch)
        except BaseException as exc:  # noqa: BLE001 - a gather's failure (a decode, device memory) is the batch's
            self._failed(batch, sum(it.rows for it in batch), exc)
            return None
        stacked = time.perf_counter()
        rows = int(inputs.shape[0])
        metrics.BATCH_SIZE.labels(model).observe(rows)
        metrics.DEVICE_BATCHES.labels(model, self.name).inc()
        metrics.DEVICE_ROWS.labels(model, self.name).inc(rows)
        try:
            if self.before_call is not None:
                self.before_call(inputs)
            # its requesters all gone (timed out, disconnected): the call stops at its next tile
            # or frame group instead of holding the device for work nobody reads
            with interrupt.watching(lambda: all(it.cancelled for it in batch)):
                out = batch[0].call(inputs)
        except interrupt.Abandoned:
            log.info("model %s: a batch of %d stopped early, its requesters gone", model, rows)
            metrics.ABANDONED.labels(model).inc()
            self._after_call()
            for it in batch:
                it.outcome.set(None, Cancelled())
            self._done(batch)
            return None
        except BaseException as exc:  # noqa: BLE001 - handed to every requester of the batch
            self._failed(batch, rows, exc)
            return None
        return _Started(batch, out, now, stacked, waits, rows)

    def _failed(self, batch: list[WorkItem], rows: int, exc: BaseException) -> None:
        # the id ties a client's 500 to this log line (and its traceback)
        error_id = uuid.uuid4().hex[:16]
        log.error("model %s failed on a batch of %d (error id %s)", batch[0].model, rows, error_id, exc_info=exc)
        try:
            exc.error_id = error_id
        except AttributeError:
            pass
        self._after_call()
        for it in batch:
            it.outcome.set(None, exc)
        self._done(batch)

    def _finish(self, started: "_Started") -> None:
        """A started call's result (waited for where it is Later) split over its items."""
        batch, out = started.batch, started.out
        if isinstance(out, Later):
            try:
                out = out.result()
            except BaseException as exc:  # noqa: BLE001 - the device's error, handed to every requester
                self._failed(batch, started.rows, exc)
                return
        called = time.perf_counter()
        self._after_call()
        model = batch[0].model
        # per-row cost, smoothed: Retry-After hints are the queued rows times this
        per_row = (time.perf_counter() - started.now) / max(started.rows, 1)
        self.row_seconds = per_row if self.row_seconds == 0.0 else 0.8 * self.row_seconds + 0.2 * per_row
        split = time.perf_counter()
        parts, start = [], 0
        for it in batch:
            parts.append(_rows_of(out, start, start + it.rows))
            start += it.rows
        if self.stats is not None:  # before the results go out, so a client that got one sees it counted
            self.stats.batch_done(model, BatchTimes(started.rows, tuple(ns(w) for w in started.waits),
                                                    ns(started.stacked - started.now),
                                                    ns(called - started.stacked), ns(time.perf_counter() - split)))
        for it, part in zip(batch, parts):
            it.outcome.set(part)
        self._done(batch)


class Later:
    """A model call's result still on its way from the device: `pending.result()` gives it (waits
    for the copy). A call that returns one lets the batcher stack and start the next batch
    before this one's result is waited for (Batcher._loop)."""

    __slots__ = ("pending",)

    def __init__(self, pending: Any):
        self.pending = pending

    def result(self) -> Any:
        return self.pending.result()


@dataclass(eq=False)
class _Started:
    """A batch whose model call has been made: its output (or Later) and its times so far."""
    batch: list[WorkItem]
    out: Any
    now: float
    stacked: float
    waits: list[float]
    rows: int
