"""Request bodies read with the configured size limit (Content-Length checked first, then the
bytes actually streamed, so a chunked upload cannot get around it), against the front end's memory
budget (the declared length taken before the first byte is read: service/memory_budget.py), and
at a minimum rate: after a grace period a body must keep arriving at CONVSERVE_MIN_BODY_RATE bytes
a second on average, or its request gets 408 and gives its queue place back. A client trickling
its body, slow-loris style, cannot hold a place for the whole request timeout, which also bounds
every body."""
from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from .request_state import begin_upload, charge_request, end_upload
from .problems import Problem

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
    settings = request.app.state.settings
    # a declared length is read into one buffer of that size: joining chunks would hold the body
    # twice at its end (the chunks and the join), and the memory budget counts it once
    buf = bytearray(charged) if declared is not None else None
    chunks, total = [], 0
    loop = asyncio.get_running_loop()
    start = loop.time()
    timeout_s, rate, grace = settings.request_timeout_s, settings.min_body_rate, settings.min_body_rate_grace_s

    def latest_next_byte() -> float:
        """When the next bytes must have come: the whole-body deadline, or the moment the average
        rate since the start would fall under `rate` (`total` bytes, after the grace)."""
        by_rate = start + grace + total / rate if rate else float("inf")
        return min(start + timeout_s, by_rate)

    upload = begin_upload()
    try:
        async with asyncio.timeout_at(latest_next_byte()) as deadline:
            if upload is not None:
                upload.deadline = deadline
            async for chunk in request.stream():
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
                deadline.reschedule(latest_next_byte())
    except ClientDisconnect:  # the client gave up mid-upload: not a server error
        raise Problem(499, "client-gone", f"the client went away after {total} bytes of its body") from None
    except TimeoutError:
        elapsed = loop.time() - start
        if upload is not None and upload.evicted:
            raise Problem(408, "body-too-slow", f"the body arrived at {total / max(elapsed, 1e-9):.0f} bytes/s, under "
                          f"{rate} bytes/s (CONVSERVE_MIN_BODY_RATE), and the full queue gave its place to a new "
                          "request", headers={"Connection": "close"}) from None
        if elapsed < timeout_s - 1e-3:
            raise Problem(408, "body-too-slow", f"the body arrived at {total / max(elapsed, 1e-9):.0f} bytes/s "
                          f"({total} bytes in {elapsed:.1f}s); the minimum is {rate} bytes/s after "
                          f"{grace:g}s (CONVSERVE_MIN_BODY_RATE)", headers={"Connection": "close"}) from None
        raise Problem(408, "body-timeout", f"the body did not arrive within {timeout_s:g}s "
                      f"({total} bytes received)", headers={"Connection": "close"}) from None
    finally:
        end_upload(upload)
    body = b"".join(chunks) if buf is None else buf if total == len(buf) else buf[:total]
    # Starlette's form parser reads request.stream(), which replays a cached body: cache it
    request._body = body  # noqa: SLF001
    return body
