"""diffusers' remote VAE protocol, so `diffusers.utils.remote_decode` / `remote_encode` work against
convserve by URL alone. A thin adapter: parse the client's wire format, go through the one request
path (Service.decode / Service.vae_encode: batcher -> model), format what the client parses.

    POST /v1/models/{name}/vae/decode   body: raw little-endian latents (Content-Type tensor/binary)
    POST /v1/models/{name}/vae/encode   body: PNG/JPEG bytes, or a raw tensor with shape/dtype

Tensors answer as raw little-endian bytes with `shape` (JSON list) and `dtype` response headers.
Scaling follows the client: with `scaling_factor` (and `shift_factor`) the server decodes
`latents / scaling_factor + shift_factor`; with neither the latents are taken as already
unscaled; the deprecated `do_scaling=True` alone means "the model's own factors". The hosted
models apply their configured factors themselves, so this module undoes them (`to_model_latents`,
`from_model_latents`).
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request, Response

from models.contract import ROW_MAJOR_TOKENS

from ... import codecs
from ...codecs.video import encode_videos, require_av
from ...hosted_model import HostedModel
from ...problems import PROBLEM_SCHEMA, Problem
from ...settings import Settings
from .. import decode_request, validation
from ..http.bodies import read_body
from . import vae_pixels
from .adapters import ERRORS, service
from .auth import require_api_key

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)],
                   responses={401: PROBLEM_SCHEMA}, tags=["diffusers remote VAE"])

TENSOR_MEDIA = "tensor/binary"

#: wire dtype -> little-endian numpy storage dtype (bfloat16 travels as its uint16 bit pattern)
WIRE_DTYPES = {"float32": np.dtype("<f4"), "float16": np.dtype("<f2"), "bfloat16": np.dtype("<u2"),
               "float64": np.dtype("<f8"), "uint8": np.dtype("u1")}


# ---- tensors on the wire ---------------------------------------------------------------------------
def read_wire_tensor(body: bytes, shape: list[int], dtype: str) -> np.ndarray:
    """Raw little-endian bytes + shape + dtype -> numpy (bfloat16 widened to float32)."""
    if dtype not in WIRE_DTYPES:
        raise Problem(415, "unsupported-dtype", f"dtype {dtype!r} not accepted; use one of {sorted(WIRE_DTYPES)}")
    if not shape or any(s < 0 for s in shape):
        raise Problem(400, "bad-tensor", f"shape {codecs.shape_text(shape)} must be a non-empty list of sizes >= 0")
    dt = WIRE_DTYPES[dtype]
    n = math.prod(shape)  # Python ints: a huge declared shape must not overflow int64
    if n * dt.itemsize != len(body):
        raise Problem(400, "bad-tensor", f"{len(body)} body bytes do not hold shape {codecs.shape_text(shape)} of {dtype} "
                                         f"({n * dt.itemsize} bytes)")
    arr = codecs.reshape(np.frombuffer(body, dtype=dt), shape, "latents")
    return codecs.bf16_to_f32(arr) if dtype == "bfloat16" else arr


def f32_to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns, round to nearest even (as torch's .to(torch.bfloat16))."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    # NaN must stay NaN: keep its top half with the quiet bit set instead of rounding into Inf
    rounded = np.where(np.isnan(x), (bits >> np.uint32(16)) | np.uint32(0x40), rounded)
    return rounded.astype("<u2")


def wire_bytes(arr: np.ndarray, dtype: str) -> bytes:
    if dtype == "bfloat16":
        return f32_to_bf16_bits(arr).tobytes()
    return np.ascontiguousarray(arr, dtype=WIRE_DTYPES[dtype]).tobytes()


def tensor_response(arr: np.ndarray, dtype: str) -> Response:
    return Response(wire_bytes(arr, dtype), media_type=TENSOR_MEDIA,
                    headers={"shape": json.dumps([int(s) for s in arr.shape]), "dtype": dtype})


def float_reply_dtype(request_dtype: str) -> str:
    """Float outputs travel in the request's float dtype, as a diffusers VAE run in it would give them."""
    return request_dtype if request_dtype in ("float16", "bfloat16") else "float32"


