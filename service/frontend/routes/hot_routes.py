"""The one-image encode request's way past FastAPI's route matching and parameter solving.

Why: an embedding service mostly gets one image a request, and for those the framework's share
of a front end's CPU was large. cProfile of a front end under one-image `.npy` encode load
(2026-11-29, benchmarks/HISTORY.md "front-end CPU per request"): matching the path against every
route was 9 % of its CPU and solving the route's parameters (the API-key dependency, the path
and two query parameters, each through pydantic) 19 %.

Rules:
- Only `POST /v1/models/{name}/encode` is taken, and only when its query is one this module
  reads exactly as FastAPI would: `format` json or npy and `top_k` a plain integer in 1..1000,
  each at most once (other keys are ignored, as FastAPI ignores them). The body must not be a
  multipart form (the router applies its form limits to those).
- Every other request, and every request this module does not read exactly, takes FastAPI's way:
  a refusal of a parameter (a 422) is always FastAPI's own.
- What is taken runs what FastAPI would run, in its order: the API key check, then the route's
  own function (routes_v1.encode), whose response is sent as FastAPI sends it. It runs inside every
  middleware and exception handler of the app: it replaces only the router's dispatch.
"""
from __future__ import annotations

import re
from urllib.parse import parse_qsl

from fastapi import Request

from . import routes_v1
from .auth import require_api_key

ENCODE_PATH = re.compile(r"/v1/models/([^/]+)/encode")
_TOP_K = re.compile(r"[1-9][0-9]{0,3}")
_FORMATS = ("json", "npy")


def encode_query(query_string: bytes) -> tuple[str, int | None] | None:
    """(format, top_k) of an encode request's query, or None where FastAPI must read it."""
    fmt, top_k, seen = "json", None, set()
    try:
        pairs = parse_qsl(query_string.decode("latin-1"), keep_blank_values=True)
    except ValueError:
        return None
    for key, value in pairs:
        if key not in ("format", "top_k"):
            continue
        if key in seen:
            return None
        seen.add(key)
        if key == "format":
            if value not in _FORMATS:
                return None
            fmt = value
        else:
            if not _TOP_K.fullmatch(value) or int(value) > 1000:
                return None
            top_k = int(value)
    return fmt, top_k


def _multipart(scope) -> bool:
    for name, value in scope["headers"]:
        if name == b"content-type":
            return value[:19].lower() == b"multipart/form-data"
    return False


class HotRoutes:
    """Wraps the router's dispatch (`app.router.middleware_stack`)."""

    def __init__(self, app, router):
        self.app, self.router = app, router

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["method"] == "POST":
            match = ENCODE_PATH.fullmatch(scope["path"])
            if match is not None and not _multipart(scope):
                query = encode_query(scope.get("query_string", b""))
                if query is not None:
                    await self._encode(scope, receive, send, match.group(1), *query)
                    return
        await self.app(scope, receive, send)

    async def _encode(self, scope, receive, send, name: str, fmt: str, top_k: int | None) -> None:
        scope.setdefault("router", self.router)
        scope["path_params"] = {"name": name}
        request = Request(scope, receive, send)
        await require_api_key(request)
        response = await routes_v1.encode(name, request, fmt, top_k)
        await response(scope, receive, send)


def install(app) -> None:
    """The shortcut in front of the app's router (after every route is included)."""
    router = app.router
    router.middleware_stack = HotRoutes(router.middleware_stack, router)
