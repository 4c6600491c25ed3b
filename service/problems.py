"""RFC 7807 problem details: every 4xx/5xx the service answers is application/problem+json."""
from __future__ import annotations

import logging
import uuid

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

#: `type` is a relative reference to the problem's entry in the API documentation (docs/api.md,
#: "Problem types": one anchor per kind). The project has no web site to point at, and a made-up
#: address would send readers nowhere; clients match the stable kind after the "#".
PROBLEM_TYPE_BASE = "docs/api.md#"
#: kinds of the framework's own HTTP errors (no such route, wrong method); any other is http-error
HTTP_KINDS = {404: "not-found", 405: "method-not-allowed"}

TITLES = {
    400: "Bad Request", 401: "Unauthorized", 404: "Not Found", 405: "Method Not Allowed",
    406: "Not Acceptable", 408: "Request Timeout", 409: "Conflict", 413: "Content Too Large",
    415: "Unsupported Media Type", 422: "Unprocessable Content", 429: "Too Many Requests",
    431: "Request Header Fields Too Large",
    499: "Client Closed Request", 500: "Internal Server Error", 501: "Not Implemented",
    503: "Service Unavailable", 504: "Gateway Timeout",
}


class Problem(Exception):
    """An error answered as problem+json. `kind` is the `type` reference's fragment and the
    stable machine-readable name (e.g. 'non-finite-latents', 'queue-full')."""

    def __init__(self, status: int, kind: str, detail: str, *, headers: dict | None = None,
                 title: str | None = None, **extra):
        super().__init__(detail)
        self.status = status
        self.kind = kind
        self.detail = detail
        self.title = title or TITLES.get(status, "Error")
        self.headers = headers or {}
        self.extra = extra

    def body(self) -> dict:
        # "error" duplicates detail so KServe/Triton clients, which read that key, show the reason
        return {"type": PROBLEM_TYPE_BASE + self.kind, "title": self.title, "status": self.status,
                "detail": self.detail, "error": self.detail, **self.extra}


def problem_response(p: Problem) -> JSONResponse:
    return JSONResponse(p.body(), status_code=p.status, headers=p.headers,
                        media_type="application/problem+json")


async def _problem_handler(request: Request, exc: Problem):
    return problem_response(exc)


async def _http_handler(request: Request, exc: StarletteHTTPException):
    kind = HTTP_KINDS.get(exc.status_code, "http-error")
    return problem_response(Problem(exc.status_code, kind, str(exc.detail),
                                    headers=getattr(exc, "headers", None)))


async def _validation_handler(request: Request, exc: RequestValidationError):
    parts = [f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg')}" for err in exc.errors()]
    return problem_response(Problem(422, "invalid-parameters", "; ".join(parts) or "invalid request"))


async def _unexpected_handler(request: Request, exc: Exception):
    # a bug, not a bad request: still problem+json, with an id that finds the traceback in the log
    error_id = uuid.uuid4().hex[:16]
    logging.getLogger("convserve").error("unhandled %s on %s %s (error id %s)", exc.__class__.__name__,
                                         request.method, request.url.path, error_id, exc_info=exc)
    return problem_response(Problem(500, "internal-error", f"internal error (error id {error_id}; "
                                    "the server log has the traceback)", error_id=error_id))


def install(app) -> None:
    app.add_exception_handler(Problem, _problem_handler)
    app.add_exception_handler(StarletteHTTPException, _http_handler)
    app.add_exception_handler(RequestValidationError, _validation_handler)
    app.add_exception_handler(Exception, _unexpected_handler)


#: OpenAPI description of the error body, attached to routes' `responses`
PROBLEM_SCHEMA = {
    "description": "Problem details (RFC 7807)",
    "content": {"application/problem+json": {"schema": {
        "type": "object",
        "properties": {"type": {"type": "string", "description": "docs/api.md#<kind>: the kind's entry in the "
                                "API documentation; the kind after '#' is the stable name to match"},
                       "title": {"type": "string"},
                       "status": {"type": "integer"}, "detail": {"type": "string"},
                       "error": {"type": "string"}}}}},
}
