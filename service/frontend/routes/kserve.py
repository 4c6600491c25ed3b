"""KServe v2 / Triton HTTP adapter (JSON tensors and the binary tensor data extension), over the
same request path as /v1; its tensors are in docs/interfaces.md and `HostedModel.tensors`."""
from __future__ import annotations

import json
import math

import numpy as np
from fastapi import APIRouter, Depends, Request, Response

from ...alpha_option import parse_channels
from ...codecs import bf16_to_f32, load_json, model_pixels, reshape, shape_text
from ...hosted_model import HostedModel
from ...problems import PROBLEM_SCHEMA, Problem
from .. import decode_request, validation
from ..http.bodies import read_body
from ..pipeline import Service
from .adapters import service
from .auth import require_api_key

HEADER_LENGTH = "Inference-Header-Content-Length"
VERSION = "1"

health = APIRouter(prefix="/v2", tags=["kserve-v2"])
router = APIRouter(prefix="/v2", dependencies=[Depends(require_api_key)],
                   responses={401: PROBLEM_SCHEMA}, tags=["kserve-v2"])

_DT = {"FP32": np.dtype("<f4"), "FP16": np.dtype("<f2"), "FP64": np.dtype("<f8"), "UINT8": np.dtype("u1"),
       "BF16": np.dtype("<u2")}
ERRORS = {c: PROBLEM_SCHEMA for c in (400, 401, 404, 409, 413, 415, 422, 429, 503, 504)}


@health.get("/health/live", summary="KServe v2 liveness")
async def live():
    return {"live": True}


@health.get("/health/ready", summary="KServe v2 readiness", responses={503: PROBLEM_SCHEMA})
async def ready(request: Request):
    svc = service(request)
    if not svc.ready or svc.draining:
        raise Problem(503, "not-ready", "shutting down" if svc.draining else "models are loading")
    return {"ready": True}


@router.get("", summary="KServe v2 server metadata")
async def server_metadata():
    from importlib.metadata import PackageNotFoundError, version
    try:
        v = version("convserve")
    except PackageNotFoundError:
        v = "dev"
    return {"name": "convserve", "version": v,
            "extensions": ["binary_tensor_data", "model_configuration", "statistics"]}


def model_metadata_doc(svc: Service, hm: HostedModel) -> dict:
    """The KServe v2 model metadata; the Triton model configuration (triton_extensions) derives from it."""
    inputs, outputs = hm.tensors()
    strip = lambda ts: [{k: t[k] for k in ("name", "datatype", "shape")} for t in ts]  # noqa: E731
    return {"name": hm.name, "versions": [VERSION], "platform": f"convserve_{svc.backend_name}",
            "inputs": strip(inputs), "outputs": strip(outputs),
            # the KServe fields carry no layout or range; the full tensor docs are here
            "convserve": {"kind": hm.kind, "inputs": inputs, "outputs": outputs}}


@router.get("/models/{name}", summary="KServe v2 model metadata", responses=ERRORS)
@router.get("/models/{name}/versions/{version}", include_in_schema=False)
async def model_metadata(name: str, request: Request, version: str | None = None):
    svc = service(request)
    return model_metadata_doc(svc, svc.model(name))


@router.get("/models/{name}/ready", summary="KServe v2 model readiness", responses=ERRORS)
@router.get("/models/{name}/versions/{version}/ready", include_in_schema=False)
async def model_ready(name: str, request: Request, version: str | None = None):
    svc = service(request)
    hm = svc.model(name)
    if not svc.ready or svc.draining:
        raise Problem(503, "not-ready", f"{name} is not accepting requests")
    return {"name": hm.name, "ready": True}


