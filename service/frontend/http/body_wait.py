"""The time the server waits on a client's body, the clock the minimum body rate and the body
timeout run on (service/frontend/http/bodies.py) and slow uploads are judged by (service/frontend/http/uploads.py).

A client is slow only while the server waits for bytes it has not sent, as with nginx's
client_body_timeout (the time between two reads the server made). Wall time since the body began
would also count the time the server did not read what was already there: its event loop busy
with other connections, the app not yet asking for the next chunk, the process stopped. Under
load that convicted clients sending as fast as the server read (a burst of large uploads to a
busy front end got 408 `body-too-slow` for most of them).

So a receive is a counted wait only when, as it begins, none of the client's bytes are at the
server: nothing buffered by the HTTP protocol and nothing in the socket's kernel buffer. It
counts until the protocol next receives bytes on the connection (not until the waiting task
runs again, which a busy loop delays). The HTTP protocol (service/frontend/http/http_protocol.py) puts an
`Arrivals` in each request's scope for this; without one (another server), every receive counts
in full.
"""
from __future__ import annotations

import fcntl
import math
import struct
import termios
from typing import Any

#: the ASGI scope extension under which the HTTP protocol hands a request its Arrivals
EXTENSION = "convserve.arrivals"


def kernel_unread(fd: int) -> int:
    """Bytes in the socket's kernel receive buffer, not yet read by the server (0 when unknown)."""
    try:
        return struct.unpack("i", fcntl.ioctl(fd, termios.FIONREAD, b"\0\0\0\0"))[0]
    except OSError:
        return 0


class Arrivals:
    """One request's view of its connection, made by the HTTP protocol: when the connection last
    delivered bytes (loop time), and whether bytes of the client's are at the server unread."""

    __slots__ = ("_protocol", "_cycle", "_fd")

    def __init__(self, protocol: Any, cycle: Any, fd: int):
        self._protocol, self._cycle, self._fd = protocol, cycle, fd

    @property
    def last(self) -> float:
        return self._protocol._arrived_at

    def complete(self) -> bool:
        """The whole body has been parsed (the protocol saw the request's end): reading it waits
        on nothing of the client's. Both of uvicorn's cycles (httptools, h11) keep `more_body`."""
        return not self._cycle.more_body

    def at_server(self) -> bool:
        if self._cycle.body:  # parsed, not yet handed to the app
            return True
        return self._fd >= 0 and not self._protocol.transport.is_closing() and kernel_unread(self._fd) > 0


def arrivals_of(scope: dict) -> Arrivals | None:
    return (scope.get("extensions") or {}).get(EXTENSION)


class BodyWait:
    """Seconds the server has waited on one body's bytes. `allowance` (the body's budget of
    waiting so far) caps each wait: a wait that outlasts it either ends the body (nothing at the
    server: the client is slow) or, where the bytes came while the server was late, uses up the
    allowance without a verdict, so the clock never runs past the budget it is judged against."""

    def __init__(self, arrivals: Arrivals | None, now):
        self.arrivals = arrivals
        self._now = now  # the event loop's clock
        self.waited = 0.0
        self._since: float | None = None  # a counted wait in progress began then
        self._left = 0.0  # of the allowance, when it began

    def at_server(self) -> bool:
        return self.arrivals is not None and self.arrivals.at_server()

    def begin(self, allowance: float) -> float | None:
        """A receive begins: the loop time by which bytes must have come, or None when the
        client's bytes are already at the server (the receive is not a wait on the client)."""
        if self.at_server():
            self._since = None
            return None
        self._since = self._now()
        self._left = max(0.0, allowance - self.waited)
        return self._since + self._left if math.isfinite(self._left) else None

    def end(self) -> None:
        """The receive returned or its deadline passed."""
        self.waited = self.so_far()
        self._since = None

    def so_far(self) -> float:
        if self._since is None:
            return self.waited
        end = self._now()
        if self.arrivals is not None and self.arrivals.last > self._since:
            end = min(end, self.arrivals.last)  # bytes came then; the task resuming later is the server's delay
        return self.waited + min(end - self._since, self._left)
