"""diffusers `AutoencoderKLQwenImage` (the Qwen-Image VAE) as an image VAE: the Qwen-Image VAE
family's presets, config and model (its `FAMILY` is in the package's __init__.py).

Qwen-Image's VAE is a fine-tuned Wan 2.1 video VAE: its decoder has the Wan 2.1 blocks and
parameter names (`post_quant_conv`, `decoder.*`; no residual up blocks, no patching), and its
config.json the Wan 2.1 fields, with `input_channels` for the RGB channel count. The model is
therefore the Wan VAE decoder (models/wan_vae/model.py) run on one latent frame, with the Qwen-Image
pipeline's latent handling around it:

    decode: x (N, 16, h, w) or (N, 16, 1, h, w), normalised
            -> x / (1 / latents_std) + latents_mean     (the pipeline's de-normalisation, per channel)
            -> the Wan causal decoder on that one frame -> frame 0 -> images (N, 8h, 8w, 3) in [0, 1]

    encode: images (N, H, W, 3) in [0, 1] -> x * 2 - 1 -> the Wan encoder on one frame + quant_conv
            -> posterior mean -> (mean - latents_mean) / latents_std -> (N, 16, H/8, W/8)
            (the edit pipeline's _encode_vae_image, argmax latents)

Decode tiling is the Wan VAE's size-and-stride rule (diffusers' AutoencoderKLQwenImage.tiled_decode is
AutoencoderKLWan's), applied to the one frame; encode tiles as its tiled_encode does. The encoder is there when the
checkpoint holds its tensors (diffusers or original-Wan naming, as ComfyUI's single file) and with
random weights; `has_encoder` says so.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from convkernels import Backend

from ..contract import IMAGE_DECODER, PIXEL_RANGE, SINGLE_FRAME_LATENTS, card_fields
from ..nn import interrupt, row_shard
from ..nn.module import random_state_dict
from ..nn.tiling import tiled_map
from ..nn.weights import ModelConfigError
from ..wan_vae.checkpoint import normalize_keys
from ..wan_vae.encoder import EncoderTree
from ..wan_vae.layers import FeatureCache
from ..wan_vae.model import INIT_RULES, WAN21_LATENTS_MEAN, WAN21_LATENTS_STD, WanVAEConfig, WanVAEDecoder, WanVAEOptions

__all__ = ["DESCRIPTIONS", "PRESETS", "QwenImageVAEConfig", "QwenImageVAEDecoder", "QwenImageVAEOptions",
           "normalize_keys"]

PRESETS: dict[str, dict] = {
    # diffusers AutoencoderKLQwenImage defaults == Qwen/Qwen-Image, subfolder vae
    "qwen-image-vae": {
        "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_scales": [],
        "temperal_downsample": [False, True, True], "dropout": 0.0, "input_channels": 3,
        "latents_mean": WAN21_LATENTS_MEAN, "latents_std": WAN21_LATENTS_STD,
    },
    "tiny-qwen-image-vae": {
        "base_dim": 8, "z_dim": 16, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1, "attn_scales": [],
        "temperal_downsample": [False, True, True], "dropout": 0.0, "input_channels": 3,
        "latents_mean": [round(0.1 * ((7 * i) % 11 - 5), 2) for i in range(16)],
        "latents_std": [round(0.6 + 0.15 * ((5 * i) % 13), 2) for i in range(16)],
    },
}

DESCRIPTIONS = {
    "qwen-image-vae": "Qwen-Image VAE (Qwen/Qwen-Image/vae, AutoencoderKLQwenImage: the Wan 2.1 "
                      "decoder and encoder on one frame; 16 latent channels, 8x space)",
    "tiny-qwen-image-vae": "tiny Qwen-Image-architecture VAE for tests and CPU demos "
                           "(16 latent channels; 16x16 latents -> 128x128 in well under a second on 2 cores)",
}

#: Qwen-Image's largest published resolution (1328x1328) decodes untiled unless asked, as in diffusers
DEFAULT_MAX_UNTILED_PIXELS = 1328 * 1328


def encoded_side(size: int, spatial_factor: int) -> int:
    """The latent side the encoder makes of `size` pixels: each 2x down is a 3x3 stride-2 conv after
    a (0, 1) zero pad, floor((n - 2) / 2) + 1."""
    while spatial_factor > 1:
        size, spatial_factor = (size - 2) // 2 + 1, spatial_factor // 2
    return size


@dataclass(frozen=True)
class QwenImageVAEConfig(WanVAEConfig):
    """The fields of diffusers' AutoencoderKLQwenImage config.json that shape the decoder: the Wan
    2.1 ones, with `input_channels` (RGB in and out) for Wan's in_channels/out_channels."""

    input_channels: int = 3
    latents_mean: tuple[float, ...] = tuple(WAN21_LATENTS_MEAN)
    latents_std: tuple[float, ...] = tuple(WAN21_LATENTS_STD)

    def validate(self) -> None:
        if self.input_channels != 3:
            raise ModelConfigError(f"AutoencoderKLQwenImage config: input_channels must be 3 (RGB), "
                             f"got {self.input_channels}")
        super().validate()


