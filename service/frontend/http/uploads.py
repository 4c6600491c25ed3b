"""Bodies still arriving for admitted requests, so a slow one can give its queue place to a new
request. Admission counts a request from its headers, before its body (service/frontend/pipeline.py);
a client trickling bodies on many connections would otherwise hold every place for the grace
period of the minimum body rate, reconnect, and hold them again. When the queue is full, the
slowest upload that the server has waited on for EVICTABLE_AFTER_S and that is under the minimum
rate loses its place to the newcomer (it gets 408 `body-too-slow`), so steady traffic is served
beside any number of tricklers.

Slow is judged on the clock the body read runs on (service/frontend/http/body_wait.py): bytes per second of
the server's waiting on an empty receive, not of wall time. An upload the server has not read
(its loop busy, its handler not yet asking for the body) is never the slowest, nor is one whose
bytes are at the server unread right now."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

from .body_wait import BodyWait

#: an upload the server has waited on for less than this is never evicted (its first bytes may
#: still be on the way)
EVICTABLE_AFTER_S = 1.0


@dataclass(eq=False)
class Upload:
    wait: BodyWait  # the server's waiting on this body so far
    received: int = 0
    #: the read's timeout while a receive is in progress (bodies.read_body): rescheduled to now
    #: to end the read at once
    deadline: asyncio.Timeout | None = None
    evicted: bool = False
    #: given back when evicted: the request's queue place
    release: Callable[[], None] = field(default=lambda: None, repr=False)

    def rate(self) -> float:
        """Bytes per second the server waited for them."""
        return self.received / max(self.wait.so_far(), 1e-9)


class Uploads:
    """The front end's uploads in flight (touched only on the event loop's thread)."""

    def __init__(self) -> None:
        self.live: set[Upload] = set()

    def evict_slowest(self, min_rate: float) -> bool:
        """End the slowest upload under `min_rate` that is old enough to judge; True if one was."""
        if not min_rate or not self.live:
            return False
        judged = [u for u in self.live if u.wait.so_far() >= EVICTABLE_AFTER_S and u.rate() < min_rate]
        judged = [u for u in judged if not u.wait.at_server()]  # a syscall each: only for the few judged
        if not judged:
            return False
        victim = min(judged, key=Upload.rate)
        self.live.discard(victim)
        victim.evicted = True
        victim.release()
        if victim.deadline is not None:
            victim.deadline.reschedule(asyncio.get_running_loop().time())
        return True