# ---- scaling ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ClientScaling:
    """What the client asked: latents_on_wire = (z - shift) * scale, z the VAE's own latent.
    `model_default` = the deprecated do_scaling=True with no factors: the model's config decides."""

    scale: float | None
    shift: float | None
    model_default: bool

    @classmethod
    def from_query(cls, scaling_factor: float | None, shift_factor: float | None,
                   do_scaling: bool | None) -> "ClientScaling":
        if scaling_factor is not None and scaling_factor == 0:
            raise Problem(422, "bad-scaling", "scaling_factor must not be 0")
        return cls(scaling_factor, shift_factor, scaling_factor is None and shift_factor is None and bool(do_scaling))

    def to_raw(self, lat: np.ndarray) -> np.ndarray:
        z = lat.astype(np.float64)
        if self.scale is not None:
            z = z / self.scale
        return z + self.shift if self.shift is not None else z

    def from_raw(self, z: np.ndarray) -> np.ndarray:
        out = z.astype(np.float64)
        if self.shift is not None:
            out = out - self.shift
        return out * self.scale if self.scale is not None else out


def _same_as_model(hm: HostedModel, s: ClientScaling) -> bool:
    return not hm.per_channel_scaling and s.scale is not None and (s.scale, s.shift or 0.0) == hm.latent_scaling()


def to_model_latents(hm: HostedModel, lat: np.ndarray, s: ClientScaling) -> np.ndarray:
    """Client latents -> the latents the model's decode() expects (it applies its own factors)."""
    if s.model_default or _same_as_model(hm, s):
        return lat
    scale, shift = hm.latent_scaling()
    return ((s.to_raw(lat) - shift) * scale).astype(np.float32)


def from_model_latents(hm: HostedModel, lat: np.ndarray, s: ClientScaling) -> np.ndarray:
    """The model's encode() output (its own factors applied) -> latents scaled as the client asked."""
    if s.model_default or _same_as_model(hm, s):
        return lat
    scale, shift = hm.latent_scaling()
    return s.from_raw(lat.astype(np.float64) / scale + shift).astype(np.float32)


