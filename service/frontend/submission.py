"""One request's messages to a model worker and the arena blocks they name (service/frontend/engine.py
sends them): a `Submission` awaits its worker's answer; a `Lease` holds a request's blocks until
its response is built.

A submission's blocks are freed only when both its request is done with them (`release`, from
`Lease.close`) and its worker has answered for it (`settle`: a result, a failure, or the link's
loss): the worker may be writing into them until then (service/ipc/shm.py's rules). A request may be
answered before that (`fail`: its worker went unresponsive) or stop waiting (timeout, client gone);
its blocks still wait for the worker's answer."""
from __future__ import annotations

import asyncio
from typing import Callable

import numpy as np

from ..ipc.shm import Arena, TensorRef
from ..ipc.worker_protocol import WorkerError


class WorkerFailure(Exception):
    """A worker's answer that is not a result (its WorkerError: kind, message, error id), or its loss."""

    def __init__(self, error: WorkerError):
        super().__init__(error.message)
        self.kind, self.message, self.error_id = error.kind, error.message, error.error_id


class NoWorker(Exception):
    """No live, ready worker serves the model right now: (problem kind, detail)."""

    def __init__(self, kind: str = "no-live-worker", detail: str = "no model worker serving it is up; retry shortly"):
        super().__init__(detail)
        self.kind, self.detail = kind, detail


def _retrieve(future: asyncio.Future) -> None:
    """A request may stop waiting (timeout, client gone, worker unresponsive) before its worker
    answers: the late answer is read here, so asyncio does not log a failure nobody had to see."""
    if not future.cancelled():
        future.exception()


class Submission:
    """One message to a worker that awaits its `done`, and the arena blocks it names."""

    def __init__(self, arena: Arena, link, rid: int, rows: int, offsets: list[int], outputs: dict[str, TensorRef]):
        """link: the engine's link to the worker it went to (service/frontend/engine.py)."""
        self.arena, self.link, self.rid, self.rows = arena, link, rid, rows
        self.offsets, self.outputs = offsets, outputs
        self.future: asyncio.Future = asyncio.get_running_loop().create_future()
        self.future.add_done_callback(_retrieve)
        self.started = False
        self.settled = False
        self.released = False

    def settle(self, error: WorkerError | None, payload=None) -> None:
        if self.settled:
            return
        self.settled = True
        if not self.future.done():
            if error is None:
                self.future.set_result(payload)
            else:
                self.future.set_exception(WorkerFailure(error))
        self._maybe_free()

    def fail(self, error: WorkerError) -> None:
        """Answer the request now, the blocks kept until the worker answers (settle)."""
        if not self.future.done():
            self.future.set_exception(WorkerFailure(error))

    def release(self) -> None:
        """The request is done with the blocks (its response is built)."""
        self.released = True
        self._maybe_free()

    def _maybe_free(self) -> None:
        if self.settled and self.released and self.offsets:
            for off in self.offsets:
                self.arena.free(off)
            self.offsets = []

    def arrays(self) -> dict[str, np.ndarray]:
        return {name: self.arena.array(ref) for name, ref in self.outputs.items()}


class Lease:
    """The arena blocks of one request: raw blocks and submissions, let go together when the
    request's response is built (Service.admit's block)."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.submissions: list[Submission] = []
        #: run once the blocks are let go (the memory budget's give-backs)
        self.on_close: list[Callable[[], None]] = []

    def close(self) -> None:
        for sub in self.submissions:
            sub.release()
        self.submissions = []
        callbacks, self.on_close = self.on_close, []
        for fn in callbacks:
            fn()
