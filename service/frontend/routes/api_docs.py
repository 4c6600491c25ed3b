"""The API's own documentation: /openapi.json and the Swagger UI page at /docs, and / pointing at them.

/openapi.json and /docs follow CONVSERVE_API_KEY like every other route (the schema lists every
model route and its limits), unless CONVSERVE_PUBLIC_DOCS says they are public. The page's script
and stylesheet are served from the installed `swagger-ui-py` package, not a CDN, so /docs works on
a machine with no internet access; they answer without the key (static files of the Swagger UI,
nothing of this server's). / answers without the key too: where the docs are, and whether they
need the key. (FastAPI's ReDoc page is left out: its script exists only on a CDN.)"""
from __future__ import annotations

import importlib.util
from pathlib import Path

from fastapi import Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import JSONResponse
from starlette.staticfiles import StaticFiles

from ...problems import Problem
from .auth import require_api_key

ASSETS = "/docs/assets"


def swagger_assets() -> Path | None:
    """The Swagger UI files of the installed `swagger-ui-py` (found without importing it: its
    package imports a web-framework adapter layer we do not use)."""
    spec = importlib.util.find_spec("swagger_ui")
    if spec is None or not spec.submodule_search_locations:
        return None
    static = Path(next(iter(spec.submodule_search_locations))) / "static"
    return static if (static / "swagger-ui-bundle.js").is_file() else None


def install(app: FastAPI, public: bool) -> None:
    """Routes for an app made with openapi_url, docs_url and redoc_url None."""
    guard = [] if public else [Depends(require_api_key)]
    assets = swagger_assets()
    if assets is not None:
        app.mount(ASSETS, StaticFiles(directory=assets), name="docs-assets")

    @app.get("/", include_in_schema=False)
    async def root(request: Request):
        # no key asked: it names only where the documentation is and whether the rest needs the
        # key, so a newcomer's first request finds its way instead of a bare 404
        keyed = bool(request.app.state.settings.api_key)
        return {"service": "convserve", "docs": "/docs", "openapi": "/openapi.json", "health": "/healthz",
                "ready": "/readyz", "api_key_required": keyed, "docs_need_api_key": keyed and not public}

    @app.get("/openapi.json", include_in_schema=False, dependencies=guard)
    async def openapi_schema():
        return JSONResponse(app.openapi())

    @app.get("/docs", include_in_schema=False, dependencies=guard)
    async def swagger_page():
        if assets is None:
            raise Problem(404, "docs-unavailable", "the Swagger UI files are not installed "
                          "(pip install swagger-ui-py); /openapi.json has the same schema")
        return get_swagger_ui_html(openapi_url="/openapi.json", title="convserve API",
                                   swagger_js_url=f"{ASSETS}/swagger-ui-bundle.js",
                                   swagger_css_url=f"{ASSETS}/swagger-ui.css",
                                   swagger_favicon_url=f"{ASSETS}/favicon-32x32.png")
