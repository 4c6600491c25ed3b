"""uvicorn's h11 and httptools protocols with a deadline on request headers.

uvicorn closes idle keep-alive connections, but its keep-alive timer is cancelled by every byte
received, and nothing times out a request whose headers never finish: a client sending one header
byte a second holds its connection open forever (slowloris). Here each request's headers must be
complete within `header_timeout_s` of the request starting: the connection opening for the first
request, and the first byte of the next request on a kept-alive connection. (Idle time between
requests belongs to uvicorn's keep-alive timeout, CONVSERVE_KEEP_ALIVE_S: counting it here would
answer a client that reuses a connection after `header_timeout_s` of idle with an unsolicited 408.)
A connection that misses the deadline gets a 408 problem+json and is closed.

A request's head is bounded in bytes and header fields (service/frontend/http/http_heads.py): 431, and the
connection closes, lingering as below.

A response sent while the request body is still arriving (413 by Content-Length, 401, 404, 429)
closes the connection, lingering: uvicorn would otherwise discard the unread body for as long as
the client keeps trickling it, holding the connection open, and a plain close with unread bytes
makes the kernel send a reset that can destroy the answer before the client reads it (clients
then see a read error instead of the 413). So the answer is followed by a FIN (the write side
shut), the rest of the body is read and dropped for a bounded time (LINGER_IDLE_S without data,
LINGER_MAX_S in all, LINGER_MAX_BYTES), and only then is the socket closed. Bodies the app reads
are bounded by its request timeout and minimum rate (service/frontend/http/bodies.py).

A response the client stops reading is dropped: when the socket's send buffer stays full
(asyncio paused writing) for `write_timeout_s` with no byte of progress, the connection is
aborted, which frees the response bytes queued for it (a client that never reads a 200 MB
.npy would otherwise hold them for as long as its connection lives).
"""
from __future__ import annotations

import asyncio
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

try:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
except ImportError:  # pragma: no cover - httptools not installed
    HttpToolsProtocol = None

from ... import metrics
from .body_wait import EXTENSION, Arrivals
from .http_heads import TOO_MANY_FIELDS, CountedHeadersConnection, HeadLimits, problem_response
from .sent import EXTENSION as SENT_EXTENSION
from .sent import Sent

log = logging.getLogger("convserve.http")

#: a lingering close ends after this long with no data from the client, this long in all, or
#: once this many bytes were dropped: whichever comes first
LINGER_IDLE_S = 1.0
LINGER_MAX_S = 5.0
LINGER_MAX_BYTES = 64 << 20


class _LingeringTransport:
    """The protocol's transport as uvicorn sees it: `close()` on a connection whose request body
    is still unread lingers (the protocol's `_linger`) instead of closing at once; everything
    else is the real transport's. uvicorn closes from several places (the response cycle, the
    keep-alive timer, shutdown), so the seam is the transport, not one of them."""

    def __init__(self, transport, protocol):
        self._transport, self._protocol = transport, protocol

    def close(self) -> None:
        if self._protocol._body_unread() and not self._transport.is_closing():
            self._protocol._linger()
        elif not self._protocol._lingering:
            self._transport.close()

    def is_closing(self) -> bool:
        return self._protocol._lingering or self._transport.is_closing()

    def __getattr__(self, name):
        return getattr(self._transport, name)


def _timeout_response(seconds: float) -> bytes:
    return problem_response(408, "Request Timeout", "header-timeout",
                             f"request headers not complete within {seconds:g} s (CONVSERVE_HEADER_TIMEOUT_S)")


