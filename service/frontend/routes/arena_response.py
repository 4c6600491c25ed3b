"""A response sent part by part from the request's shared-memory blocks (service/ipc/shm.py),
with no join and no copy: the .npy answers of /decode.

Its rule: the blocks (the request's Lease, from Service.hand_over_lease) go back to the arena
only once every byte of the answer has left the server, or the client has gone. The last `send`
returning is not that moment: uvloop keeps the unsent tail of a view by reference
(service/frontend/http/sent.py), and a block reused by the next request would be sent in its
place."""
from __future__ import annotations

from fastapi import Response

from ..engine import Lease
from ..http.sent import sendable, sent_of


class ArenaResponse(Response):
    def __init__(self, parts: list, lease: Lease, media_type: str, headers: dict):
        self.status_code, self.media_type, self.background = 200, media_type, None
        self.parts, self.lease = parts, lease
        self.init_headers({**headers, "content-length": str(sum(len(p) for p in parts))})

    async def __call__(self, scope, receive, send) -> None:
        sent = sent_of(scope)
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            for i, part in enumerate(self.parts):
                await send({"type": "http.response.body", "body": sendable(part, sent),
                            "more_body": i < len(self.parts) - 1})
            if sent is not None:
                await sent.wait()
        finally:
            self.parts = []
            self.lease.close()
