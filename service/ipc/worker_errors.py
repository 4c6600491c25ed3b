"""Why a request failed in a model worker, or with it: the one table of error kinds.

A kind is what crosses the process boundary (service/ipc/worker_protocol.py's WorkerError): the
model worker names it from the exception its model call raised (`error_info`), a front end names
the ones it finds itself (its worker died or went unresponsive, service/frontend/engine.py), and a front
end turns it into the HTTP problem its client gets (`problem`). One row per kind, both directions:
a new kind is one line here. The exceptions a worker raises for the kinds are defined here too."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .. import metrics
from ..problems import Problem
from .worker_protocol import WorkerError


# ---- the exceptions of a model worker that cross as kinds: raised there (the batcher, OOM recovery,
# shard groups, streamed decodes), defined here so that a front end, which reads this table, loads
# none of the worker's code
class Closed(Exception):
    """The batcher stopped before the item ran."""


class Cancelled(Exception):
    """The item was withdrawn before its model call started."""


class DeviceOutOfMemory(Exception):
    """A decode ran out of device memory even in the smallest tiles tried."""


class ShardFailed(RuntimeError):
    """A sharded decode that failed on its emulated shards (the worker stays up)."""


class StreamClosed(Exception):
    """A step asked of a decode whose stream has ended."""


#: Retry-After of a row: the queue's own estimate (Service.retry_after) rather than fixed seconds
QUEUE_ESTIMATE = "queue"


@dataclass(frozen=True)
class ErrorKind:
    kind: str                      # the name that crosses the process boundary
    raised_as: tuple[type, ...]    # the exceptions of a model call it names (first row that matches)
    status: int                    # the HTTP answer
    problem: str                   # its problem+json kind
    message: str | None = None     # the client's detail; None: the exception's own text
    retry_after: str | None = None  # seconds, QUEUE_ESTIMATE, or None: no Retry-After
    fault: str | None = None       # convserve_faults_total's fault label, where counted here


#: in the order an exception is matched: a subclass's row before its base's (ValueError is broad)
KINDS = (
    ErrorKind("device-oom", (DeviceOutOfMemory,), 503, "device-out-of-memory", retry_after=QUEUE_ESTIMATE),
    ErrorKind("cancelled", (Cancelled,), 499, "client-gone", "withdrawn before it ran"),
    ErrorKind("closed", (Closed,), 503, "shutting-down", "the worker stopped before this request ran"),
    ErrorKind("stream-closed", (StreamClosed,), 409, "stream-closed"),
    ErrorKind("shard-failed", (ShardFailed,), 503, "shard-failed", retry_after=QUEUE_ESTIMATE, fault="shard_failed"),
    ErrorKind("invalid-input", (ValueError,), 422, "model-rejected-input"),
    # a front end's own: its worker is gone or silent (service/frontend/engine.py)
    ErrorKind("worker-died", (), 503, "worker-died", retry_after="2", fault="worker_died"),
    ErrorKind("worker-unresponsive", (), 503, "worker-unresponsive", retry_after="2", fault="worker_unresponsive"),
    # anything else a model call raised: a 500 whose id ties it to the worker log's traceback
    ErrorKind("model-error", (BaseException,), 500, "model-error", fault="worker_exception"),
)
_BY_NAME = {k.kind: k for k in KINDS}
MODEL_ERROR = _BY_NAME["model-error"]


def error_info(exc: BaseException) -> WorkerError:
    """An exception of a model call -> what crosses the process boundary."""
    row = next(k for k in KINDS if isinstance(exc, k.raised_as))
    if row is MODEL_ERROR:
        return WorkerError(row.kind, f"{exc.__class__.__name__}: {exc}", getattr(exc, "error_id", None))
    return WorkerError(row.kind, row.message or str(exc))


def problem(model: str, kind: str, message: str, error_id: str | None, queue_estimate: Callable[[], str]) -> Problem:
    """A failed request's answer to its client (an unknown kind answers as a model error)."""
    row = _BY_NAME.get(kind, MODEL_ERROR)
    if row.fault is not None:
        metrics.count_fault(model, row.fault, "failed")
    if row is MODEL_ERROR:
        return Problem(500, row.problem, f"{message} (error id {error_id}; the server log has the traceback)",
                       error_id=error_id)
    retry = queue_estimate() if row.retry_after == QUEUE_ESTIMATE else row.retry_after
    return Problem(row.status, row.problem, message, headers={"Retry-After": retry} if retry else None)
