"""Request bodies read with the configured size limit (Content-Length checked first, then the
bytes actually streamed, so a chunked upload cannot get around it), against the front end's memory
budget (the declared length taken before the first byte is read: service/frontend/memory_budget.py), and
on a clock of the server's waiting (service/frontend/http/body_wait.py): the time it waited on receives with
none of the client's bytes at the server. After a grace period of such waiting a body must keep
arriving at CONVSERVE_MIN_BODY_RATE bytes per second waited, and in all the server waits at most
the request timeout for it, or its request gets 408 and gives its queue place back. A client
trickling its body, slow-loris style, cannot hold a place for long; a client sending as fast as
the server reads is never the slow one, however busy the server is."""
from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from ...problems import Problem
from ..request_state import begin_upload, charge_request, end_upload
from .body_wait import BodyWait, arrivals_of

#: chunked bodies are taken from the memory budget in steps of this many bytes as they arrive
CHARGE_STEP = 1 << 20


async def read_body(request: Request, limit: int) -> bytes | bytearray:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise Problem(400, "bad-content-length", f"Content-Length {declared!r} is not a number") from None
        if n > limit:
            raise Problem(413, "body-too-large", f"body of {n} bytes exceeds the limit of {limit} bytes")
        charge_request(n, "the request body")
        charged = n
    else:
        charged = 0
    arrivals = arrivals_of(request.scope)
    if declared is not None and arrivals is not None and arrivals.complete():
        return await _read_arrived(request, n)
    settings = request.app.state.settings
    # a declared length is read into one buffer of that size: joining chunks would hold the body
    # twice at its end (the chunks and the join), and the memory budget counts it once
    buf = bytearray(charged) if declared is not None else None
    chunks, total = [], 0
    timeout_s, rate, grace = settings.request_timeout_s, settings.min_body_rate, settings.min_body_rate_grace_s
    wait = BodyWait(arrivals, asyncio.get_running_loop().time)

    def allowance() -> float:
        """Seconds of waiting the body may have used by now: the request timeout, or the grace
        plus the time `total` bytes take at the minimum rate, whichever is less."""
        return min(timeout_s, grace + total / rate) if rate else timeout_s

    upload = begin_upload(wait)
    receive = request.receive
    more = True
    try:
        while more:
            when = wait.begin(allowance())
            try:
                async with asyncio.timeout_at(when) as deadline:
                    if upload is not None:
                        upload.deadline = deadline  # eviction ends the read through it
                    message = await receive()
            except TimeoutError:
                wait.end()
                if upload is not None and upload.evicted:
                    raise _evicted(wait, total, rate) from None
                if wait.at_server():  # the bytes came while the server was late: no verdict, read them
                    continue
                raise _too_slow(wait, total, rate, grace, timeout_s, allowance()) from None
            finally:
                if upload is not None:
                    upload.deadline = None
            wait.end()
            if upload is not None and upload.evicted:  # evicted between two receives
                raise _evicted(wait, total, rate)
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            more = message.get("more_body", False)
            chunk = message.get("body", b"")
            if not chunk:
                continue
            total += len(chunk)
            if upload is not None:
                upload.received = total
            if total > limit:
                raise Problem(413, "body-too-large", f"body exceeds the limit of {limit} bytes")
            if total > charged:  # chunked: taken as it arrives
                step = max(CHARGE_STEP, total - charged)
                charge_request(step, "the request body")
                charged += step
            if buf is not None:
                buf[total - len(chunk):total] = chunk
            else:
                chunks.append(chunk)
    except ClientDisconnect:  # the client gave up mid-upload: not a server error
        raise Problem(499, "client-gone", f"the client went away after {total} bytes of its body") from None
    finally:
        end_upload(upload)
    body = b"".join(chunks) if buf is None else buf if total == len(buf) else buf[:total]
    # Starlette's form parser reads request.stream(), which replays a cached body: cache it
    request._body = body  # noqa: SLF001
    return body


async def _read_arrived(request: Request, declared: int) -> bytes:
    """A body whose every byte is already at the server (the common case of a small request): one
    receive hands it over whole, with nothing of the client's to wait for, so none of the slow-body
    clock, deadline or eviction bookkeeping below applies. That bookkeeping cost about a tenth of
    a front end's CPU per one-image request. The protocol framed it by its Content-Length, so it
    has exactly `declared` bytes."""
    message = await request.receive()
    if message["type"] == "http.disconnect":
        raise Problem(499, "client-gone", "the client went away before its body was read")
    body = message.get("body", b"")
    if message.get("more_body", False) or len(body) != declared:  # never, by the protocol's framing
        raise Problem(400, "bad-body", f"the body held {len(body)} bytes, not the {declared} of its Content-Length")
    request._body = body  # noqa: SLF001 (Starlette's form parser replays a cached body)
    return body


def _evicted(wait: BodyWait, total: int, rate: int) -> Problem:
    return Problem(408, "body-too-slow", f"the body arrived at {total / max(wait.waited, 1e-9):.0f} bytes per second "
                   f"the server waited for it, under {rate} bytes/s (CONVSERVE_MIN_BODY_RATE), and the full queue "
                   "gave its place to a new request", headers={"Connection": "close"})


def _too_slow(wait: BodyWait, total: int, rate: int, grace: float, timeout_s: float, allowed: float) -> Problem:
    if allowed < timeout_s:
        return Problem(408, "body-too-slow", f"the server waited {wait.waited:.1f}s for {total} bytes of the body "
                       f"({total / max(wait.waited, 1e-9):.0f} bytes/s); the minimum is {rate} bytes/s after "
                       f"{grace:g}s (CONVSERVE_MIN_BODY_RATE)", headers={"Connection": "close"})
    return Problem(408, "body-timeout", f"the server waited {timeout_s:g}s in all for the body's bytes "
                   f"({total} bytes received; CONVSERVE_REQUEST_TIMEOUT_S)", headers={"Connection": "close"})
