"""Limits on a request's head (request line and headers) for both of uvicorn's HTTP/1.1 parsers:
at most `max_head_bytes` bytes and `max_headers` header fields, else 431 problem+json and the
connection closes.

Neither parser bounds a head on its own: llhttp (httptools) buffers a header line however long
it is, a chunk at a time by bytes concatenation (a 60 MB line cost seconds of the event loop and
hundreds of MiB, and the header deadline cannot fire while the loop parses), and h11 bounds only
a head that is still unfinished (16 KiB by default, answered 400), with no limit on the number
of fields. So the bytes of a head are counted as they arrive, before the parser sees them: the
parser gets at most `max_head_bytes` of one head, and the first byte past it is answered at once,
without buffering the rest. Header fields are counted by the parser's own callbacks (httptools)
or as h11 hands over the request (`CountedHeadersConnection`), before uvicorn starts the app."""
from __future__ import annotations

import json
import logging

import h11

from ... import metrics
from ...problems import Problem

log = logging.getLogger("convserve.http")

#: what a refused head's lingering close reads and drops at most: enough for a client that sends
#: its whole oversized head before reading (httpx, curl) to finish and read the 431; an endless
#: header line is cut there instead of costing the loop up to LINGER_MAX_BYTES of reads
HEAD_LINGER_BYTES = 1 << 20
TOO_MANY_BYTES = "the request head is over {} bytes (CONVSERVE_MAX_HEADER_BYTES)"
TOO_MANY_FIELDS = "more than {} header fields (CONVSERVE_MAX_HEADERS)"


def problem_response(status: int, reason: str, kind: str, detail: str) -> bytes:
    """A problem+json answer written by the protocol itself (no request reached the app)."""
    body = json.dumps(Problem(status, kind, detail).body()).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/problem+json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")
    return head.encode() + body


class CountedHeadersConnection(h11.Connection):
    """h11's connection, refusing a request with more than `max_headers` header fields."""

    max_headers = 100
    refused: str | None = None

    def next_event(self):
        event = super().next_event()
        if type(event) is h11.Request and len(event.headers) > self.max_headers:
            self.refused = TOO_MANY_FIELDS.format(self.max_headers)
            # uvicorn answers a protocol error with its 400, which HeadLimits turns into the 431
            raise h11.RemoteProtocolError(self.refused, error_status_hint=431)
        return event


class HeadLimits:
    """Mixed into the protocol classes (service/frontend/http/http_protocol.py) before uvicorn's own: `feed`
    hands received bytes to the parser with a request head's bytes counted; `send_400_response`
    turns uvicorn's 400 for a parser stopped at a limit of ours into the 431. A subclass says
    when the next bytes belong to a head (`_in_head`), calls `_head_complete` once one is
    parsed, and sets `_head_refusal` when its parser stopped a head for too many fields."""

    #: set per process by create_app from the settings (uvicorn builds the protocol itself)
    max_head_bytes: int = 64 * 1024
    max_headers: int = 100

    _head_bytes = 0  # of the head being received, handed to the parser
    _heads_done = 0  # request heads parsed on this connection
    _head_refusal: str | None = None  # why the parser stopped a head (too many header fields)

    def _in_head(self) -> bool:
        """The next bytes received are (part of) a request head, in the parser's terms."""
        raise NotImplementedError

    def feed(self, data: bytes) -> None:
        while data:
            if not self._in_head():
                # a body: the parser takes all of it (bytes of a pipelined next head in the same
                # read go uncounted: one read's worth at most)
                super().data_received(data)
                return
            room = self.max_head_bytes - self._head_bytes
            if room <= 0:
                return self._refuse_head(TOO_MANY_BYTES.format(self.max_head_bytes))
            heads = self._heads_done
            piece, data = (data, b"") if len(data) <= room else (data[:room], data[room:])
            self._head_bytes += len(piece)
            super().data_received(piece)
            if self._lingering or self.transport.is_closing():
                return
            if self._heads_done == heads and data:  # the same head goes on past the limit
                return self._refuse_head(TOO_MANY_BYTES.format(self.max_head_bytes))

    def _head_complete(self) -> None:
        self._heads_done += 1
        self._head_bytes = 0

    def send_400_response(self, msg: str) -> None:
        if self._head_refusal is not None:  # the parser stopped at a limit of ours: say which
            return self._refuse_head(self._head_refusal)
        super().send_400_response(msg)

    def _refuse_head(self, detail: str) -> None:
        """431, then a lingering close: the client reads the answer, and what it still sends is
        dropped unparsed."""
        if self._lingering:
            return
        log.info("refusing %s: %s", self.client, detail)
        metrics.REJECTED.labels("", "headers_too_large").inc()
        self._real_transport.write(problem_response(431, "Request Header Fields Too Large", "headers-too-large",
                                                    detail))
        self._linger(HEAD_LINGER_BYTES)