class _HeaderDeadline(HeadLimits):
    """What both protocol classes share: the header timer and the close after a response sent
    while the request body was unread. A subclass says, in its parser's terms, when the
    connection waits for a request's headers, whether a next request has begun arriving, and
    whether the current request's body is still unread."""

    #: set per process by create_app from Settings.header_timeout_s / write_timeout_s (uvicorn
    #: builds the protocol itself, also in --workers processes, so the class carries the setting)
    header_timeout_s: float = 10.0
    write_timeout_s: float = 30.0

    _header_timer: asyncio.TimerHandle | None = None
    _write_timer: asyncio.TimerHandle | None = None
    _write_backlog = 0
    _lingering = False
    _linger_timer: asyncio.TimerHandle | None = None
    _linger_end = 0.0
    _lingered_bytes = 0
    _linger_max_bytes = LINGER_MAX_BYTES
    _arrived_at = 0.0  # loop time the connection last delivered bytes (service/frontend/http/body_wait.py)
    _fd = -1

    def _waiting_for_headers(self) -> bool:
        raise NotImplementedError

    def _next_request_begun(self) -> bool:
        raise NotImplementedError

    def _body_unread(self) -> bool:
        raise NotImplementedError

    def connection_made(self, transport) -> None:
        self._real_transport = transport
        sock = transport.get_extra_info("socket")
        self._fd = sock.fileno() if sock is not None else -1
        super().connection_made(_LingeringTransport(transport, self))
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        for timer in (self._write_timer, self._linger_timer):
            if timer is not None:
                timer.cancel()
        self._write_timer = self._linger_timer = None
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._lingering:  # the rest of a body answered early: dropped unparsed
            self._lingered_bytes += len(data)
            if self._lingered_bytes > self._linger_max_bytes:
                self._real_transport.close()
            else:
                self._rearm_linger()
            return
        self._arrived_at = self.loop.time()
        self.feed(data)  # with a request head's bytes counted (service/frontend/http/http_heads.py)
        if self._header_timer is None and self._waiting_for_headers():  # a kept-alive connection's next request began
            self._arm_header_timer()

    def _head_complete(self) -> None:
        super()._head_complete()
        self._cancel_header_timer()  # a request's headers were parsed: its deadline is met

    def _arrivals(self, cycle) -> None:
        """The new request's view of its connection: for its body reader (service/frontend/http/body_wait.py),
        and for a response sent from shared memory, its write buffer (service/frontend/http/sent.py)."""
        extensions = cycle.scope.setdefault("extensions", {})
        extensions[EXTENSION] = Arrivals(self, cycle, self._fd)
        extensions[SENT_EXTENSION] = Sent(self._real_transport)

    def on_response_complete(self) -> None:
        if self._body_unread() and not self.transport.is_closing():
            # answered before its body arrived: the rest of the body would be read and dropped
            # for as long as the client sends it (the app's response says Connection: close)
            self.transport.close()
        super().on_response_complete()
        # bytes of the next request that came during this one (not pipelined whole) start its clock
        if self._header_timer is None and self._next_request_begun() and self._waiting_for_headers():
            self._arm_header_timer()

    # ---- lingering close ------------------------------------------------------------------------
    def _linger(self, max_bytes: int = LINGER_MAX_BYTES) -> None:
        self._lingering = True
        self._linger_max_bytes = max_bytes
        self._cancel_header_timer()
        real = self._real_transport
        real.resume_reading()  # flow control may have paused reading while the body buffered
        if real.can_write_eof():
            real.write_eof()  # the answer, then FIN: the client reads it and stops sending
        self._linger_end = self.loop.time() + LINGER_MAX_S
        self._rearm_linger()

    def _rearm_linger(self) -> None:
        if self._linger_timer is not None:
            self._linger_timer.cancel()
        when = min(self.loop.time() + LINGER_IDLE_S, self._linger_end)
        self._linger_timer = self.loop.call_at(when, self._real_transport.close)

    def eof_received(self):
        if self._lingering:  # the client finished (or gave up) sending: the linger is over
            self._real_transport.close()
            return None
        return super().eof_received()

    # ---- write stalls ------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._write_timer is None:
            self._arm_write_timer()

    def resume_writing(self) -> None:
        if self._write_timer is not None:
            self._write_timer.cancel()
            self._write_timer = None
        super().resume_writing()

    def _arm_write_timer(self) -> None:
        self._write_backlog = self._real_transport.get_write_buffer_size()
        self._write_timer = self.loop.call_later(self.write_timeout_s, self._write_check)

    def _write_check(self) -> None:
        self._write_timer = None
        backlog = self._real_transport.get_write_buffer_size()
        if backlog < self._write_backlog:  # the client reads, however slowly: look again later
            self._arm_write_timer()
            return
        log.info("dropping %s: it read nothing of its response for %g s (%d bytes queued)",
                 self.client, self.write_timeout_s, backlog)
        metrics.WRITE_STALLS.inc()
        self._real_transport.abort()

    # ---- the header deadline ---------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._cancel_header_timer()
        if not self.transport.is_closing():
            self._header_timer = self.loop.call_later(self.header_timeout_s, self._header_timeout)

    def _cancel_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.transport.is_closing() or not self._waiting_for_headers():
            return
        log.debug("closing %s: request headers not complete within %g s", self.client, self.header_timeout_s)
        self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()


