"""Request bodies read with the configured size limit (Content-Length checked first, then the
bytes actually streamed, so a chunked upload cannot get around it) and within the request timeout
(a client trickling its body, slow-loris style, gets 408 instead of holding the request forever)."""
from __future__ import annotations

import asyncio

from fastapi import Request
from starlette.requests import ClientDisconnect

from .problems import Problem


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None:
        try:
            n = int(declared)
        except ValueError:
            raise Problem(400, "bad-content-length", f"Content-Length {declared!r} is not a number") from None
        if n > limit:
            raise Problem(413, "body-too-large", f"body of {n} bytes exceeds the limit of {limit} bytes")
    chunks, total = [], 0
    timeout_s = request.app.state.settings.request_timeout_s
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                total += len(chunk)
                if total > limit:
                    raise Problem(413, "body-too-large", f"body exceeds the limit of {limit} bytes")
                chunks.append(chunk)
    except ClientDisconnect:  # the client gave up mid-upload: not a server error
        raise Problem(499, "client-gone", f"the client went away after {total} bytes of its body") from None
    except TimeoutError:
        raise Problem(408, "body-timeout", f"the body did not arrive within {timeout_s:g}s "
                      f"({total} bytes received)", headers={"Connection": "close"}) from None
    body = b"".join(chunks)
    # Starlette's form parser reads request.stream(), which replays a cached body: cache it
    request._body = body  # noqa: SLF001
    return body
