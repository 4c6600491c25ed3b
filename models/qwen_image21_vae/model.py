"""diffusers `AutoencoderKLQwenImage21` (the Qwen-Image 2.1 VAE) as an image VAE.

The class is the Wan 2.2 residual VAE (residual up and down blocks with parameter-free DupUp3D /
AvgDown3D shortcuts, a decoder wider than the encoder) at five levels (16x, no patch), with 2-D
convs in place of the causal 3-D ones (layers.py): it takes one frame only (its conv refuses a
feature cache, so a second frame fails in diffusers). It is therefore served as the Qwen-Image VAE
is (models/qwen_image_vae): an image decoder taking (N, 64, h, w) or (N, 64, 1, h, w), with the
Qwen-Image 2.1 pipeline's latent handling around it:

    decode: x (N, 64, h, w) or (N, 64, 1, h, w), as the pipeline holds them after _unpack_latents
            -> x * latents_std + latents_mean       (the 2.1 pipeline's de-normalisation, per channel)
            -> post_quant_conv, the residual decoder on that one frame -> clamp to [-1, 1]
            -> x / 2 + 0.5 (folded into conv_out)   -> RGBA (N, 16h, 16w, 4) in [0, 1] (decode_rgba)
            decode() gives its first three channels, RGB (N, 16h, 16w, 3), as every image decoder's
            decode does; the service serves decode_rgba's four (the pipeline's PIL output is RGBA:
            alpha is the fourth channel), or RGB where a request asks (docs/api.md, `channels`).

    encode: images (N, H, W, 3 or 4) in [0, 1], H and W multiples of 16 (RGB gets an opaque alpha, as
            the pipeline's convert("RGBA") gives it) -> x * 2 - 1 -> the residual encoder on one frame
            + quant_conv -> posterior mean -> (mean - latents_mean) / latents_std -> (N, 64, H/16, W/16)
            (the pipeline's _encode_vae_image, argmax latents)

Tiling is diffusers' (AutoencoderKLQwenImage21.tiled_decode / tiled_encode are AutoencoderKLWan's),
as the Qwen-Image VAE applies it.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from convkernels import Backend

from ..contract import ROW_MAJOR_TOKENS, SINGLE_FRAME_LATENTS
from ..nn.weights import WeightsError
from ..qwen_image_vae.model import QwenImageVAEDecoder
from ..wan22_vae.encoder import ResidualEncoder3d
from ..wan22_vae.layers import ResidualDecoder3d
from ..wan_vae.checkpoint import checkpoint_naming
from ..wan_vae.encoder import EncoderTree
from .config import RGBA, QwenImage21VAEConfig, QwenImage21VAEOptions
from .layers import frame_convs

__all__ = ["QwenImage21VAEModel"]

RGB = 3


class QwenImage21VAEModel(QwenImageVAEDecoder):
    """Image decoder per docs/interfaces.md: the Qwen-Image 2.1 pipeline's normalised latents
    (N, 64, h, w) or (N, 64, 1, h, w) -> float32 RGBA images (N, 16h, 16w, 4) in [0, 1]
    (decode_rgba; decode: their RGB); and, when the checkpoint has the encoder (`has_encoder`),
    images -> latents. An AlphaDecoder (models/contract.py)."""

    architecture = ("diffusers AutoencoderKLQwenImage21 (Qwen-Image 2.1 VAE: the Wan 2.2 residual VAE on one "
                    "frame with 2-D convs, RGBA)")
    reference_class = "AutoencoderKLQwenImage21"
    decoder_class = ResidualDecoder3d
    decodes_alpha = True  # models/contract.py AlphaDecoder: the service serves decode_rgba's four channels

    def __init__(self, name: str, preset: str, backend: Backend, cfg: QwenImage21VAEConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: QwenImage21VAEOptions | None = None):
        if tensors is not None and checkpoint_naming(tensors) != "diffusers":
            raise WeightsError(f"{weights_source or 'checkpoint'}: give the Qwen-Image 2.1 VAE in diffusers naming "
                               "(Qwen/Qwen-Image-2.1, subfolder vae)")
        super().__init__(name, preset, backend, cfg, tensors, weights_source, options)

    def _decoder_tree(self, cfg):
        return frame_convs(super()._decoder_tree(cfg))

    def _encoder_tree(self, cfg) -> EncoderTree:
        return frame_convs(EncoderTree(cfg.base_dim, cfg.z_dim, cfg.dim_mult, cfg.num_res_blocks,
                                       cfg.temperal_downsample, cfg.in_channels, ResidualEncoder3d))

    def _denormalise(self, lat: np.ndarray) -> np.ndarray:
        # the 2.1 pipeline's own form: latents * latents_std + latents_mean (float32)
        return lat * self._std + self._mean

    def decode_rgba(self, latents_nchw, tiled: bool | None = None, *, uint8: bool = False) -> np.ndarray:
        """All four channels the pipeline decodes: float32 (N, 16h, 16w, 4) in [0, 1] (uint8=True: uint8)."""
        return self._decode_image(latents_nchw, tiled, uint8)

    def decode(self, latents_nchw, tiled: bool | None = None, clamp: bool = True, *,
               uint8: bool = False) -> np.ndarray:
        """RGB (N, 16h, 16w, 3) in [0, 1]: decode_rgba's first three channels. Always clamped, as
        diffusers' decode clamps (clamp=False changes nothing)."""
        return self._decode_image(latents_nchw, tiled, uint8, channels=RGB)  # alpha dropped on the device

    def _encoder_pixels(self, images_nhwc01) -> np.ndarray:
        """RGB or RGBA images -> the encoder's RGBA in [-1, 1]; RGB gets alpha 1 (opaque)."""
        img = np.asarray(images_nhwc01, dtype=np.float32)
        f = self.spatial_factor
        if img.ndim != 4 or img.shape[-1] not in (RGB, RGBA) or min(img.shape) < 1:
            raise ValueError(f"{self.name}: images must be (N, H, W, 3) or (N, H, W, 4), got {img.shape}")
        if img.shape[1] % f or img.shape[2] % f:
            raise ValueError(f"{self.name}: height and width must be multiples of {f} (the encoder's "
                             f"shortcuts average 2x2 blocks), got {img.shape[1]}x{img.shape[2]}")
        if img.shape[-1] == RGB:
            img = np.concatenate([img, np.ones((*img.shape[:3], 1), np.float32)], axis=-1)
        return np.ascontiguousarray(np.float32(2.0) * img - np.float32(1.0))

    def card(self) -> dict:
        card = super().card()
        f = self.spatial_factor
        card.update(input="normalised latents (N, C, h, w) or (N, C, 1, h, w), as the Qwen-Image 2.1 pipeline "
                          "holds them after _unpack_latents; decode applies latents * latents_std + latents_mean",
                    output=f"float32 RGBA (N, {f}h, {f}w, 4) in [0, 1], the pipeline's four channels (alpha "
                           "last); channels=rgb asks for the first three, and JPEG, which holds no alpha, "
                           "gets those",
                    pixel_channels={"decoded": RGBA, "served": RGBA, "on_request": RGB},
                    # the 2.1 pipeline packs unpatched latents as row-major tokens (B, h * w, C), as FLUX.2's
                    packed_latents=ROW_MAJOR_TOKENS,
                    **{SINGLE_FRAME_LATENTS: True})
        if self.has_encoder:
            card["encode"] = (f"images (N, H, W, 3 or 4) in [0, 1], H and W multiples of {f}; RGB gets alpha 1 -> "
                              f"(N, C, H/{f}, W/{f}): (mean - latents_mean) / latents_std")
        return card
