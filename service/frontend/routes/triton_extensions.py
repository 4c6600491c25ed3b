"""Triton's HTTP protocol extensions beyond KServe v2 inference, so Triton's own tools
(perf_analyzer, tritonclient) work against convserve unchanged:

- model configuration: `GET /v2/models/{name}/config`, the model's config in Triton's JSON form,
  derived from the KServe metadata (`kserve.model_metadata_doc`) and the batcher settings;
- statistics: `GET /v2/models/stats`, `GET /v2/models/{name}/stats` (`service.model_stats`);
- model repository, read side: `POST /v2/repository/index`. Models are fixed at start-up
  (CONVSERVE_MODELS), so load and unload answer 405.

The router must be included before kserve's: `/v2/models/stats` would otherwise match
`/v2/models/{name}`."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request

from ...codecs import load_json
from ...hosted_model import HostedModel
from ...ipc.batch_sizes import batch_sizes
from ...problems import PROBLEM_SCHEMA, Problem
from ..http.bodies import read_body
from ..pipeline import Service
from .auth import require_api_key
from .kserve import ERRORS, VERSION, model_metadata_doc, service

router = APIRouter(prefix="/v2", dependencies=[Depends(require_api_key)],
                   responses={401: PROBLEM_SCHEMA}, tags=["triton-extensions"])


def _versioned_model(request: Request, name: str, version: str | None) -> tuple[Service, HostedModel]:
    svc = service(request)
    hm = svc.model(name)
    if version is not None and version != VERSION:
        raise Problem(404, "unknown-model-version", f"{name} has only version {VERSION}, not {version!r}")
    return svc, hm


def model_config(svc: Service, hm: HostedModel) -> dict:
    """Triton's ModelConfig (JSON) for one model: tensors from the KServe metadata, batching from
    the settings the batcher runs with."""
    meta = model_metadata_doc(svc, hm)
    s = svc.settings
    # with max_batch_size > 0 Triton's config dims leave out the batch axis that metadata shows
    gpu = svc.backend_name == "cuda"
    devices = svc.engine.devices(hm.name)
    return {
        "name": hm.name,
        "platform": meta["platform"],
        "backend": "convserve",
        "version_policy": {"latest": {"num_versions": 1}},
        "max_batch_size": s.max_batch,
        "input": [{"name": t["name"], "data_type": f"TYPE_{t['datatype']}", "format": "FORMAT_NONE",
                   "dims": t["shape"][1:], "is_shape_tensor": False,
                   "allow_ragged_batch": False, "optional": False} for t in meta["inputs"]],
        "output": [{"name": t["name"], "data_type": f"TYPE_{t['datatype']}",
                    "dims": t["shape"][1:], "label_filename": "", "is_shape_tensor": False}
                   for t in meta["outputs"]],
        "dynamic_batching": {
            "preferred_batch_size": batch_sizes(s.max_batch),
            "max_queue_delay_microseconds": int(round(s.max_queue_delay_ms * 1000)),
            "preserve_ordering": False,
            # one queue serves every model of the device, so this bound is shared between them
            "default_queue_policy": {"timeout_action": "REJECT", "allow_timeout_override": False,
                                     "default_timeout_microseconds": int(round(s.request_timeout_s * 1e6)),
                                     "max_queue_size": s.max_queue},
        },
        # one instance per device: a model worker each (its GPU ordinal as the server numbers them)
        "instance_group": [{"name": f"{hm.name}_{i}", "kind": "KIND_GPU" if gpu else "KIND_CPU", "count": 1,
                            "gpus": [int(d["device"].split(":")[1])] if gpu else []}
                           for i, d in enumerate(devices)],
        "parameters": {"kind": {"string_value": hm.kind}, "preset": {"string_value": hm.entry.preset}},
    }


async def _stats(svc: Service, names) -> list[dict]:
    """This front end's request counts with every model worker's batch counts."""
    workers = [records for _, records in await svc.engine.query("stats")]
    return [svc.stats.snapshot(name, VERSION, also=[r[name] for r in workers if name in r]) for name in names]


@router.get("/models/stats", summary="Triton statistics extension: every model")
async def all_model_stats(request: Request):
    svc = service(request)
    return {"model_stats": await _stats(svc, list(svc.models))}


@router.get("/models/{name}/stats", summary="Triton statistics extension: one model", responses=ERRORS)
@router.get("/models/{name}/versions/{version}/stats", include_in_schema=False)
async def model_stats(name: str, request: Request, version: str | None = None):
    svc, hm = _versioned_model(request, name, version)
    return {"model_stats": await _stats(svc, [hm.name])}


@router.get("/models/{name}/config", summary="Triton model configuration extension", responses=ERRORS)
@router.get("/models/{name}/versions/{version}/config", include_in_schema=False)
async def config(name: str, request: Request, version: str | None = None):
    svc, hm = _versioned_model(request, name, version)
    return model_config(svc, hm)


def _index_entries(svc: Service) -> list[dict]:
    """Every configured model with Triton's state: READY once loaded and warmed up, UNAVAILABLE
    with the reason when its load failed, LOADING before that."""
    out = []
    for entry in svc.settings.model_entries():
        doc = {"name": entry.name, "version": VERSION}
        if entry.name in svc.models:
            doc.update(state="READY", reason="")
        elif entry.name in svc.failed or svc.load_error:
            doc.update(state="UNAVAILABLE", reason=svc.failed.get(entry.name) or svc.load_error)
        else:
            doc.update(state="LOADING", reason="")
        out.append(doc)
    return out


def _ready_only(body: bytes) -> bool:
    if not body.strip():
        return False
    doc = load_json(body, "repository index request")
    if not isinstance(doc, dict):
        raise Problem(400, "bad-request", "repository index request must be a JSON object")
    ready = doc.get("ready", False)
    if not isinstance(ready, bool):
        raise Problem(400, "bad-request", f"'ready' must be true or false, got {ready!r}")
    return ready


INDEX_BODY = {"requestBody": {"required": False, "content": {"application/json": {"schema": {
    "type": "object", "properties": {"ready": {"type": "boolean"}}}}}}}
_SMALL_BODY = 64 * 1024  # {"ready": true}; more is not a repository request


@router.post("/repository/index", summary="Triton model repository extension: list models and their state",
             responses={400: PROBLEM_SCHEMA, 413: PROBLEM_SCHEMA}, openapi_extra=INDEX_BODY)
async def repository_index(request: Request):
    svc = service(request)
    ready_only = _ready_only(await read_body(request, _SMALL_BODY))
    entries = _index_entries(svc)
    return [e for e in entries if e["state"] == "READY"] if ready_only else entries


@router.post("/repository/models/{name}/load", summary="Triton model repository extension: load (not offered)",
             responses={405: PROBLEM_SCHEMA}, status_code=405)
@router.post("/repository/models/{name}/unload", include_in_schema=False)
async def repository_load(name: str, request: Request):
    # 405 with an empty Allow (RFC 9110: the resource allows no method), not 501: the refusal is a
    # property of this deployment, not a server fault, and the service answers no 5xx to a request
    action = request.url.path.rsplit("/", 1)[-1]
    raise Problem(405, "repository-changes-unsupported",
                  f"cannot {action} {name!r}: convserve serves the models named by CONVSERVE_MODELS at "
                  "start-up; restart with a different CONVSERVE_MODELS to change them", headers={"Allow": ""})