def _tensor(spec: dict, binary: memoryview | None, offset: int) -> tuple[np.ndarray, int]:
    name, dtype_name = spec.get("name"), spec.get("datatype")
    shape = spec.get("shape")
    if dtype_name not in _DT:
        raise Problem(415, "unsupported-dtype", f"input {name!r}: datatype {dtype_name!r} not accepted ({sorted(_DT)})")
    if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
        raise Problem(400, "bad-tensor", f"input {name!r}: shape must be a list of non-negative ints")
    dt = _DT[dtype_name]
    count = math.prod(shape)  # Python ints: a huge declared shape must not overflow int64
    params = spec.get("parameters") or {}
    if not isinstance(params, dict):
        raise Problem(400, "bad-tensor", f"input {name!r}: parameters must be an object")
    size = params.get("binary_data_size")
    if size is not None and (type(size) is not int or size < 0):
        raise Problem(400, "bad-tensor", f"input {name!r}: binary_data_size must be a non-negative int, got {size!r}")
    if size is not None:
        if binary is None or offset + int(size) > len(binary):
            raise Problem(400, "bad-tensor", f"input {name!r}: binary_data_size {size} runs past the body")
        if int(size) != count * dt.itemsize:
            raise Problem(400, "bad-tensor", f"input {name!r}: {size} bytes do not hold {shape_text(shape)} {dtype_name}")
        arr = reshape(np.frombuffer(binary[offset:offset + int(size)], dtype=dt), shape, f"input {name!r}")
        offset += int(size)
    else:
        if "data" not in spec:
            raise Problem(400, "bad-tensor", f"input {name!r} has neither data nor binary_data_size")
        if dtype_name == "BF16":
            raise Problem(415, "unsupported-dtype", "BF16 inputs need the binary tensor extension")
        try:
            arr = np.asarray(spec["data"], dtype=dt).reshape(shape)
        except RecursionError:  # data nested deeper than numpy walks
            raise Problem(400, "bad-tensor", f"input {name!r}: data is nested too deeply") from None
        except (ValueError, TypeError, OverflowError) as exc:
            raise Problem(400, "bad-tensor", f"input {name!r}: data does not fit shape {shape_text(shape)} ({exc})") from exc
    if dtype_name == "BF16":
        arr = bf16_to_f32(arr)
    return arr, offset


def _parse(body: bytes, header_len: str | None) -> tuple[dict, dict[str, np.ndarray]]:
    if header_len is not None:
        try:
            n = int(header_len)
        except ValueError:
            raise Problem(400, "bad-request", f"{HEADER_LENGTH} {header_len!r} is not a number") from None
        if not 0 <= n <= len(body):
            raise Problem(400, "bad-request", f"{HEADER_LENGTH} {n} exceeds the body ({len(body)} bytes)")
        head, binary = body[:n], memoryview(body)[n:]
    else:
        head, binary = body, None
    doc = load_json(head, "inference header")
    if not isinstance(doc, dict) or not isinstance(doc.get("inputs"), list) or not doc["inputs"]:
        raise Problem(400, "bad-request", "inference request needs a non-empty 'inputs' list")
    _check_options(doc)
    tensors, offset = {}, 0
    for spec in doc["inputs"]:
        if not isinstance(spec, dict):
            raise Problem(400, "bad-request", "each input must be an object")
        arr, offset = _tensor(spec, binary, offset)
        tensors[str(spec.get("name"))] = arr
    return doc, tensors


def _check_options(doc: dict) -> None:
    """The request's optional parts have the types the response code reads (before any work)."""
    if not isinstance(doc.get("parameters") or {}, dict):
        raise Problem(400, "bad-request", "'parameters' must be an object")
    outputs = doc.get("outputs") or []
    if not isinstance(outputs, list) or not all(
            isinstance(o, dict) and isinstance(o.get("name"), str) and isinstance(o.get("parameters") or {}, dict)
            for o in outputs):
        raise Problem(400, "bad-request", "'outputs' must be a list of {name: string, parameters?: object}")


def _only_input(tensors: dict, want: str) -> np.ndarray:
    if want not in tensors:
        raise Problem(400, "bad-input-name", f"expected an input named {want!r}, got {sorted(tensors)}")
    return tensors[want]


_TENSOR = {"type": "object", "required": ["name", "datatype", "shape"], "properties": {
    "name": {"type": "string"}, "datatype": {"type": "string", "enum": sorted(_DT)},
    "shape": {"type": "array", "items": {"type": "integer", "minimum": 0}},
    "data": {"type": "array", "items": {"type": "number"}},
    "parameters": {"type": "object", "properties": {"binary_data_size": {"type": "integer", "minimum": 0}}}}}
