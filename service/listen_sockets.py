"""The server's listening sockets: the CLI binds the first (front end 0's, in the supervisor's
process), the supervisor one for each further front end each time it starts it. The rules:

- With FRONTEND_SOCKETS=own (the default) on Linux, each front end accepts on a socket of its own,
  all bound to the server's port in one SO_REUSEPORT group: the kernel spreads new connections over
  the group's listening sockets by a hash of each connection's addresses. On one shared socket the
  idle front ends raced for each connection, and under 256 kept connections on one H200 the busiest
  front end used a whole core while the median one used half of one: its queue was the latency tail
  (benchmarks/HISTORY.md "One H200, 2026-11-30 15:49-16:30 UTC").
- A socket joins the group's spreading only when it listens, and uvicorn listens after the app's
  start-up, which in a further front end waits until it can serve (service/frontend/app.py,
  accept_once_ready): no connection waits on a front end that is still starting.
- The supervisor keeps no copy of a further front end's socket once its process has started: when
  the front end dies its socket closes and leaves the group, new connections go to the others, and
  its restart binds a new one. (What was queued on it at that moment is reset, as it is on any
  server that dies.)
- The first socket is bound only after a plain socket has found the port free: a second server
  started on the same port is refused as "in use" instead of joining the group.
- Elsewhere (macOS's SO_REUSEPORT does not spread connections), or with FRONTEND_SOCKETS=shared,
  every front end accepts on the first socket, as before.
"""
from __future__ import annotations

import logging
import socket
import sys

log = logging.getLogger("convserve.supervisor")


def spreads() -> bool:
    """This system spreads a port's connections over a SO_REUSEPORT group's sockets."""
    return sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")


def _bound(family: int, address: tuple, group: bool) -> socket.socket:
    sock = socket.socket(family)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        if group:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.bind(address)
    except BaseException:
        sock.close()
        raise
    sock.set_inheritable(True)  # the front ends are processes of their own
    return sock


def bind_first(host: str, port: int, group: bool) -> socket.socket:
    """Front end 0's socket, bound to (host, port); group: one a further front end's socket may
    join (bind_sibling). OSError as bind raises it (the CLI words it)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if not group:
        return _bound(family, (host, port), False)
    probe = _bound(family, (host, port), False)  # EADDRINUSE where anything holds the port
    port = probe.getsockname()[1]  # port 0: the one the system chose
    probe.close()
    return _bound(family, (host, port), True)


def bind_sibling(first: socket.socket) -> socket.socket:
    """A further front end's socket in `first`'s group (bind_first with group=True)."""
    return _bound(first.family, first.getsockname()[:2], True)


def in_group(sock: socket.socket) -> bool:
    """`sock` was bound to join a SO_REUSEPORT group (bind_first with group=True)."""
    return spreads() and bool(sock.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT))


class OwnSocketArgs:
    """A further front end's process arguments made afresh at each start, with a socket of its own
    in `first`'s group (the rules above); `started()` drops this process's copy of it once the
    front end has its own."""

    def __init__(self, first: socket.socket, make):
        self.first, self.make = first, make  # make(sockets) -> the process's arguments
        self._sock = first  # the socket the last arguments carry

    def __call__(self) -> tuple:
        try:
            self._sock = bind_sibling(self.first)
        except OSError as exc:  # out of descriptors, say: this start shares the first socket instead
            log.warning("a front end's own listening socket could not be bound (%s); it shares front end 0's", exc)
            self._sock = self.first
        return self.make([self._sock])

    def started(self) -> None:
        if self._sock is not self.first:
            self._sock.close()
