"""The /v1 REST adapter: wire formats <-> tensors around Service.decode / Service.encode."""
from __future__ import annotations

import sys
import time
from contextlib import asynccontextmanager
from typing import Literal

import msgspec
import numpy as np
from fastapi import APIRouter, Depends, Query, Request, Response

from ... import codecs, metrics
from ...codecs.jpeg_header import device_decodable_size
from ...codecs.video import encode_videos, require_av
from ...hosted_model import HostedModel
from ...problems import PROBLEM_SCHEMA, Problem
from .. import decode_request, validation
from ..http.bodies import read_body
from ..pipeline import Service
from .adapters import ERRORS, TENSOR_BODY, service
from .arena_response import ArenaResponse
from .auth import require_api_key
from .streaming import whole_clip_response

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)],
                   responses={401: PROBLEM_SCHEMA}, tags=["v1"])

IMAGE_BODY = {"requestBody": {"required": True, "content": {
    "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
    "image/png": {"schema": {"type": "string", "format": "binary"}},
    "image/webp": {"schema": {"type": "string", "format": "binary"}},
    "multipart/form-data": {"schema": {"type": "object", "properties": {
        "files": {"type": "array", "items": {"type": "string", "format": "binary"}}}},
        "description": "several images: every file part, in order, whatever its field name"},
    codecs.NPY_MEDIA: {"schema": {"type": "string", "format": "binary"},
                       "description": "pixels N,H,W,3 (or H,W,3): uint8 0..255 or float in [0,1]"},
}}}


@router.get("/models", summary="Model cards of every served model")
async def list_models(request: Request):
    svc = service(request)
    return {"ready": svc.ready, "models": [svc.card(hm) for hm in svc.models.values()],
            "unavailable": svc.failed, "devices": svc.engine.devices()}


@router.get("/models/{name}", summary="One model's card", responses={404: PROBLEM_SCHEMA})
async def model_card(name: str, request: Request):
    svc = service(request)
    return svc.card(svc.model(name))


@router.get("/kernels", summary="Conv path choices and plan cache statistics of each device's backend",
            description="The first device's `backend`, `conv_choices` and `plan_cache` at the top level; "
                        "every device's under `devices`.")
async def kernels(request: Request):
    per_device = [doc for _, doc in await service(request).engine.query("kernels") if doc is not None]
    if not per_device:
        raise Problem(503, "not-ready", "no model worker has a backend yet", headers={"Retry-After": "2"})
    first = per_device[0]
    return {"backend": first["backend"], "conv_choices": first["conv_choices"], "plan_cache": first["plan_cache"],
            "devices": per_device}


DecodeFormat = Literal["png", "jpeg", "webp", "npy", "mp4"]


@asynccontextmanager
async def _continue(tracking):
    """The rest of a request whose Service.admit was entered by hand: exits it as `async with`
    would have."""
    try:
        yield
    except BaseException:
        await tracking.__aexit__(*sys.exc_info())
        raise
    await tracking.__aexit__(None, None, None)


def _decode_format(hm: HostedModel, fmt: str | None) -> str:
    if not hm.is_video:
        fmt = fmt or "png"
        if fmt == "mp4":
            raise Problem(422, "bad-format", "mp4 is for video decoders; image decoders give png, jpeg, webp or npy")
    else:
        fmt = fmt or "mp4"
        if fmt not in ("mp4", "npy"):
            raise Problem(422, "bad-format", f"video decoders give mp4 or npy frames, not {fmt}")
        if fmt == "mp4":
            require_av()
    return fmt


@router.post(
    "/models/{name}/decode", summary="Decode latents to images or video",
    description=(
        "Latents as the diffusion pipeline hands them (scaled): N,C,H,W for image decoders, "
        "N,C,T,H,W for video decoders (a missing N means 1), sent as .npy, safetensors or JSON+base64.\n\n"
        "Image decoders answer png (default), jpeg or webp: one latent gives the image bytes, several give "
        "`application/zip` with `image_000.<ext>`, `image_001.<ext>`... in batch order. `npy` gives float32 "
        "N,H,W,3 in [0,1]. A decoder with alpha (card `pixel_channels`: the Qwen-Image 2.1 VAE) answers RGBA, "
        "N,H,W,4, RGBA PNG/WebP (JPEG: RGB, it holds no alpha), unless `channels=rgb`.\n\n"
        "Video decoders answer mp4 (H.264, default; several videos: a zip of `video_000.mp4`...) or `npy` "
        "frames float32 N,F,H,W,3 in [0,1], F = 1 + 4*(T-1).\n\n"
        "`X-Output-Shape` gives the decoded array shape."),
    responses={**ERRORS, 200: {"description": "image, zip, mp4 or npy", "content": {
        "image/png": {}, "image/jpeg": {}, "image/webp": {}, "application/zip": {}, "video/mp4": {},
        codecs.NPY_MEDIA: {}}}},
    response_class=Response, openapi_extra=TENSOR_BODY)
