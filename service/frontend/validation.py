"""The one validation step of every protocol adapter (REST v1, KServe v2, remote VAE, streaming, CLI):
a parsed tensor and the hosted model it is for -> the input that model takes, or a Problem with a
stable error kind. Limits come from the settings; the CLI's local runs pass none."""
from __future__ import annotations

import numpy as np

from ..codecs import check_source_image
from ..hosted_model import HostedModel
from ..problems import Problem
from ..settings import Settings

#: per endpoint: what it needs of a model, the problem kind and the detail when the model lacks it
_ROUTES = {
    "decode": (lambda hm: hm.is_decoder, "wrong-model-kind", "{name} is an {kind}; POST to /v1/models/{name}/encode"),
    "encode": (lambda hm: not hm.is_decoder, "wrong-model-kind",
               "{name} is an {kind}; POST latents to /v1/models/{name}/decode"),
    "decode_stream": (lambda hm: hm.is_video, "wrong-model-kind",
                      "{name} is an {kind}; streaming decode is for video decoders"),
    "vae_decode": (lambda hm: hm.is_decoder, "wrong-model-kind", "{name} is an {kind}; remote_decode needs a VAE decoder"),
    "vae_encode": (lambda hm: hm.can_encode, "no-vae-encoder",
                   "{name} ({kind}) serves no VAE encoder: remote_encode takes an image VAE or a video VAE "
                   "(Wan 2.2, HunyuanVideo 1.5, LTX-2) whose checkpoint holds the encoder weights"),
}


def model_for(hm: HostedModel, endpoint: str) -> HostedModel:
    """`hm` if `endpoint` can run it (409 otherwise); endpoints that take every model pass."""
    accepts, kind, detail = _ROUTES.get(endpoint, (None, "", ""))
    if accepts is not None and not accepts(hm):
        raise Problem(409, kind, detail.format(name=hm.name, kind=hm.kind))
    return hm


def batch(n: int, noun: str, limits: Settings | None) -> None:
    if limits is not None and n > limits.max_batch:
        raise Problem(422, "batch-too-large", f"{n} {noun} in one request; the limit is {limits.max_batch}")


def pixel_limit(height: int, width: int, limits: Settings) -> None:
    if height * width > limits.max_pixels:
        raise Problem(413, "image-too-large", f"{width}x{height} pixels exceed the limit of {limits.max_pixels}")


def float_latents(lat: np.ndarray, offered: str = "float32, float16, bfloat16 or float64") -> np.ndarray:
    if lat.dtype.kind != "f":
        raise Problem(415, "unsupported-dtype", f"latents dtype {lat.dtype} not accepted; send {offered}")
    return lat


def _finite_f32(x: np.ndarray, kind: str, what: str) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    if not np.isfinite(x).all():
        raise Problem(422, kind, f"{what} contain NaN or Inf")
    return x


def channels(hm: HostedModel, lat: np.ndarray) -> None:
    """N,C,... latents of the model's channel count (checked before anything computes per channel)."""
    if lat.shape[1] != hm.model.latent_channels:
        raise Problem(422, "wrong-channels", f"{hm.name} wants {hm.model.latent_channels} latent channels, "
                      f"got {lat.shape[1]} (shape {list(lat.shape)})")


def latents(hm: HostedModel, lat: np.ndarray, limits: Settings | None = None) -> np.ndarray:
    """Latents for a decoder (a missing batch axis added) -> contiguous float32 within the limits."""
    float_latents(lat)
    if lat.ndim == 5 and lat.shape[2] == 1 and hm.single_frame_latents:
        lat = lat[:, :, 0]  # the Qwen-Image pipeline's N,C,1,h,w
    if lat.ndim == hm.latent_ndim - 1:
        lat = lat[None]
    if lat.ndim != hm.latent_ndim:
        raise Problem(422, "bad-shape", f"{hm.name} wants latents {hm.latent_layout}, got shape {list(lat.shape)}")
    channels(hm, lat)
    if min(lat.shape) < 1:
        raise Problem(422, "bad-shape", f"empty latents: shape {list(lat.shape)}")
    batch(lat.shape[0], "latents", limits)
    if limits is not None:
        out = hm.output_shape(lat.shape)
        if out[-3] * out[-2] > limits.max_pixels:
            raise Problem(422, "too-many-pixels", f"output {out[-3]}x{out[-2]} = {out[-3] * out[-2]} pixels "
                          f"exceeds the limit of {limits.max_pixels}")
        if hm.is_video and out[1] > limits.max_frames:
            raise Problem(422, "too-many-frames", f"{out[1]} output frames exceed the limit of {limits.max_frames}")
    return _finite_f32(lat, "non-finite-latents", "latents")


