"""The pixels of a remote_encode request (service/frontend/routes/remote_vae.py) -> float32 in [0,1] in the layout
the model's encoder takes: images N,H,W,3 for an image VAE, frames N,F,H,W,3 for a video VAE (the
Wan 2.2 VAE's encoder). Three body forms:

- an image file (PNG, JPEG, WebP): one image; to a video VAE, a one-frame clip (F = 1);
- a .npy array (Content-Type application/x-npy, or its magic bytes when no `shape` is given),
  channels last as /v1's encode takes pixels: uint8 0..255 or float in [0,1]; images N,H,W,3 or
  H,W,3; a video VAE also takes N,F,H,W,3 (4-D and 3-D arrays are one frame per video);
- a raw tensor with `shape`/`dtype` (diffusers' client): uint8 channels last as above; float
  channels first in [-1,1] as diffusers' processors give it and `vae.encode` takes it: N,3,H,W or
  3,H,W, and for a video VAE also N,3,F,H,W (VideoProcessor.preprocess_video's layout).

Sizes are checked against the per-frame pixel limit and the frame limit before the float copy
(4x the body for uint8 pixels); the rest of the checks are validation.vae_images / vae_frames'."""
from __future__ import annotations

import numpy as np

from ... import codecs
from ...hosted_model import HostedModel
from ...problems import Problem
from ...settings import Settings
from .. import validation


def image_pixels(hm: HostedModel, body: bytes, limits: Settings) -> np.ndarray:
    """An image file -> float32 1,H,W,3 (image VAE) or 1,1,H,W,3 (video VAE) in [0,1]."""
    rgb = codecs.open_image(body, limits.max_pixels, "image")
    images01 = (rgb.astype(np.float32) / np.float32(255.0))[None]
    return images01[:, None] if hm.is_video else images01


def tensor_pixels(x: np.ndarray, limits: Settings) -> np.ndarray:
    """An image VAE's raw tensor (uint8 channels last, float channels first in [-1,1]) -> float32
    N,H,W,3 in [0,1]."""
    x = x[None] if x.ndim == 3 else x
    # the pixel limit before the float copy, which is 4x the body for uint8 pixels
    if x.ndim >= 4:
        validation.pixel_limit(*(x.shape[-3:-1] if x.dtype == np.uint8 else x.shape[-2:]), limits)
    if x.dtype == np.uint8:
        if x.ndim != 4 or x.shape[-1] != 3:
            raise Problem(422, "bad-shape", f"uint8 pixels must be N,H,W,3 or H,W,3, got {list(x.shape)}")
        return x.astype(np.float32) / np.float32(255.0)
    if x.ndim != 4 or x.shape[1] != 3:
        raise Problem(422, "bad-shape", f"float pixels must be N,3,H,W or 3,H,W in [-1, 1], got {list(x.shape)}")
    return (x.astype(np.float32).transpose(0, 2, 3, 1) + np.float32(1.0)) * np.float32(0.5)


def frames_pixels(x: np.ndarray, limits: Settings, *, channels_first: bool) -> np.ndarray:
    """A video VAE's pixels -> float32 N,F,H,W,3 in [0,1]. channels_first (a raw float tensor):
    N,3,F,H,W, N,3,H,W or 3,H,W in [-1,1]; else channels last, uint8 or float in [0,1]:
    N,F,H,W,3, N,H,W,3 or H,W,3. A 4-D or 3-D array is one frame per video."""
    if x.dtype != np.uint8 and x.dtype.kind != "f":
        raise Problem(415, "unsupported-dtype", f"pixels dtype {x.dtype}: send uint8, or float in [0, 1]")
    if channels_first and x.dtype.kind == "f":
        layout = "N,3,F,H,W, N,3,H,W or 3,H,W in [-1, 1]"
        channel_axis = 1 if x.ndim > 3 else 0
        fits = 3 <= x.ndim <= 5 and x.shape[channel_axis] == 3
        if fits:
            x = np.moveaxis(x, channel_axis, -1)  # channels last: a view
    else:
        layout = f"N,F,H,W,3, N,H,W,3 or H,W,3 ({'uint8' if channels_first else 'uint8, or float in [0, 1]'})"
        fits = 3 <= x.ndim <= 5 and x.shape[-1] == 3
    if not fits:
        raise Problem(422, "bad-shape", f"{x.dtype} pixels for a video VAE must be {layout}, got {list(x.shape)}")
    x = x[None] if x.ndim == 3 else x
    x = x[:, None] if x.ndim == 4 else x
    if min(x.shape) < 1:
        raise Problem(422, "bad-shape", f"empty pixels: shape {list(x.shape)}")
    validation.pixel_limit(x.shape[2], x.shape[3], limits)
    validation.frame_limit(x.shape[1], limits)
    validation.batch(x.shape[0], "videos", limits)
    if x.dtype == np.uint8:
        return x.astype(np.float32) / np.float32(255.0)
    x = x.astype(np.float32, copy=False)
    return (x + np.float32(1.0)) * np.float32(0.5) if channels_first else x


def npy_pixels(hm: HostedModel, body: bytes, limits: Settings) -> np.ndarray:
    """A .npy body, channels last (uint8, or float in [0,1]) -> float32 in [0,1], the model's layout."""
    x = codecs.read_npy(body, "pixels", takes_images=True)
    if hm.is_video:
        return frames_pixels(x, limits, channels_first=False)
    if x.dtype != np.uint8 and x.dtype.kind != "f":
        raise Problem(415, "unsupported-dtype", f"pixels dtype {x.dtype}: send uint8, or float in [0, 1]")
    x = x[None] if x.ndim == 3 else x
    if x.ndim != 4 or x.shape[-1] != 3 or min(x.shape) < 1:
        raise Problem(422, "bad-shape", f"pixels must be N,H,W,3 or H,W,3 (uint8, or float in [0, 1]), "
                      f"got {list(x.shape)}")
    validation.pixel_limit(x.shape[1], x.shape[2], limits)
    return x.astype(np.float32) / np.float32(255.0) if x.dtype == np.uint8 else x.astype(np.float32, copy=False)