async def decode(name: str, request: Request,
                 format: DecodeFormat | None = Query(None, description="png|jpeg|webp|npy (images), mp4|npy (video)"),
                 quality: int = Query(90, ge=1, le=100, description="JPEG/WebP quality; MP4 quality (CRF 51..0)"),
                 tiled: Literal["on", "off", "auto"] = Query("auto", description="tiled decode (bounded memory); auto = the model's rule"),
                 fps: float = Query(16.0, gt=0, le=240, description="MP4 frame rate"),
                 dtype: Literal["float32", "float16", "uint8"] = Query(
                     "float32", description="npy: the pixels' type (uint8: 0..255, rounded on the device)"),
                 shards: str = Query("1", description="devices that decode it together, untiled and exact: 1, N "
                                     "(the first N devices) or auto (only where measured to pay); "
                                     "SD/SDXL/FLUX.1 image VAEs and Wan 2.1"),
                 channels: Literal["rgba", "rgb"] | None = Query(
                     None, description="rgba (alpha last) or rgb; default: the model's own, RGBA for a decoder "
                                       "with alpha except as JPEG")):
    started = time.perf_counter()
    svc = service(request)
    tracking = svc.admit(name, "decode")
    hm = await tracking.__aenter__()
    try:
        fmt = _decode_format(hm, format)
        requested = decode_request.parse_shards(shards)
        body = await read_body(request, svc.settings.max_body_bytes)
        latents, _ = await svc.offload(len(body), codecs.read_tensor_body, body, request.headers.get("content-type"),
                                       "latents")
        req = await decode_request.build(svc, hm, latents, format=fmt, dtype=dtype,
                                         tiled=decode_request.parse_tiled(tiled), shards=requested, channels=channels)
        if hm.is_video and req.latents.shape[0] == 1:  # one clip: sent as its groups are decoded; ends `tracking`
            return await whole_clip_response(svc, req, fps=fps, quality=quality, tracking=tracking,
                                             disconnected=request.is_disconnected, started=started)
    except BaseException:
        await tracking.__aexit__(*sys.exc_info())
        raise
    async with _continue(tracking):
        out = await svc.decode(req, disconnected=request.is_disconnected)
        headers = {"X-Output-Shape": ",".join(map(str, out.shape))}
        if fmt == "npy":
            if dtype == "float16":
                out = await svc.in_pool(out.astype, np.float16)
            head, data = codecs.npy_parts(out)
            # sent from the shared-memory block itself; it goes back once the response is out
            return ArenaResponse([head, data], svc.hand_over_lease(), codecs.NPY_MEDIA, headers)
        if hm.is_video:
            data, media = await svc.in_pool(encode_videos, out, fps, quality, svc.settings.mp4_preset,
                                            svc.settings.mp4_threads, svc.settings.mp4_cabac)
        else:
            data, media = await svc.in_pool(codecs.encode_images, out, fmt, quality)
    return Response(data, media_type=media, headers=headers)


def _jpeg_worker(svc: Service, request: Request, body: bytes, hm: HostedModel):
    """The model worker that decodes this body itself, or None: the front end decodes it. Only a
    JPEG a worker's decoder reads as PIL does, at the model's input size (jpeg_header's rules),
    and only to a worker that takes them (JPEG_DECODE, service/worker/jpeg_bodies.py)."""
    mt = codecs.media_type(request.headers.get("content-type"))
    if not (mt.startswith("image/") or mt in codecs.GENERIC_MEDIA):
        return None
    size = int(hm.model.input_size)
    if device_decodable_size(body) != (size, size):
        return None
    return svc.engine.jpeg_link(hm.name)


