"""What an admitted request holds while the front end works on it, and the context variable that
lets the body reader and the model call find it: a queue place until its first model call, the
arena blocks its tensors travel in (engine.Lease), its share of the memory budget, and its upload
while the body arrives. `service` is the front end's pipeline.Service (typed loosely: the service
imports this module)."""
from __future__ import annotations

import contextvars
from typing import Any

from .engine import Lease
from .http.body_wait import BodyWait
from .http.uploads import Upload


class AdmittedRequest:
    """What a request holds between admission and its response: a queue place until its first
    model call (Service._admit), the arena blocks its tensors travel in (engine.Lease), and its
    share of the memory budget (given back with the lease's blocks)."""

    def __init__(self, service: Any, model: str, lease: Lease):
        self.service, self.model = service, model
        self.reserved = True
        self.lease = lease
        self.taken = 0  # of the memory budget, over the request's life
        self.upload: Upload | None = None  # while its body arrives (service/frontend/http/uploads.py)

    def take(self, nbytes: int, what: str) -> None:
        if nbytes > 0:
            self.service.take_memory(self.model, self.lease, nbytes, what, held=self.taken)
            self.taken += nbytes


CURRENT: contextvars.ContextVar[AdmittedRequest | None] = contextvars.ContextVar("convserve_request", default=None)


def begin_upload(wait: BodyWait) -> Upload | None:
    """The current request's body begins to arrive (`wait`: the server's waiting on it): tracked,
    so a full queue may take its place if it is too slow (service/frontend/http/uploads.py). None outside an
    admitted request."""
    req = CURRENT.get()
    if req is None or not req.reserved:
        return None
    svc = req.service
    req.upload = Upload(wait, release=lambda: svc._unreserve(req))
    svc.uploads.live.add(req.upload)
    return req.upload


def end_upload(upload: Upload | None) -> None:
    if upload is not None:
        CURRENT.get().service.uploads.live.discard(upload)


def charge_request(nbytes: int, what: str) -> None:
    """Count `nbytes` against the current request's front-end memory budget (503/413 when it
    does not fit; service/frontend/memory_budget.py). Outside an admitted request: nothing to count."""
    req = CURRENT.get()
    if req is not None:
        req.take(nbytes, what)
