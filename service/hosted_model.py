"""Loading, warming up and describing the served models (through models.load_model and the typed
model contract, models/contract.py, only)."""
from __future__ import annotations

import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from models.contract import (IMAGE_DECODER, IMAGE_ENCODER, SINGLE_FRAME_LATENTS, VIDEO_DECODER, ImageDecoder, Kind,
                             Model, PerChannelLatents, ServedModel, VideoDecoder, example_input, forward)

from . import metrics
from .settings import ModelEntry

if TYPE_CHECKING:  # front ends import this module and never load a backend
    from convkernels import Backend

log = logging.getLogger("convserve.models")

__all__ = ["IMAGE_DECODER", "IMAGE_ENCODER", "VIDEO_DECODER", "HostedModel", "ModelView", "load_entry", "warm_up"]


@dataclass(frozen=True)
class ModelView:
    """A served model as an HTTP front end sees it: the attributes of models/contract.py that the
    service reads and the model's card, copied by the model worker that loaded it (the model
    itself, its weights and its backend stay in that worker's process). It follows the contract's
    `Model` Protocol; the kind's attributes it copies are None where the kind has none."""
    name: str
    kind: Kind
    card_doc: dict
    weights_source: str | None
    weights_provenance: dict | None
    latent_channels: int | None = None
    spatial_factor: int | None = None
    temporal_factor: int | None = None
    has_encoder: bool = False
    input_size: int | None = None
    embed_dim: int | None = None
    labels: list[str] | None = None
    #: models.sharding's family name (a decode can be split over devices), None where none is written
    shard_family: str | None = None
    #: per-channel latent statistics (latents_mean, latents_std) of a PerChannelLatents decoder, else None
    latent_stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None

    _ATTRS = ("latent_channels", "spatial_factor", "temporal_factor", "has_encoder", "input_size", "embed_dim",
              "labels", "latent_stats")

    @classmethod
    def of(cls, model: ServedModel) -> "ModelView":
        from models import sharding

        return cls(model.name, model.kind, model.card(), model.weights_source, model.weights_provenance,
                   **{a: getattr(model, a) for a in cls._ATTRS if hasattr(model, a)},
                   shard_family=getattr(sharding.family(model), "name", None))

    def card(self) -> dict:
        return dict(self.card_doc)


