"""Optional bearer-token auth (CONVSERVE_API_KEY) for everything but health and metrics."""
from __future__ import annotations

import secrets

from fastapi import Request

from .problems import Problem


def require_api_key(request: Request) -> None:
    key = request.app.state.settings.api_key
    if not key:
        return
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not secrets.compare_digest(token.strip().encode(), key.encode()):
        raise Problem(401, "unauthorized", "missing or wrong API key: send 'Authorization: Bearer <key>'",
                      headers={"WWW-Authenticate": 'Bearer realm="convserve"'})