def source_pixels(arr: np.ndarray, limits: Settings) -> np.ndarray:
    """Pixels N,H,W,3 (or H,W,3) of any size, to be resized to an encoder's input: uint8, or float
    in [0,1], within the batch, pixel and aspect-ratio limits."""
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[-1] != 3 or min(arr.shape) < 1:
        raise Problem(422, "bad-shape", f"pixels must be N,H,W,3 (or H,W,3), got {list(arr.shape)}")
    if arr.dtype != np.uint8 and arr.dtype.kind != "f":
        raise Problem(415, "unsupported-dtype", f"pixels dtype {arr.dtype}: send uint8 or float in [0,1]")
    batch(arr.shape[0], "images", limits)
    check_source_image(arr.shape[1], arr.shape[2], limits.max_pixels, limits.max_aspect_ratio, "pixels")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise Problem(422, "non-finite-pixels", "pixels contain NaN or Inf")
    return arr


def encoder_pixels(hm: HostedModel, px: np.ndarray, limits: Settings | None = None) -> np.ndarray:
    """Pixels N,S,S,3 at an image encoder's input size -> contiguous uint8 (0..255, as they came)
    or float32 (in [0,1])."""
    size = int(hm.model.input_size)
    if px.ndim != 4 or px.shape[1:] != (size, size, 3):
        raise Problem(422, "bad-shape", f"{hm.name} wants pixels N,{size},{size},3, got {list(px.shape)}")
    batch(px.shape[0], "images", limits)
    if px.dtype == np.uint8:
        return np.ascontiguousarray(px)
    return _finite_f32(px, "non-finite-pixels", "pixels")


def vae_images(hm: HostedModel, images: np.ndarray, limits: Settings) -> np.ndarray:
    """Images N,H,W,3 in [0,1] for a VAE encoder (the pixel limit checked as they were read) ->
    contiguous float32. A model whose latents are patchified (card `latent_patch`, FLUX.2's 2) needs
    its encoder's latent sides to split into whole patches."""
    if images.ndim != 4 or images.shape[-1] != 3 or min(images.shape) < 1:
        raise Problem(422, "bad-shape", f"images must be N,H,W,3, got {list(images.shape)}")
    patch = int(hm.model.card().get("latent_patch") or 1)
    encoder_factor = int(hm.model.spatial_factor) // patch
    if any((side // encoder_factor) % patch for side in images.shape[1:3]):
        raise Problem(422, "bad-shape", f"{hm.name} encodes images whose sides / {encoder_factor} (floored) are "
                      f"multiples of {patch}, whole {patch}x{patch} latent patches; got {list(images.shape[1:3])}")
    batch(images.shape[0], "images", limits)
    return _finite_f32(images, "non-finite-pixels", "pixels")


def vae_frames(hm: HostedModel, frames: np.ndarray, limits: Settings) -> np.ndarray:
    """Frames N,F,H,W,3 in [0,1] for a video VAE's encoder (the pixel limit checked per frame as
    they were read) -> contiguous float32: F = 1 + tk for its temporal factor t (the first frame
    alone, then t per latent frame), H and W multiples of its spatial factor."""
    if frames.ndim != 5 or frames.shape[-1] != 3 or min(frames.shape) < 1:
        raise Problem(422, "bad-shape", f"frames must be N,F,H,W,3, got {list(frames.shape)}")
    t, s = int(hm.model.temporal_factor), int(hm.model.spatial_factor)
    n, f, h, w = frames.shape[:4]
    if (f - 1) % t:
        raise Problem(422, "bad-frame-count", f"{hm.name} encodes 1 + {t}k frames (1, {1 + t}, {1 + 2 * t}, ...), "
                      f"got {f}")
    if h % s or w % s:
        raise Problem(422, "bad-frame-size", f"{hm.name} encodes frames whose height and width are multiples of "
                      f"{s}, got {h}x{w} (HxW)")
    frame_limit(f, limits)
    batch(n, "videos", limits)
    return _finite_f32(frames, "non-finite-pixels", "pixels")


def frame_limit(frames: int, limits: Settings) -> None:
    if frames > limits.max_frames:
        raise Problem(422, "too-many-frames", f"{frames} frames exceed the limit of {limits.max_frames}")
