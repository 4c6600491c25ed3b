"""A served model as every process of the service describes it, through the typed model contract
(models/contract.py) only: `HostedModel` (its entry, load and warm-up times, and the shapes,
tensors and card the adapters answer with) around either the model itself, in the model worker
that loaded it (service/worker/loading.py), or its `ModelView`, the copy of its attributes and card
a front end holds. Nothing here loads a model or a backend: a front end imports this module."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import numpy as np

from models.contract import (IMAGE_DECODER, IMAGE_ENCODER, SINGLE_FRAME_LATENTS, VIDEO_DECODER, AlphaDecoder,
                             ImageDecoder, Kind, Model, PerChannelLatents, VideoDecoder)

from .settings import ModelEntry

__all__ = ["IMAGE_DECODER", "IMAGE_ENCODER", "VIDEO_DECODER", "HostedModel", "ModelView"]


@dataclass(frozen=True)
class ModelView:
    """A served model as an HTTP front end sees it: the attributes of models/contract.py that the
    service reads and the model's card, copied by the model worker that loaded it (the model
    itself, its weights and its backend stay in that worker's process; service/worker/loading.py's
    `view_of` makes it). It follows the contract's `Model` Protocol; the kind's attributes it copies
    are None where the kind has none."""
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
    #: an AlphaDecoder's: it decodes RGBA (decode_rgba), served unless a request asks for RGB
    decodes_alpha: bool = False

    _ATTRS = ("latent_channels", "spatial_factor", "temporal_factor", "has_encoder", "input_size", "embed_dim",
              "labels", "latent_stats", "decodes_alpha")

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
        latents_mean/latents_std per channel instead of a scaling/shift factor. Read from the model's
        latent_stats, not its kind: a video VAE may scale by one factor (HunyuanVideo 1.5)."""
        return isinstance(self.model, PerChannelLatents) and self.model.latent_stats is not None

    @property
    def decodes_alpha(self) -> bool:
        """An image decoder that also decodes alpha (models/contract.py AlphaDecoder): RGBA pixels."""
        return self.kind == IMAGE_DECODER and bool(getattr(self.model, "decodes_alpha", False))

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

    def output_shape(self, latent_shape: tuple[int, ...], alpha: bool = False) -> tuple[int, ...]:
        """What decoding latents of this shape gives: N,H,W,3 or N,F,H,W,3; alpha: N,H,W,4 (RGBA)."""
        m, n, hw = self.model, latent_shape[0], latent_shape[-2:]
        frames = (1 + m.temporal_factor * (latent_shape[2] - 1),) if self.is_video else ()
        return (n, *frames, hw[0] * m.spatial_factor, hw[1] * m.spatial_factor, 4 if alpha else 3)

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

    def decode(self, latents: np.ndarray, tiled: bool | None, clamp: bool, uint8: bool = False,
               alpha: bool = False) -> np.ndarray:
        """uint8: the pixels come off the device as uint8 (what image and video files hold).
        alpha: an AlphaDecoder's RGBA (decode_rgba, always clamped) instead of its RGB."""
        if alpha:
            return cast(AlphaDecoder, self.model).decode_rgba(latents, tiled=tiled, uint8=uint8)
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
            video, alpha = self.is_video, self.decodes_alpha
            return ([{"name": "latents", "datatype": "FP32", "shape": [-1, m.latent_channels, *[-1] * (2 + video)],
                      "layout": self.latent_layout.replace(",", ""), "accepts": ["FP32", "FP16", "BF16", "FP64"]}],
                    [{"name": self.output_name, "datatype": "FP32", "shape": [-1] * (3 + video) + [4 if alpha else 3],
                      "layout": "NFHWC" if video else "NHWC", "range": [0, 1],
                      # RGBA by default; the `channels` option's values, the default first (docs/api.md)
                      **({"channels": ["rgba", "rgb"]} if alpha else {})}])
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