# ---- FLUX packed latents ---------------------------------------------------------------------------
def unpack_flux_latents(packed: np.ndarray, height: int, width: int, spatial_factor: int) -> np.ndarray:
    """(B, h/2 * w/2, C*4) 2x2-patch sequence -> (B, C, h, w), as FluxPipeline._unpack_latents."""
    b, patches, c4 = packed.shape
    h = 2 * (int(height) // (spatial_factor * 2))
    w = 2 * (int(width) // (spatial_factor * 2))
    if c4 % 4 or h < 2 or w < 2 or patches != (h // 2) * (w // 2):
        raise Problem(422, "bad-packed-latents",
                      f"packed latents {list(packed.shape)} do not fit height={height}, width={width}: "
                      f"expected (B, {max(h // 2, 0) * max(w // 2, 0)}, 4*C)")
    x = packed.reshape(b, h // 2, w // 2, c4 // 4, 2, 2).transpose(0, 3, 1, 4, 2, 5)
    return np.ascontiguousarray(x.reshape(b, c4 // 4, h, w))


def unpack_row_major_tokens(packed: np.ndarray, height: int, width: int, spatial_factor: int) -> np.ndarray:
    """(B, h*w, C) tokens in row-major grid order -> (B, C, h, w), as Flux2Pipeline unpacks them
    (its latent ids enumerate rows, then columns); h, w = the pixel sides / the model's spatial factor."""
    b, tokens, c = packed.shape
    h, w = int(height) // spatial_factor, int(width) // spatial_factor
    if h < 1 or w < 1 or tokens != h * w:
        raise Problem(422, "bad-packed-latents",
                      f"packed latents {list(packed.shape)} do not fit height={height}, width={width}: "
                      f"expected (B, {max(h, 0) * max(w, 0)}, C) tokens, one per {spatial_factor}x{spatial_factor} pixels")
    return np.ascontiguousarray(packed.reshape(b, h, w, c).transpose(0, 3, 1, 2))


def unpack_latents(hm: HostedModel, packed: np.ndarray, height: int, width: int) -> np.ndarray:
    """Packed (3-D) image latents -> N,C,h,w by the layout the model's pipeline packs them in (its card)."""
    if hm.model.card().get("packed_latents") == ROW_MAJOR_TOKENS:
        return unpack_row_major_tokens(packed, height, width, hm.model.spatial_factor)
    return unpack_flux_latents(packed, height, width, hm.model.spatial_factor)


# ---- outputs ---------------------------------------------------------------------------------------
def to_uint8_round(x01: np.ndarray) -> np.ndarray:
    """[0,1] -> uint8 as diffusers' numpy_to_pil: (x * 255).round()."""
    return np.round(np.clip(x01, 0.0, 1.0) * 255.0).astype(np.uint8)


def _image_file_format(request: Request, image_format: str) -> str | None:
    """`output_type=pil`: an image file unless the client asked for a tensor (remote_decode with a
    processor sends `Accept: tensor/binary`); the format by Accept, else `image_format`."""
    accept = (request.headers.get("accept") or "").lower()
    if "image/png" in accept:
        return "png"
    if "image/jpeg" in accept or "image/jpg" in accept:
        return "jpg"
    return None if TENSOR_MEDIA in accept else image_format


def _video_rows(x: np.ndarray) -> np.ndarray:
    """One video is sent without its batch axis, as diffusers' postprocess_video(...)[0] gives it."""
    return x[0] if x.shape[0] == 1 else x


# ---- routes ----------------------------------------------------------------------------------------
DECODE_DOC = """The request `diffusers.utils.remote_decode(endpoint=<this URL>, ...)` sends: the raw
little-endian latents as the body, `shape` (repeated) and `dtype` (`float16`, `bfloat16`, `float32`) as
query parameters. Image VAEs take N,C,h,w latents, or packed latents with `height`/`width` (pixels):
FLUX.1's (B, h/2*w/2, 4C) 2x2 patches, or, for a FLUX.2 VAE (card `packed_latents`: row-major tokens),
(B, H/16*W/16, 128) tokens in row-major order. A Qwen-Image VAE (card `single_frame_latents`) also takes
the pipeline's N,C,1,h,w, and is normalised per channel as Wan's. Video VAEs take N,C,T,h,w.

Scaling: `scaling_factor` (+ `shift_factor`) -> the decoder sees `latents / scaling_factor + shift_factor`;
neither -> the latents are already unscaled; deprecated `do_scaling=True` alone -> the model's own factors.

Answers (`shape` and `dtype` headers on tensors, dtype = the request's float dtype, float32 for float32):
- image VAE, `output_type=pil`: the image file (one latent), format by `Accept` (image/jpeg, image/png)
  else `image_format`.
- `output_type=pil` with `Accept: tensor/binary` (remote_decode given a processor): float [0,1] N,3,H,W
  (video: F,3,H,W).
- `output_type=pt`, `partial_postprocess=True`: uint8 N,H,W,3 (video: F,H,W,3).
- `output_type=pt`, `partial_postprocess=False`: the decoder's output as `vae.decode(...).sample`,
  N,3,H,W about [-1,1], unclamped (video: N,3,F,H,W in [-1,1]; one-frame image latents: N,3,1,H,W).
- video VAE, `output_type=mp4`: H.264 MP4 bytes (`fps`, `quality` tune it).
Video answers drop the batch axis for one video; several keep it (MP4: a zip of video_000.mp4, ...).

A VAE that decodes alpha (card `pixel_channels`: the Qwen-Image 2.1 VAE) answers its four channels, RGBA, as
`vae.decode(...).sample` and its pipeline's PIL output have them: tensors N,4,H,W (uint8 N,H,W,4), PNG files
RGBA; a JPEG file holds RGB. `channels=rgb` (not a remote_decode argument: a query parameter) asks for RGB."""


@router.post("/models/{name}/vae/decode", summary="diffusers remote_decode protocol", description=DECODE_DOC,
             response_class=Response, responses={**ERRORS, 200: {"description": "tensor, image or mp4", "content": {
                 TENSOR_MEDIA: {}, "image/jpeg": {}, "image/png": {}, "video/mp4": {}}}},
             openapi_extra={"requestBody": {"required": True, "content": {
                 TENSOR_MEDIA: {"schema": {"type": "string", "format": "binary"}}}}})
async def remote_decode(
        name: str, request: Request,
        shape: list[int] = Query(..., description="latents shape, repeated: shape=1&shape=4&shape=64&shape=64"),
        dtype: str = Query("float32", description="float32, float16 or bfloat16"),
        scaling_factor: float | None = Query(None), shift_factor: float | None = Query(None),
        do_scaling: bool | None = Query(None, description="deprecated: true alone = the model's own factors"),
        output_type: Literal["pil", "pt", "mp4"] = Query("pil"),
        image_format: Literal["jpg", "png"] = Query("jpg"),
        partial_postprocess: bool = Query(False),
        height: int | None = Query(None, ge=1, description="image height in pixels, for packed latents"),
        width: int | None = Query(None, ge=1, description="image width in pixels, for packed latents"),
        fps: float = Query(16.0, gt=0, le=240, description="MP4 frame rate"),
        quality: int = Query(90, ge=1, le=100, description="JPEG quality; MP4 quality (CRF 51..0)"),
        channels: Literal["rgba", "rgb"] | None = Query(
            None, description="rgba or rgb; default: the model's own (RGBA for a VAE with alpha, but in JPEG)")):
    svc = service(request)
    async with svc.admit(name, "vae_decode") as hm:
        video = hm.is_video
        image_file_fmt = _image_file_format(request, image_format) if output_type == "pil" else None
        if output_type == "mp4" and not video:
            raise Problem(422, "bad-output-type", f"{name} is an image VAE: output_type mp4 is for video VAEs")
        if output_type == "mp4":
            require_av("")
        if video and image_file_fmt:
            raise Problem(422, "bad-output-type", f"{name} is a video VAE: output_type pil answers a frames "
                          "tensor; pass processor=VideoProcessor(), or use output_type mp4 or pt")
        scaling = ClientScaling.from_query(scaling_factor, shift_factor, do_scaling)
        body = await read_body(request, svc.settings.max_body_bytes)
        lat = validation.float_latents(read_wire_tensor(body, shape, dtype), "float32, float16 or bfloat16")
        # one-frame latents N,C,1,h,w (the Qwen-Image pipeline's): decoded as N,C,h,w, a raw answer
        # keeps the frame axis as vae.decode(...).sample has it
        frame_axis = lat.ndim == 5 and lat.shape[2] == 1 and hm.single_frame_latents
        if frame_axis:
            lat = lat[:, :, 0]
        if lat.ndim == 3 and not video:
            if height is None or width is None:
                raise Problem(422, "missing-height-width", "packed (3-D) latents need height and width")
            lat = unpack_latents(hm, lat, height, width)
        if lat.ndim != hm.latent_ndim:  # no implicit batch axis: 3-D image latents are packed ones
            raise Problem(422, "bad-shape", f"{name} wants latents "
                          f"{'N,C,T,h,w' if video else 'N,C,h,w or packed B,tokens,C'}, got shape {list(lat.shape)}")
        if image_file_fmt and lat.shape[0] != 1:
            raise Problem(422, "one-image-only", f"an image file holds one image, got {lat.shape[0]} latents; "
                          "use output_type=pt for batches")
        # before the client's scaling: Wan's and Qwen-Image's are per channel, and other channel
        # counts would not broadcast with them (a 500, not this 422)
        validation.channels(hm, lat)
        lat = to_model_latents(hm, np.asarray(lat), scaling)
        # raw decoder output (`pt`, not post-processed) must not be clipped; everything else is
        raw = output_type == "pt" and not partial_postprocess
        req = await decode_request.build(svc, hm, lat, format="tensor", clamp=not raw,  # float pixels, rounded here
                                         channels=channels, answer=image_file_fmt or output_type)
        out01 = await svc.decode(req, disconnected=request.is_disconnected)
        reply = float_reply_dtype(dtype)

        if output_type == "mp4":
            data, media = await svc.in_pool(encode_videos, out01, fps, quality, svc.settings.mp4_preset,
                                            svc.settings.mp4_threads, svc.settings.mp4_cabac)
            return Response(data, media_type=media)
        if image_file_fmt:
            data = await svc.in_pool(lambda: codecs.image_bytes(to_uint8_round(out01[0]), image_file_fmt, quality))
            return Response(data, media_type="image/png" if image_file_fmt == "png" else "image/jpeg")
        if output_type == "pt" and partial_postprocess:
            rgb = to_uint8_round(out01)  # N,H,W,3 / N,F,H,W,3
            return tensor_response(_video_rows(rgb) if video else rgb, "uint8")
        if raw:
            # NHWC x/2+0.5 -> NCHW (video N,C,F,H,W) in the decoder's own range
            x = out01 * np.float32(2.0) - np.float32(1.0)
            x = x.transpose(0, 4, 1, 2, 3) if video else x.transpose(0, 3, 1, 2)
            return tensor_response(x[:, :, None] if frame_axis else x, reply)
        # output_type=pil with a processor: postprocessed float [0,1], channels first per frame
        x = out01.transpose(0, 1, 4, 2, 3) if video else out01.transpose(0, 3, 1, 2)
        return tensor_response(_video_rows(x) if video else x, reply)


ENCODE_DOC = """The request `diffusers.utils.remote_encode(endpoint=<this URL>, image=...)` sends: a PIL
image as PNG bytes, or a tensor as raw little-endian bytes with `shape`/`dtype` query parameters (float:
N,3,H,W or 3,H,W in [-1,1] as `VaeImageProcessor.preprocess` gives it; uint8: N,H,W,3 or H,W,3). Also
JPEG/WebP files, and .npy pixels (`application/x-npy`: N,H,W,3 or H,W,3, uint8 or float in [0,1]).
Answers the posterior mean latents N,C,H/8,W/8 (deterministic) with `shape`/`dtype` headers, scaled as
asked: `(mean - shift_factor) * scaling_factor`; neither factor -> the unscaled mean; deprecated
`do_scaling=True` alone -> the model's own factors. Needs a checkpoint with the VAE encoder
(`has_encoder` in the model card).

A video VAE with an encoder (Wan 2.2) takes clips of F = 1 + 4k frames, sides multiples of 16: an
image file is one frame; .npy N,F,H,W,3 (N,H,W,3 and H,W,3: one frame each); a float tensor
N,3,F,H,W in [-1,1] (`VideoProcessor.preprocess_video`'s layout, what `vae.encode` takes) or N,3,H,W,
3,H,W; uint8 N,F,H,W,3, N,H,W,3, H,W,3. It answers N,48,1+k,H/16,W/16: with `do_scaling=True` the TI2V
pipeline's normalised latents `(mean - latents_mean) * (1 / latents_std)`; with no factors the unscaled
posterior mean. The LTX-2 VAE likewise, with F = 1 + 8k, sides multiples of 32, N,128,1+k,H/32,W/32, and
the image-to-video pipeline's `(mean - latents_mean) / latents_std` with `do_scaling=True`. The
HunyuanVideo 1.5 VAE: F = 1 + 4k, sides multiples of 16, N,32,1+k,H/16,W/16, `mean * scaling_factor` (its
image-to-video pipeline's) with `do_scaling=True`. The compute cap
counts every frame's pixels."""


def _encode_pixels(hm: HostedModel, limits: Settings, body: bytes, content_type: str | None,
                   shape: list[int] | None, dtype: str) -> tuple[np.ndarray, str]:
    """Body -> float32 pixels in [0,1] in the model's layout (images N,H,W,3, a video VAE's frames
    N,F,H,W,3: service/frontend/routes/vae_pixels.py) and the dtype to answer in."""
    if not shape:
        if codecs.media_type(content_type) == codecs.NPY_MEDIA or codecs.sniff(body) == codecs.NPY_MEDIA:
            return vae_pixels.npy_pixels(hm, body, limits), "float32"
        return vae_pixels.image_pixels(hm, body, limits), "float32"
    x = read_wire_tensor(body, shape, dtype)
    if hm.is_video:
        return vae_pixels.frames_pixels(x, limits, channels_first=True), float_reply_dtype(dtype)
    return vae_pixels.tensor_pixels(x, limits), float_reply_dtype(dtype)


@router.post("/models/{name}/vae/encode", summary="diffusers remote_encode protocol", description=ENCODE_DOC,
             response_class=Response, responses={**ERRORS, 200: {"description": "latents tensor",
                                                                 "content": {TENSOR_MEDIA: {}}}},
             openapi_extra={"requestBody": {"required": True, "content": {
                 "image/png": {"schema": {"type": "string", "format": "binary"}},
                 "image/jpeg": {"schema": {"type": "string", "format": "binary"}},
                 "image/webp": {"schema": {"type": "string", "format": "binary"}},
                 codecs.NPY_MEDIA: {"schema": {"type": "string", "format": "binary"}},
                 TENSOR_MEDIA: {"schema": {"type": "string", "format": "binary"}}}}})
async def remote_encode(
        name: str, request: Request,
        shape: list[int] | None = Query(None, description="tensor input: its shape, repeated"),
        dtype: str = Query("float32", description="tensor input: float32, float16, bfloat16 or uint8"),
        scaling_factor: float | None = Query(None), shift_factor: float | None = Query(None),
        do_scaling: bool | None = Query(None, description="deprecated: true alone = the model's own factors")):
    svc = service(request)
    async with svc.admit(name, "vae_encode") as hm:
        scaling = ClientScaling.from_query(scaling_factor, shift_factor, do_scaling)
        body = await read_body(request, svc.settings.max_body_bytes)
        images01, reply = await svc.in_pool(_encode_pixels, hm, svc.settings, body,
                                            request.headers.get("content-type"), shape, dtype)
        lat = await svc.vae_encode(hm, images01, disconnected=request.is_disconnected)
        return tensor_response(from_model_latents(hm, np.asarray(lat), scaling), reply)