@dataclass(frozen=True)
class QwenImageVAEOptions(WanVAEOptions):
    """The Wan VAE's settings (tile size and stride in output pixels), with a larger untiled limit."""

    #: tiled=None tiles only images above this many output pixels
    max_untiled_pixels: int = DEFAULT_MAX_UNTILED_PIXELS


class QwenImageVAEDecoder(WanVAEDecoder):
    """Image decoder per docs/interfaces.md: the Qwen-Image pipeline's normalised latents
    (N, 16, h, w) or (N, 16, 1, h, w) -> float32 images (N, 8h, 8w, 3) in [0, 1]; and, when the
    checkpoint has the encoder (`has_encoder`), images -> normalised latents."""

    kind = IMAGE_DECODER
    architecture = "diffusers AutoencoderKLQwenImage (Qwen-Image VAE: the Wan 2.1 causal VAE on one frame)"
    reference_class = "AutoencoderKLQwenImage"

    def __init__(self, name: str, preset: str, backend: Backend, cfg: QwenImageVAEConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: QwenImageVAEOptions | None = None):
        options = options or QwenImageVAEOptions()
        super().__init__(name, preset, backend, cfg, tensors, weights_source, options)
        #: the untiled, unsharded decode of the one frame, recorded as one CUDA graph where the backend
        #: records (the video decode records only its steady frames, and an image has none)
        self._frame_device = backend.graphed(self._frame_forward)
        # the pipeline's own form: latents_std = 1 / std (float32), then latents / latents_std + mean
        self._inv_std = np.float32(1.0) / self._std
        self.encoder_tree = self._encoder_tree(cfg)
        wanted = self.encoder_tree.expected_shapes()
        encoder = random_state_dict(wanted, options.seed + 1, INIT_RULES) if tensors is None else \
            normalize_keys(tensors, cfg)
        self.has_encoder = any(k in encoder for k in wanted)
        if self.has_encoder:
            self.encoder_tree.load_checked(encoder, backend, f"{self.reference_class} encoder (preset {preset!r})",
                                           ignore_unexpected=("decoder.", "post_quant_conv."))

    def _denormalise(self, lat: np.ndarray) -> np.ndarray:
        return lat / self._inv_std + self._mean

    def _encoder_tree(self, cfg) -> EncoderTree:
        """The checkpoint's encoder side, before it loads (Qwen-Image 2.1's is residual, with frame convs)."""
        return EncoderTree(cfg.base_dim, cfg.z_dim, cfg.dim_mult, cfg.num_res_blocks, cfg.temperal_downsample,
                           cfg.input_channels)

    def _one_frame(self, latents) -> np.ndarray:
        lat = np.asarray(latents)
        if lat.ndim == 4:
            return lat[:, :, None]
        if lat.ndim == 5 and lat.shape[2] == 1:
            return lat
        raise ValueError(f"{self.name}: latents must be (N, {self.latent_channels}, h, w) or "
                         f"(N, {self.latent_channels}, 1, h, w), got {lat.shape}")

    def decode(self, latents_nchw, tiled: bool | None = None, clamp: bool = True, *,
               uint8: bool = False) -> np.ndarray:
        """float32 (N, 8h, 8w, 3) in [0, 1]; uint8=True: uint8. The output is always clamped, as
        diffusers' AutoencoderKLQwenImage.decode clamps (clamp=False changes nothing). tiled: the
        Wan VAE's tiles (None: only above max_untiled_pixels)."""
        return self._decode_image(latents_nchw, tiled, uint8)

    def _decode_image(self, latents, tiled: bool | None, uint8: bool, channels: int | None = None) -> np.ndarray:
        """The one frame's pixels (N, H, W, C), clamped; channels: its first that many only.
        Untiled and unsharded, it is one recorded forward whose output is cut to `channels`,
        clipped and widened on the device and copied once into the array returned. The video
        decode's way (frame groups joined, then frame 0 and the channels cut on the host) cost
        about a fifth of a Qwen-Image 2.1 1328^2 decode's 98 ms in host copies (one H200,
        2026-11-29: 70 ms of kernels); the tiled and sharded decodes still take it."""
        lat = self._one_frame(latents)
        z = self._prepare(lat)
        _, _, h, w, _ = z.shape
        sf = self.spatial_factor
        if tiled is None:
            tiled = h * w * sf * sf > self.max_untiled_pixels
        if row_shard.current() is not None or (tiled and self._tile_plan(h, w) is not None):
            out = WanVAEDecoder.decode(self, lat, tiled, uint8=uint8)[:, 0]
            return out if channels is None else np.ascontiguousarray(out[..., :channels])
        b = self.backend
        interrupt.check()  # its requesters gone: not started (as the video decode checks before each group)
        out = self._frame_device(b.asarray(z[:, 0:1]))
        if channels is not None and channels < out.shape[-1]:
            out = b.slice(out, -1, 0, channels)
        return b.to_host_async(out, PIXEL_RANGE, uint8=uint8).result()[:, 0]

    def _frame_forward(self, x):
        """One de-normalised latent frame (device N, 1, h, w, C) -> its frame (N, 1, H, W, C)."""
        return self._frames(self.tree.decoder(self.tree.post_quant_conv(x), FeatureCache()))

    def encode(self, images_nhwc01: np.ndarray, tiled: bool | None = None) -> np.ndarray:
        """Images (N, H, W, 3) in [0, 1] -> normalised latents (N, 16, H/8, W/8) (sides floored at each
        2x, as the stride-2 convs do): (posterior mean - latents_mean) / latents_std. tiled: True =
        diffusers' tiled_encode (the decode's tile size and stride, in pixels; blended over their
        difference in latents) when larger than one tile, False = never, None = only above
        max_untiled_pixels."""
        if not self.has_encoder:
            raise RuntimeError(f"{self.name}: the checkpoint has no encoder weights")
        x = self._encoder_pixels(images_nhwc01)
        f = self.spatial_factor
        h, w = x.shape[1:3]
        t = self.tiling
        if tiled is None:
            tiled = h * w > self.max_untiled_pixels
        if tiled and (h > t.tile_px or w > t.tile_px):
            blend = (t.tile_px - t.stride_px) // f
            mean = tiled_map(self._encode_mean, x, t.tile_px, t.stride_px, blend, t.stride_px // f,
                             lambda size: encoded_side(size, f))
        else:
            mean = self._encode_mean(x)
        return np.ascontiguousarray((mean.transpose(0, 3, 1, 2) - self._mean[:, :, 0]) / self._std[:, :, 0])

    def _encoder_pixels(self, images_nhwc01) -> np.ndarray:
        """Validated images as the encoder takes them: float32 x * 2 - 1, N,H,W,C."""
        img = np.asarray(images_nhwc01, dtype=np.float32)
        f = self.spatial_factor
        if img.ndim != 4 or img.shape[-1] != 3 or img.shape[0] < 1 or min(img.shape[1:3]) < f:
            raise ValueError(f"{self.name}: images must be (N, H, W, 3) with H, W >= {f}, got {img.shape}")
        return np.ascontiguousarray(np.float32(2.0) * img - np.float32(1.0))

    def _encode_mean(self, x_nhwc: np.ndarray) -> np.ndarray:
        """Images (N, H, W, 3) in [-1, 1] -> the posterior mean (N, h, w, C), host float32: the Wan
        encoder on one frame, quant_conv included. Linear in what a tile blend mixes, so blending
        the means is blending the moments, as diffusers does."""
        b = self.backend
        moments = np.asarray(b.to_host(self.encoder_tree(b.asarray(np.ascontiguousarray(x_nhwc[:, None])))),
                             np.float32)
        return moments[:, 0, :, :, :self.latent_channels]

    def card(self) -> dict:
        return card_fields(self, self.architecture, weights_naming=self.weights_naming, has_encoder=self.has_encoder,
                           latent_channels=self.latent_channels, spatial_factor=self.spatial_factor,
                           input="normalised latents (N, C, h, w) or (N, C, 1, h, w); decode applies "
                                 "latents / (1 / latents_std) + latents_mean",
                           output=f"float32 (N, {self.spatial_factor}h, {self.spatial_factor}w, 3) in [0, 1] "
                                  "(frame 0 of the Wan decoder)",
                           limits={"tile_sample_min_size": self.tiling.tile_px,
                                   "tile_sample_stride": self.tiling.stride_px,
                                   "max_untiled_pixels": self.max_untiled_pixels},
                           config=self.config.as_dict(), **{SINGLE_FRAME_LATENTS: True})
