"""What the service may ask a model: one typed Protocol per kind (docs/interfaces.md, "models").

The service calls these members and nothing else; it never imports a model class or a private
name. `kind` says which Protocol a model follows; a decoder's `tiling` is its current tile
settings, opaque to the caller, which only passes it back to `smaller_tiling` or installs one
that method returned (while it alone runs the model).
"""
from __future__ import annotations

from typing import Any, Iterator, Literal, Protocol, Union, runtime_checkable

import numpy as np

IMAGE_DECODER, VIDEO_DECODER, IMAGE_ENCODER = "image-decoder", "video-decoder", "image-encoder"
Kind = Literal["image-decoder", "video-decoder", "image-encoder"]
#: decoders' output range: diffusers clamps to [-1, 1] and maps x / 2 + 0.5 (conv_out does the map)
PIXEL_RANGE = (0.0, 1.0)
#: an image decoder's card field `packed_latents` when its pipeline packs latents as plain row-major
#: tokens, (B, h * w, C) with token i * w + j at (i, j) (FLUX.2); absent: FLUX.1's 2x2 patches per token
ROW_MAJOR_TOKENS = "row-major tokens"
#: an image decoder's card field, true when it also takes one-frame latents N,C,1,h,w (the Qwen-Image
#: VAE, a video VAE run on one frame, whose pipeline hands it latents that way)
SINGLE_FRAME_LATENTS = "single_frame_latents"


@runtime_checkable
class Model(Protocol):
    name: str
    kind: Kind
    #: where the weights came from (a path, hf://org/name@commit, or "random init"); None = unnamed
    weights_source: str | None
    #: Hub weights only: repository, subfolder, revision, resolved commit, file sizes and hashes
    weights_provenance: dict | None

    def card(self) -> dict: ...


@runtime_checkable
class TiledDecoder(Model, Protocol):
    latent_channels: int
    spatial_factor: int
    tiling: Any

    def smaller_tiling(self, current: Any) -> Any | None:
        """Retry smaller: the tile settings to try after a decode in `current` ran out of
        memory, or None when there is no smaller one."""


@runtime_checkable
class ImageDecoder(TiledDecoder, Protocol):
    has_encoder: bool

    def decode(self, latents_nchw: np.ndarray, tiled: bool | None = None, clamp: bool = True, *,
               uint8: bool = False) -> np.ndarray:
        """float32 N,H,W,3 in [0, 1]; uint8=True: uint8 N,H,W,3 (clamp implied)."""

    def encode(self, images_nhwc01: np.ndarray, tiled: bool | None = None) -> np.ndarray: ...


@runtime_checkable
class AlphaDecoder(Protocol):
    """An image decoder whose decoder writes a fourth channel, alpha, beside RGB (the Qwen-Image 2.1
    VAE: its pipeline's PIL output is RGBA). `decode` stays the ImageDecoder's RGB; `decode_rgba`
    gives all four channels, and the service serves them (docs/api.md, `channels`)."""

    #: True: read by the service from a model or its ModelView (which has no decode_rgba)
    decodes_alpha: bool

    def decode_rgba(self, latents_nchw: np.ndarray, tiled: bool | None = None, *, uint8: bool = False) -> np.ndarray:
        """float32 N,H,W,4 (RGB, then alpha) in [0, 1]; uint8=True: uint8 N,H,W,4. Always clamped."""


@runtime_checkable
class VideoDecoder(TiledDecoder, Protocol):
    temporal_factor: int

    def decode(self, latents_ncthw: np.ndarray, tiled: bool | None = None, *, uint8: bool = False) -> np.ndarray:
        """float32 N,F,H,W,3 in [0, 1]; uint8=True: uint8."""

    def decode_frames(self, latents_ncthw: np.ndarray, tiled: bool | None = None, *,
                      uint8: bool = False) -> Iterator[np.ndarray]:
        """N,f,H,W,3 frame groups in order, float32 in [0, 1] or (uint8=True) uint8."""


@runtime_checkable
class PerChannelLatents(Protocol):
    """A decoder whose pipeline normalises latents per channel (the Wan VAEs, the Qwen-Image VAE):
    latents = (z - latents_mean) / latents_std, which its decode undoes. The service reads the
    statistics here (to scale remote-VAE latents), never from the card."""

    #: (latents_mean, latents_std), one entry per latent channel, as the model's config has them
    latent_stats: tuple[tuple[float, ...], tuple[float, ...]]


@runtime_checkable
class ImageEncoder(Model, Protocol):
    input_size: int
    embed_dim: int
    labels: list[str] | None

    def encode(self, pixels_nhwc01: np.ndarray) -> dict:
        """pixels N,H,W,3: floating in [0, 1], or uint8 0..255 (scaled by 1/255 on the device)."""


#: a loaded model: the Protocol of its kind (`kind` says which)
ServedModel = Union[ImageDecoder, VideoDecoder, ImageEncoder]


def card_fields(model, architecture: str, **fields) -> dict:
    """The card entries every model has (name, kind, architecture, preset, weights, backend, dtype),
    then `fields`, which may replace one of them in place."""
    b = model.backend
    return {"name": model.name, "kind": model.kind, "architecture": architecture, "preset": model.preset,
            "weights": model.weights_source, "backend": b.name, "dtype": b.dtype, **fields}


def example_input(model: Model, rng: np.random.Generator, *, n: int = 1, pixels: tuple[int, int] | None = None,
                  latents: tuple[int, int] | None = None, frames: int = 2) -> np.ndarray:
    """A random batch of `n` inputs `model` takes (warm-up, benchmarks). Decoders: latents of
    `latents` (h, w), or the grid that decodes to about `pixels` (H, W), default 8x8; video
    decoders with `frames` latent frames (2 covers the first-frame and later chunk shapes).
    Encoders: images of `pixels`, default their input_size."""
    if model.kind == IMAGE_ENCODER:
        h, w = pixels or (int(model.input_size),) * 2
        return rng.random((n, h, w, 3), dtype=np.float32)
    if model.kind not in (IMAGE_DECODER, VIDEO_DECODER):
        raise ValueError(f"model {model.name}: unknown kind {model.kind!r}")
    f = int(model.spatial_factor)
    hw = latents or ((max(1, pixels[0] // f), max(1, pixels[1] // f)) if pixels else (8, 8))
    t = (frames,) if model.kind == VIDEO_DECODER else ()
    return rng.standard_normal((n, model.latent_channels, *t, *hw)).astype(np.float32)


def forward(model: Model, x: np.ndarray):
    """The model's own call on an example_input: encode for encoders, decode (its defaults) for decoders."""
    return model.encode(x) if model.kind == IMAGE_ENCODER else model.decode(x)