class HeaderTimeoutH11Protocol(_HeaderDeadline, H11Protocol):
    def __init__(self, config, *args, **kwargs):
        super().__init__(config, *args, **kwargs)
        self.conn = CountedHeadersConnection(h11.SERVER, config.h11_max_incomplete_event_size or
                                             h11.DEFAULT_MAX_INCOMPLETE_EVENT_SIZE)
        self.conn.max_headers = self.max_headers

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers were parsed
            self._head_complete()
            self._arrivals(self.cycle)

    @property
    def _head_refusal(self) -> str | None:
        return self.conn.refused

    def _in_head(self) -> bool:
        # while a request is answered (DONE), h11 buffers what comes unparsed, and uvicorn stops
        # reading: counted below once the next request's turn comes
        return self.conn.their_state is h11.IDLE

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.conn.their_state is h11.IDLE:  # the next request's head, unfinished, may be buffered
            self._head_bytes = len(self.conn.trailing_data[0])

    def _waiting_for_headers(self) -> bool:
        return self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)

    def _next_request_begun(self) -> bool:
        return bool(self.conn.trailing_data[0])

    def _body_unread(self) -> bool:
        return self.conn.their_state is h11.SEND_BODY


if HttpToolsProtocol is not None:
    class HeaderTimeoutHttpToolsProtocol(_HeaderDeadline, HttpToolsProtocol):
        """The same protections on uvicorn's httptools (llhttp) parser. httptools replaces
        `self.cycle` as soon as a pipelined request's headers are parsed, so "the request whose
        response just completed" is the current cycle only when that cycle is complete."""

        _headers_begun = False  # a request's first bytes were parsed, its headers not yet complete
        _in_body = False  # the parser is in a request's body
        _header_count = 0

        def on_message_begin(self) -> None:
            self._headers_begun = True
            self._header_count = 0
            super().on_message_begin()

        def on_header(self, name: bytes, value: bytes) -> None:
            self._header_count += 1
            if self._header_count > self.max_headers:
                # raised through llhttp, it ends the parse; uvicorn answers 400, which
                # send_400_response turns into this 431
                self._head_refusal = TOO_MANY_FIELDS.format(self.max_headers)
                raise ValueError(self._head_refusal)
            super().on_header(name, value)

        def on_headers_complete(self) -> None:
            self._headers_begun = False
            self._in_body = True
            self._head_complete()
            cycle = self.cycle
            super().on_headers_complete()
            if self.cycle is not cycle:
                self._arrivals(self.cycle)

        def on_message_complete(self) -> None:
            self._in_body = False
            super().on_message_complete()

        def _in_head(self) -> bool:
            return not self._in_body

        def _waiting_for_headers(self) -> bool:
            cycle = self.cycle
            return cycle is None or (cycle.response_complete and not cycle.more_body)

        def _next_request_begun(self) -> bool:
            return self._headers_begun

        def _body_unread(self) -> bool:
            cycle = self.cycle
            return cycle is not None and cycle.response_complete and cycle.more_body
else:  # pragma: no cover - uvicorn without its [standard] extras
    HeaderTimeoutHttpToolsProtocol = None


def http_protocol_class(name: str) -> type:
    """The protocol class for Settings.http: "h11", "httptools", or "auto" (httptools where it
    imports, else h11)."""
    if name == "auto":
        name = "h11" if HeaderTimeoutHttpToolsProtocol is None else "httptools"
    if name == "h11":
        return HeaderTimeoutH11Protocol
    if name == "httptools":
        if HeaderTimeoutHttpToolsProtocol is None:
            raise ImportError("CONVSERVE_HTTP=httptools needs httptools (pip install httptools)")
        return HeaderTimeoutHttpToolsProtocol
    raise ValueError(f"unknown HTTP protocol {name!r}: expected auto, h11 or httptools")


class CloseWhenBodyUnread:
    """ASGI middleware: a response that starts before the app has read the whole request body
    says `Connection: close` (the protocol above then closes once it is sent), so the client
    knows not to reuse the connection and stops sending the body."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not _has_body(scope["headers"]):
            return await self.app(scope, receive, send)
        body_read = False

        async def tracking_receive():
            nonlocal body_read
            message = await receive()
            if message["type"] != "http.request" or not message.get("more_body", False):
                body_read = True
            return message

        async def closing_send(message):
            if message["type"] == "http.response.start" and not body_read:
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != b"connection"]
                message = {**message, "headers": [*headers, (b"connection", b"close")]}
            await send(message)

        await self.app(scope, tracking_receive, closing_send)


def _has_body(headers) -> bool:
    for key, value in headers:
        if key == b"transfer-encoding" or (key == b"content-length" and value.strip() not in (b"0", b"")):
            return True
    return False