#: the KServe v2 inference request (documented so clients and schema fuzzers know the body)
INFER_BODY = {"requestBody": {"required": True, "content": {
    "application/json": {"schema": {"type": "object", "required": ["inputs"], "properties": {
        "id": {"type": "string"}, "inputs": {"type": "array", "minItems": 1, "items": _TENSOR},
        "outputs": {"type": "array", "items": {"type": "object", "required": ["name"], "properties": {
            "name": {"type": "string"}, "parameters": {"type": "object", "properties": {
                "binary_data": {"type": "boolean"}}}}}},
        "parameters": {"type": "object", "properties": {
            "binary_data_output": {"type": "boolean"},
            "shards": {"description": "decoders: 1, N or 'auto' (service/frontend/decode_request.py)",
                       "oneOf": [{"type": "integer", "minimum": 1}, {"type": "string", "enum": ["auto"]}]},
            "channels": {"description": "decoders: rgba or rgb pixels; default: the model's own (RGBA for a "
                                        "decoder with alpha)", "type": "string", "enum": ["rgba", "rgb"]}}}}}},
    "application/octet-stream": {"schema": {"type": "string", "format": "binary"},
                                 "description": f"binary tensor extension: JSON header ({HEADER_LENGTH} bytes) "
                                                "then the tensors' raw bytes"}}}}


@router.post("/models/{name}/infer", summary="KServe v2 inference (JSON or binary tensor data)",
             responses={**ERRORS, 200: {"description": "inference response; binary outputs follow the JSON "
                                        f"header, whose length is in the {HEADER_LENGTH} response header"}},
             openapi_extra=INFER_BODY)
@router.post("/models/{name}/versions/{version}/infer", include_in_schema=False)
async def infer(name: str, request: Request, version: str | None = None):
    svc = service(request)
    async with svc.admit(name, "infer") as hm:
        body = await read_body(request, svc.settings.max_body_bytes)
        doc, tensors = await svc.in_pool(_parse, body, request.headers.get(HEADER_LENGTH))
        if hm.is_decoder:
            params = doc.get("parameters") or {}
            shards = decode_request.parse_shards(params.get("shards"))
            req = await decode_request.build(svc, hm, _only_input(tensors, "latents"), format="tensor", shards=shards,
                                             channels=parse_channels(params.get("channels")))
            out = await svc.decode(req, disconnected=request.is_disconnected)
            results = {hm.output_name: out}
        else:
            px = await svc.in_pool(validation.source_pixels, _only_input(tensors, "pixels"), svc.settings)
            size = int(hm.model.input_size)
            if px.shape[1:3] != (size, size):  # uint8 at the model's size travels as it is
                px = await svc.in_pool(model_pixels, list(px), size)
            enc = await svc.encode(hm, px, disconnected=request.is_disconnected)
            results = {k: v for k, v in (("embedding", enc["embedding"]), ("logits", enc.get("logits")))
                       if v is not None}
        payload = await svc.in_pool(_response, name, doc, results)
    return payload


def _response(name: str, doc: dict, results: dict[str, np.ndarray]) -> Response:
    wanted = doc.get("outputs")
    default_binary = bool((doc.get("parameters") or {}).get("binary_data_output", False))
    if wanted:
        picks = []
        for o in wanted:
            oname = o.get("name")
            if oname not in results:
                raise Problem(400, "bad-output-name", f"no output named {oname!r}; this model gives {sorted(results)}")
            picks.append((oname, bool((o.get("parameters") or {}).get("binary_data", default_binary))))
    else:
        picks = [(k, default_binary) for k in results]
    outputs, blobs = [], []
    for oname, binary in picks:
        arr = np.ascontiguousarray(results[oname], dtype="<f4")
        entry = {"name": oname, "datatype": "FP32", "shape": list(arr.shape)}
        if binary:
            raw = arr.tobytes()
            entry["parameters"] = {"binary_data_size": len(raw)}
            blobs.append(raw)
        else:
            entry["data"] = arr.ravel().tolist()
        outputs.append(entry)
    head = {"model_name": name, "model_version": VERSION, "outputs": outputs}
    if "id" in doc:
        head["id"] = doc["id"]
    head_bytes = json.dumps(head).encode()
    if not blobs:
        return Response(head_bytes, media_type="application/json")
    return Response(b"".join([head_bytes, *blobs]), media_type="application/octet-stream",
                    headers={HEADER_LENGTH: str(len(head_bytes))})