@dataclass
class HostedModel:
    entry: ModelEntry
    #: typed by models/contract.py: in the model worker that loaded it, the model itself (a
    #: ServedModel: ImageDecoder, VideoDecoder or ImageEncoder, as its `kind` says); on a front end,
    #: its ModelView (the same attributes and card, no calls)
    model: Model
    load_seconds: float
    warmup_seconds: float | None = None
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.model, Model):
            raise TypeError(f"{self.entry.name}: a {type(self.model).__name__} does not follow the model "
                            "contract (models/contract.py Model)")

    @property
    def name(self) -> str:
        return self.entry.name

    @property
    def kind(self) -> str:
        return self.model.kind

    @property
    def is_decoder(self) -> bool:
        return self.kind in (IMAGE_DECODER, VIDEO_DECODER)

    @property
    def is_video(self) -> bool:
        return self.kind == VIDEO_DECODER

    @property
    def can_encode(self) -> bool:
        """Pixels -> latents: a VAE (images, or a video VAE's frames) whose checkpoint holds the encoder."""
        return self.is_decoder and bool(getattr(self.model, "has_encoder", False))

    @property
    def labels(self) -> list[str] | None:
        return self.model.labels if self.kind == IMAGE_ENCODER else None

    @property
    def single_frame_latents(self) -> bool:
        """An image decoder that also takes one-frame latents N,C,1,h,w (card `single_frame_latents`)."""
        return self.kind == IMAGE_DECODER and bool(self.model.card().get(SINGLE_FRAME_LATENTS))

    @property
    def per_channel_scaling(self) -> bool:
        """Wan-family latents (the Wan VAE, the Qwen-Image VAE): normalised by the config's
        latents_mean/latents_std per channel instead of a scaling/shift factor."""
        return self.is_video or self.single_frame_latents

    @property
    def latent_ndim(self) -> int:
        return 5 if self.is_video else 4

    @property
    def latent_layout(self) -> str:
        return "N,C,T,H,W" if self.is_video else "N,C,H,W"

    @property
    def output_name(self) -> str:
        """The KServe tensor a decoder answers."""
        return "frames" if self.is_video else "images"

    def output_shape(self, latent_shape: tuple[int, ...]) -> tuple[int, ...]:
        """What decoding latents of this shape gives: N,H,W,3 or N,F,H,W,3."""
        m, n, hw = self.model, latent_shape[0], latent_shape[-2:]
        frames = (1 + m.temporal_factor * (latent_shape[2] - 1),) if self.is_video else ()
        return (n, *frames, hw[0] * m.spatial_factor, hw[1] * m.spatial_factor, 3)

    def encoded_shape(self, pixels_shape: tuple[int, ...]) -> tuple[int, ...]:
        """What a VAE encoder gives images N,H,W,3: N,C,h,w, each side halved (floored) once per
        2x of the spatial factor, as its stride-2 downsamplers do; a video VAE's frames N,F,H,W,3
        (F = 1 + tk, sides multiples of the spatial factor s): N,C,1+k,H/s,W/s."""
        m = self.model
        if self.is_video:
            n, f, h, w = pixels_shape[:4]
            t, s = int(m.temporal_factor), int(m.spatial_factor)
            return (n, m.latent_channels, 1 + (f - 1) // t, h // s, w // s)
        n, h, w = pixels_shape[0], pixels_shape[1], pixels_shape[2]
        for _ in range(int(m.spatial_factor).bit_length() - 1):
            h, w = h // 2, w // 2
        return (n, m.latent_channels, h, w)

    def encoder_outputs(self, rows: int) -> dict[str, tuple[tuple[int, ...], str]]:
        """An image encoder's outputs for `rows` images: name -> (shape, dtype)."""
        outs = {"embedding": ((rows, int(self.model.embed_dim)), "float32")}
        if self.extra.get("logits_dim"):
            outs["logits"] = ((rows, int(self.extra["logits_dim"])), "float32")
        return outs

    def decode(self, latents: np.ndarray, tiled: bool | None, clamp: bool, uint8: bool = False) -> np.ndarray:
        """uint8: the pixels come off the device as uint8 (what image and video files hold)."""
        # video decoders always clamp, as diffusers' AutoencoderKLWan does
        if self.is_video:
            return cast(VideoDecoder, self.model).decode(latents, tiled=tiled, uint8=uint8)
        return cast(ImageDecoder, self.model).decode(latents, tiled=tiled, clamp=clamp, uint8=uint8)

    def latent_scaling(self) -> tuple[np.ndarray | float, np.ndarray | float]:
        """(scale, shift) of the model's input normalisation, per channel where it has one: its
        decode() sees z = latents / scale + shift. Image VAEs: scaling/shift factor; Wan and
        Qwen-Image: the pipeline's latents * std + mean, i.e. scale = 1/std, shift = mean (shaped
        1,C,1,1,1, or 1,C,1,1 for an image decoder's N,C,h,w)."""
        if self.per_channel_scaling:
            mean, std = cast(PerChannelLatents, self.model).latent_stats
            shape = (1, -1) + (1,) * (self.latent_ndim - 2)
            std = np.asarray(std, np.float64).reshape(shape)
            return 1.0 / std, np.asarray(mean, np.float64).reshape(shape)
        card = self.model.card()
        return float(card["scaling_factor"]), float(card.get("shift_factor") or 0.0)

    def tensors(self) -> tuple[list[dict], list[dict]]:
        """KServe v2 input/output tensor metadata (-1 = any size)."""
        m = self.model
        if self.is_decoder:
            video = self.is_video
            return ([{"name": "latents", "datatype": "FP32", "shape": [-1, m.latent_channels, *[-1] * (2 + video)],
                      "layout": self.latent_layout.replace(",", ""), "accepts": ["FP32", "FP16", "BF16", "FP64"]}],
                    [{"name": self.output_name, "datatype": "FP32", "shape": [-1] * (3 + video) + [3],
                      "layout": "NFHWC" if video else "NHWC", "range": [0, 1]}])
        outs = [{"name": "embedding", "datatype": "FP32", "shape": [-1, m.embed_dim]}]
        if self.labels is not None or self.extra.get("has_logits"):
            outs.append({"name": "logits", "datatype": "FP32", "shape": [-1, -1]})
        return ([{"name": "pixels", "datatype": "FP32", "shape": [-1, -1, -1, 3], "layout": "NHWC",
                  "range": [0, 1], "resized_to": [m.input_size, m.input_size],
                  "accepts": ["FP32", "FP16", "UINT8"]}], outs)

    def card(self) -> dict:
        card = dict(self.model.card())
        inputs, outputs = self.tensors()
        card.update({
            "name": self.name, "kind": self.kind, "preset": self.entry.preset,
            "load_seconds": round(self.load_seconds, 4),
            "warmup_seconds": None if self.warmup_seconds is None else round(self.warmup_seconds, 4),
            "inputs": inputs, "outputs": outputs,
        })
        if not self.entry.weights and "weights" not in card:
            card["weights"] = "random init"
        provenance = self.model.weights_provenance
        if provenance:  # Hub weights: repository, resolved commit and file hashes, to pin a deployment
            card["hub"] = provenance
        return card


def load_entry(entry: ModelEntry, backend: Backend, tile_size: int | None = None,
               device: str = "local") -> HostedModel:
    from models import ModelOptions, load_model  # the models layer; imported late so settings errors come first

    t0 = time.perf_counter()
    model = load_model(entry.name, entry.preset, backend, weights=entry.weights,
                       options=ModelOptions(tile_size=tile_size))
    secs = time.perf_counter() - t0
    metrics.MODEL_LOAD_SECONDS.labels(entry.name).set(secs)
    metrics.MODEL_LOADS.labels(entry.name, device).inc()
    log.info("loaded %s (preset %s, %s) in %.2fs", entry.name, entry.preset,
             model.weights_source or entry.weights or "random init", secs)
    return HostedModel(entry, model, secs)


def warm_up(hm: HostedModel, sizes: list[tuple[int, int]] = (), calls_per_size: int = 1,
            batches: tuple[int, ...] = (1,)) -> None:
    """One small call per model, so first requests do not pay for path choice and allocation;
    then `calls_per_size` calls per requested image size (H, W) (2 where the backend records a
    CUDA graph on the second call) and per batch size in `batches` (the sizes the batcher runs:
    each is a new shape for the kernels' plans and graphs): decoders produce it (rounded down to
    their latent grid; video decoders two latent frames, which covers the first-frame and later
    chunk shapes, at batch 1 only), encoders take it, as float and as uint8 pixels."""
    m = cast(ServedModel, hm.model)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    out = forward(m, example_input(m, rng))
    if hm.kind == IMAGE_ENCODER:
        logits = out.get("logits")
        hm.extra["has_logits"] = logits is not None
        hm.extra["logits_dim"] = None if logits is None else int(logits.shape[1])
    for (h, w), n in itertools.product(sizes, (1,) if hm.is_video else batches):
        t1 = time.perf_counter()
        x = example_input(m, rng, n=n, pixels=(h, w))
        for _ in range(calls_per_size):
            forward(m, x)
            if hm.kind == IMAGE_ENCODER:  # uint8 pixels take a forward of their own
                forward(m, (x * 255).astype(np.uint8))
        log.info("warmed up %s at %dx%d, batch %d, in %.2fs", hm.name, h, w, n, time.perf_counter() - t1)
    hm.warmup_seconds = time.perf_counter() - t0
    metrics.MODEL_WARMUP_SECONDS.labels(hm.name).set(hm.warmup_seconds)
    log.info("warmed up %s in %.2fs", hm.name, hm.warmup_seconds)
