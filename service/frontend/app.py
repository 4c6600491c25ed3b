"""App factory: settings -> one HTTP front end's FastAPI app with the v1 and KServe v2 adapters,
health and metrics. The lifespan connects to the model workers (readyz turns true once they have
loaded and warmed up their models) and lets go of them at the end."""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request, Response
from fastapi.responses import JSONResponse

from .. import gc_pauses, metrics, problems
from ..settings import Settings
from .codec_warmup import warm_video_encoder
from .http.http_protocol import CloseWhenBodyUnread, http_protocol_class
from .pipeline import Service
from .routes import api_docs, hot_routes, kserve, remote_vae, routes_v1, streaming, triton_extensions

log = logging.getLogger("convserve")

DESCRIPTION = """Decode diffusion latents to images and video, encode images to embeddings.

Errors are RFC 7807 `application/problem+json` (type, title, status, detail). With
`CONVSERVE_API_KEY` set, every route except `/`, `/healthz`, `/readyz`, `/metrics`,
`/v2/health/*` and this page's static files needs `Authorization: Bearer <key>` (this page and
`/openapi.json` too, unless `CONVSERVE_PUBLIC_DOCS=true`). A full queue answers 429 with
`Retry-After`; a draining server answers 503."""


def create_app(settings: Settings | None = None, endpoints: list[tuple[str, str]] = (),
               *, accept_once_ready: bool = False) -> FastAPI:
    """endpoints: (device, Unix socket) of each model worker (service/supervisor.py).
    accept_once_ready: a further front end takes no connection off the shared socket until it
    can serve (or knows why it cannot): the supervisor's /readyz speaks for every front end, so a
    request after it turned true must not land on a front end still linking to the workers."""
    settings = settings or Settings()
    protocol = http_protocol_class(settings.http)
    protocol.header_timeout_s, protocol.write_timeout_s = settings.header_timeout_s, settings.write_timeout_s
    protocol.max_head_bytes, protocol.max_headers = settings.max_header_bytes, settings.max_headers
    svc = Service(settings, endpoints)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        svc.start()
        warming = asyncio.ensure_future(warm_video_encoder(svc))
        if accept_once_ready:  # the encoder too, before this front end takes a connection
            await warming
        gc_pauses.watch("frontend")
        gc_pauses.freeze_startup_heap("frontend", settings.gc_freeze)  # the app is built: its objects are for good
        try:
            yield
        finally:
            warming.cancel()
            svc.stop()
            metrics.worker_exiting()

    app = FastAPI(title="convserve", version="0.1.0", description=DESCRIPTION, lifespan=lifespan,
                  openapi_url=None, docs_url=None, redoc_url=None)  # api_docs serves them, behind the key
    app.state.settings = settings
    app.state.service = svc
    problems.install(app)
    api_docs.install(app, public=settings.public_docs)
    app.add_middleware(CloseWhenBodyUnread)

    @app.get("/healthz", tags=["ops"], summary="Liveness: the process serves HTTP")
    async def healthz():
        return {"status": "ok"}

    @app.get("/readyz", tags=["ops"], summary="Readiness: models loaded and warmed up, not draining",
             responses={503: problems.PROBLEM_SCHEMA})
    async def readyz(request: Request):
        if svc.draining:
            raise problems.Problem(503, "shutting-down", "draining for shutdown")
        if not svc.ready:
            kind, detail = ("not-ready", f"model loading failed: {svc.load_error}") if svc.load_error \
                else svc.engine.unready()  # loading, or a worker unresponsive (service/ipc/heartbeat.py)
            raise problems.Problem(503, kind, detail, headers={"Retry-After": "2"})
        return JSONResponse({"status": "ready", "models": list(svc.models), "unavailable": svc.failed})

    @app.get("/metrics", tags=["ops"], summary="Prometheus metrics: service and kernel registries",
             response_class=Response)
    async def prometheus_metrics():
        return Response(metrics.exposition(), media_type="text/plain; version=0.0.4; charset=utf-8")

    app.include_router(routes_v1.router)
    app.include_router(streaming.router)
    app.include_router(kserve.health)
    app.include_router(triton_extensions.router)  # before kserve's: /v2/models/stats is not a model name
    app.include_router(kserve.router)
    app.include_router(remote_vae.router)
    hot_routes.install(app)  # one-image encode requests past the router's matching and parameter solving
    return app
