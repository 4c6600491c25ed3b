"""uvicorn's h11 protocol with a deadline on request headers.

uvicorn closes idle keep-alive connections, but its keep-alive timer is cancelled by every byte
received, and nothing times out a request whose headers never finish: a client sending one header
byte a second holds its connection open forever (slowloris). Here each request's headers must be
complete within `header_timeout_s` of the connection becoming ready for that request (opened, or
its previous response sent); a connection that misses the deadline gets a 408 problem+json and is
closed. Bodies are bounded separately, by the app's request timeout.
"""
from __future__ import annotations

import asyncio
import json
import logging

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .problems import Problem

log = logging.getLogger("convserve.http")


def _timeout_response(seconds: float) -> bytes:
    body = json.dumps(Problem(408, "header-timeout", f"request headers not complete within {seconds:g} s "
                              "(CONVSERVE_HEADER_TIMEOUT_S)").body()).encode()
    head = ("HTTP/1.1 408 Request Timeout\r\ncontent-type: application/problem+json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class HeaderTimeoutH11Protocol(H11Protocol):
    #: set per process by create_app from Settings.header_timeout_s (uvicorn builds the protocol
    #: itself, also in --workers processes, so the class carries the setting)
    header_timeout_s: float = 10.0

    _header_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_timer()
        super().connection_lost(exc)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers were parsed: its deadline is met
            self._cancel_header_timer()

    def on_response_complete(self) -> None:
        # armed first: the base class may parse a pipelined request, which cancels it again
        self._arm_header_timer()
        super().on_response_complete()

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
        waiting_for_headers = self.conn.their_state is h11.IDLE and (self.cycle is None or self.cycle.response_complete)
        if self.transport.is_closing() or not waiting_for_headers:
            return
        log.debug("closing %s: request headers not complete within %g s", self.client, self.header_timeout_s)
        self.transport.write(_timeout_response(self.header_timeout_s))
        self.transport.close()
