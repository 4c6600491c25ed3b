"""Optional bearer-token auth (CONVSERVE_API_KEY) for everything but health, metrics, / and the
Swagger UI's static files (SECURITY.md lists them)."""
from __future__ import annotations

import secrets

from fastapi import Request

from ...problems import Problem


async def require_api_key(request: Request) -> None:
    # async on purpose: FastAPI runs a plain `def` dependency on its thread pool, one hop per
    # request, and a burst of requests would start up to 40 pool threads for a header check
    key = request.app.state.settings.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise Problem(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>'",
                      headers={"WWW-Authenticate": 'Bearer realm="convserve"'})
