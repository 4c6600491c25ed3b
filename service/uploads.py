"""Bodies still arriving for admitted requests, so a slow one can give its queue place to a new
request. Admission counts a request from its headers, before its body (service/pipeline.py);
a client trickling bodies on many connections would otherwise hold every place for the grace
period of the minimum body rate, reconnect, and hold them again. When the queue is full, the
slowest upload that has run for EVICTABLE_AFTER_S and is under the minimum rate loses its place
to the newcomer (it gets 408 `body-too-slow`), so steady traffic is served beside any number of
tricklers."""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Callable

#: an upload younger than this is never evicted (its first bytes may still be on the way)
EVICTABLE_AFTER_S = 1.0


@dataclass(eq=False)
class Upload:
    started: float  # event-loop time the body began to be read
    received: int = 0
    #: the read's timeout (bodies.read_body): rescheduled to now to end the read at once
    deadline: asyncio.Timeout | None = None
    evicted: bool = False
    #: given back when evicted: the request's queue place
    release: Callable[[], None] = field(default=lambda: None, repr=False)

    def rate(self, now: float) -> float:
        return self.received / max(now - self.started, 1e-9)


class Uploads:
    """The front end's uploads in flight (touched only on the event loop's thread)."""

    def __init__(self) -> None:
        self.live: set[Upload] = set()

    def evict_slowest(self, min_rate: float) -> bool:
        """End the slowest upload under `min_rate` that is old enough to judge; True if one was."""
        if not min_rate or not self.live:
            return False
        now = asyncio.get_running_loop().time()
        judged = [u for u in self.live if now - u.started >= EVICTABLE_AFTER_S and u.rate(now) < min_rate]
        if not judged:
            return False
        victim = min(judged, key=lambda u: u.rate(now))
        self.live.discard(victim)
        victim.evicted = True
        victim.release()
        if victim.deadline is not None:
            victim.deadline.reschedule(now)
        return True
