"""When a response's bytes have left the server: what a response sent straight from shared memory
(service/frontend/routes/arena_response.py) waits for before its blocks go back to the arena.

uvloop's transport keeps a reference to the part of a buffer the socket did not take at once,
where asyncio's copies it. Measured on Linux with uvloop 0.22: after `write()` of a 64 MiB
memoryview to a reader that had not read yet, 63.2 MiB of it were still queued by reference, and
writing the buffer afterwards changed what the reader received. A block let go after the last
`send` could be handed to the next request and its worker's output sent in place of this one's.

So the HTTP protocol (service/frontend/http/http_protocol.py) puts a `Sent` in each request's
scope: `await sent.wait()` returns once the connection's write buffer is empty: every byte is in
the kernel, which copied it, or the connection was dropped (a reader that stalls past
CONVSERVE_WRITE_TIMEOUT_S is aborted, so the wait is bounded). Without one (another server),
`sendable` copies the views: nothing sent can change after its send.
"""
from __future__ import annotations

import asyncio
from typing import Any

#: the ASGI scope extension under which the HTTP protocol hands a request its Sent
EXTENSION = "convserve.sent"

#: the first and the longest pause between two looks at the write buffer
_FIRST_POLL_S, _MAX_POLL_S = 0.001, 0.05


class Sent:
    """One connection's write buffer, as a request's response sees it."""

    __slots__ = ("_transport",)

    def __init__(self, transport: Any):
        self._transport = transport

    def pending(self) -> int:
        """Bytes written to the transport and not yet taken by the kernel (0 once dropped)."""
        try:
            return int(self._transport.get_write_buffer_size())
        except (AttributeError, RuntimeError):  # a transport already torn down holds nothing
            return 0

    async def wait(self) -> None:
        """Until the transport holds none of the bytes written so far."""
        pause = _FIRST_POLL_S
        while self.pending() > 0:
            await asyncio.sleep(pause)
            pause = min(2 * pause, _MAX_POLL_S)


def sent_of(scope: dict) -> Sent | None:
    return (scope.get("extensions") or {}).get(EXTENSION)


def sendable(part: Any, sent: Sent | None) -> Any:
    """A body part to hand to `send`: as it is where the response will wait for it to be sent
    (`sent`), else bytes of its own (another server may keep the view it was given)."""
    if sent is not None or isinstance(part, bytes):
        return part
    return bytes(part)


class HeldUntilSent:
    """Leases of a response sent in several parts, each let go once the bytes written up to its
    last part have left the server: a long answer (a whole clip, group by group) gives its early
    blocks back while it still writes later ones, without waiting for the buffer to drain between
    groups. Counts only the body bytes it is told of; the transport's buffer may hold the head
    too, which only delays a release."""

    def __init__(self, sent: Sent):
        self.sent = sent
        self.written = 0
        self._held: list[tuple[int, Any]] = []

    def wrote(self, nbytes: int) -> None:
        self.written += nbytes

    def hold(self, lease: Any) -> None:
        """`lease` goes back once everything written so far has left."""
        self._held.append((self.written, lease))
        self.release_sent()

    def release_sent(self) -> None:
        left = self.written - self.sent.pending()
        while self._held and self._held[0][0] <= left:
            self._held.pop(0)[1].close()

    async def drain(self) -> None:
        """Every lease let go once every byte has left (or the connection has gone)."""
        await self.sent.wait()
        self.release_all()

    def release_all(self) -> None:
        """Let every lease go now: the connection is being torn down (what it still holds of
        their bytes goes with it)."""
        held, self._held = self._held, []
        for _, lease in held:
            lease.close()