async def _encode_inputs(svc: Service, request: Request, body: bytes, hm: HostedModel) -> np.ndarray:
    """Images (or pixel arrays) from the body -> N,S,S,3 at the model's size (codecs.model_pixels)."""
    input_size = int(hm.model.input_size)
    mt = codecs.media_type(request.headers.get("content-type"))
    max_px, max_n, max_ar = svc.settings.max_pixels, svc.settings.max_batch, svc.settings.max_aspect_ratio
    if mt in codecs.GENERIC_MEDIA:  # no real Content-Type (none, octet-stream, curl's default): by content
        mt = codecs.sniff(body) or mt
    if mt.startswith("image/"):
        images = [await svc.offload(len(body), codecs.open_image, body, max_px, "image", max_ar)]
    elif mt == "multipart/form-data":
        form = await request.form(max_files=max_n + 1)
        parts = [v for _, v in form.multi_items() if hasattr(v, "read")]
        if not parts:
            raise Problem(400, "no-images", "multipart body has no file parts")
        validation.batch(len(parts), "images", svc.settings)
        images = []
        for i, part in enumerate(parts):
            data = await part.read()
            images.append(await svc.in_pool(codecs.open_image, data, max_px, part.filename or f"file {i}", max_ar))
    elif mt in (codecs.NPY_MEDIA, "application/npy", codecs.SAFETENSORS_MEDIA, "application/json", "",
                "application/octet-stream"):
        def pixels():
            arr, _ = codecs.read_tensor_body(body, mt, "pixels", takes_images=True)
            return codecs.model_pixels(list(validation.source_pixels(arr, svc.settings)), input_size)
        return await svc.offload(len(body), pixels)
    else:
        raise Problem(415, "unsupported-media-type",
                      f"Content-Type {mt!r} not accepted; send an image ({codecs.IMAGE_MEDIA_TEXT}), several "
                      f"as multipart/form-data, or pixels as {codecs.TENSOR_MEDIA_TEXT}")
    metrics.IMAGE_DECODES.labels(hm.name, "frontend").inc(len(images))
    return await svc.offload(sum(im.nbytes for im in images), codecs.model_pixels, images, input_size)


@router.post(
    "/models/{name}/encode", summary="Encode images to embeddings",
    description=(
        "One image (JPEG/PNG/WebP bytes), several as multipart/form-data (every file part, in order), "
        "or pixels as .npy (N,H,W,3 uint8 or float [0,1]). Images are resized (shortest side to "
        "input_size/0.875, centre crop to input_size, bicubic) and normalised by the model.\n\n"
        "`format=json` (default): `{model, embedding_dim, embeddings: [[...]], top_k?: [[{index, label, score}]]}`; "
        "`format=npy`: the float32 N,D embedding array. `top_k` needs a checkpoint with a classifier head."),
    responses={**ERRORS, 200: {"description": "embeddings", "content": {
        "application/json": {}, codecs.NPY_MEDIA: {}}}},
    openapi_extra=IMAGE_BODY)
async def encode(name: str, request: Request,
                 format: Literal["json", "npy"] = Query("json"),
                 top_k_: int | None = Query(None, alias="top_k", ge=1, le=1000,
                                            description="also return the k most likely labels")):
    svc = service(request)
    async with svc.admit(name, "encode") as hm:
        body = await read_body(request, svc.settings.max_body_bytes)
        link = _jpeg_worker(svc, request, body, hm)
        if link is not None:
            out = await svc.encode_jpeg(hm, body, link, disconnected=request.is_disconnected)
        else:
            pixels = await _encode_inputs(svc, request, body, hm)
            out = await svc.encode(hm, pixels, disconnected=request.is_disconnected)
        emb = np.asarray(out["embedding"], dtype=np.float32)
        if top_k_ is not None and out.get("logits") is None:
            raise Problem(422, "no-classifier-head", f"{name} has no classifier head; top_k is unavailable")
        if format == "npy":
            return Response(codecs.npy_bytes(emb), media_type=codecs.NPY_MEDIA,
                            headers={"X-Output-Shape": ",".join(map(str, emb.shape))})
        doc = {"model": name, "embedding_dim": int(emb.shape[1]), "embeddings": emb.tolist()}
        if top_k_ is not None:
            doc["top_k"] = codecs.top_k(np.asarray(out["logits"], dtype=np.float64), top_k_, hm.labels)
    # msgspec writes compact JSON with the same shortest round-trip digits as JSONResponse's json.dumps
    # (its notation differs for small magnitudes: 0.0000272 where json.dumps writes 2.72e-05) at about
    # a tenth of its CPU: with one image a request, json.dumps of the embeddings was 29 %
    # of a front end's CPU on an H200 host (benchmarks/HISTORY.md)
    return Response(msgspec.json.encode(doc), media_type="application/json")
