"""diffusers `AutoencoderKLHunyuanImage` (the HunyuanImage 2.1 VAE) on the backend interface.

What the pipeline does around the VAE (diffusers' HunyuanImagePipeline):
    decode: latents / vae.config.scaling_factor -> vae.decode -> (x / 2 + 0.5).clamp(0, 1)
            (no shift factor); this model takes the latents as the pipeline holds them before that
            division and does the rest, x / 2 + 0.5 folded into conv_out.
    encode: the text-to-image pipeline never encodes; encode returns the posterior mean times
            scaling_factor (what decode takes back), the pipelines' usual `retrieve_latents(...,
            "argmax") * scaling_factor`.
Tiling is diffusers' own rule for this class (tile_latent_min_size = sample_size / 32, overlap
0.25: the image VAE's, models/nn/tiling.py). Its tiled encode reads 5-D inputs and fails on
images in diffusers, so encode tiles are refused here rather than invented.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from convkernels import Backend, pixels_to_uint8

from ..contract import IMAGE_DECODER, PIXEL_RANGE, card_fields
from ..nn import row_shard, tiling
from ..nn.module import Module, random_state_dict
from ..nn.weights import fold_output_affine
from .config import HunyuanImageVAEConfig, HunyuanImageVAEOptions
from .layers import Decoder, Encoder

#: random init: U(+-1/sqrt(fan_in)) as PyTorch's default, norms identity
INIT_RULES = ((r"norm[^.]*\.weight$", "ones"), (r"norm[^.]*\.bias$", "zeros"), ("", "uniform"))


class HunyuanImageVAEModel:
    """An image decoder (and encoder when the checkpoint has one) per docs/interfaces.md.

    Also the shape of another family's image VAE scaled by one factor around a decoder and an
    encoder (models/dc_ae): a subclass names its parts below and its default tile."""

    kind = IMAGE_DECODER
    #: Hub weights only; load_model sets it (models/contract.py)
    weights_provenance: dict | None = None
    architecture = "diffusers AutoencoderKLHunyuanImage (HunyuanImage 2.1 VAE)"
    checkpoint_class = "AutoencoderKLHunyuanImage"
    decoder_class, encoder_class, options_class, init_rules = Decoder, Encoder, HunyuanImageVAEOptions, INIT_RULES
    #: why encode(tiled=True) is refused
    tiled_encode_refusal = "diffusers' AutoencoderKLHunyuanImage tiled_encode takes 5-D video input"

    @staticmethod
    def default_tile_latent(cfg) -> int:
        """diffusers: tile_latent_min_size = sample_size // spatial_compression_ratio"""
        return cfg.sample_size // cfg.spatial_factor

    def __init__(self, name: str, preset: str, backend: Backend, cfg: HunyuanImageVAEConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: HunyuanImageVAEOptions | None = None):
        options = options or self.options_class()
        self.name, self.preset, self.backend, self.config = name, preset, backend, cfg
        f = cfg.spatial_factor
        tile_latent = options.tile_latent_size
        if options.tile_size and not tile_latent:
            tile_latent = max(1, int(options.tile_size) // f)
        self.latent_channels, self.spatial_factor = cfg.latent_channels, f
        self.scaling_factor = float(cfg.scaling_factor)
        self.tiling = tiling.image_tiles(int(tile_latent or self.default_tile_latent(cfg)), f,
                                         float(options.tile_overlap_factor),
                                         int(options.memory_budget_bytes or backend.work_memory_budget))
        self.tree = Module()  # what the checkpoint holds, by its names
        self.decoder = self.tree.add("decoder", self.decoder_class(cfg))
        encoder_side = Module()
        self.encoder = encoder_side.add("encoder", self.encoder_class(cfg))
        encoder_shapes = encoder_side.expected_shapes()
        if tensors is None:
            self.weights_source = "random init"
            wanted = {**self.tree.expected_shapes(), **(encoder_shapes if options.with_encoder else {})}
            tensors = random_state_dict(wanted, options.seed, self.init_rules)
        else:
            self.weights_source = weights_source or "given tensors"
            prefix = "vae."  # a whole pipeline's state dict: only when every name has it
            if tensors and all(k.startswith(prefix) for k in tensors):
                tensors = {k[len(prefix):]: v for k, v in tensors.items()}
        # a decoder-only checkpoint is fine; a partial encoder is an error like any other gap
        self.has_encoder = any(k in tensors for k in encoder_shapes)
        if self.has_encoder:
            self.tree.add("encoder", self.encoder)
        else:
            self.encoder = None
        # VaeImageProcessor's x / 2 + 0.5 before its clip: done by conv_out itself
        self.tree.load_checked(fold_output_affine(tensors, "decoder.conv_out", 0.5, 0.5), backend,
                               f"{self.checkpoint_class} preset {preset!r}")
        # device latents -> device images; a backend may record and replay it (CUDA graphs)
        self._decode_device = backend.graphed(self.decoder.__call__)

    # ---- decode ----------------------------------------------------------------------------------
    def decode(self, latents_nchw: np.ndarray, tiled: bool | None = None, clamp: bool = True, *,
               uint8: bool = False) -> np.ndarray:
        """The pipeline's latents (N, C, h, w) -> float32 (N, f*h, f*w, 3) in [0, 1] (f = 32 for the
        real VAE). tiled: True = diffusers' tiling (when larger than one tile), False = never,
        None = when the untiled decode's estimated peak memory exceeds the budget. clamp=False skips
        the clip; uint8=True: convkernels.pixels_to_uint8 of the images (clamp implied)."""
        z = self.decoder_latents(latents_nchw)
        plan = tiling.plan_decode(self, z.shape, tiled)
        if plan is None:
            return self._decode_raw(z, PIXEL_RANGE if clamp or uint8 else None, uint8)
        out = tiling.tiled_decode(self._decode_raw, z, plan)  # tiles blend unclipped, as diffusers'
        if uint8:
            return pixels_to_uint8(out)
        if clamp:
            np.clip(out, *PIXEL_RANGE, out=out)
        return out

    def decoder_latents(self, latents_nchw) -> np.ndarray:
        """(N, C, h, w), checked -> latents / scaling_factor as the pipeline divides them (host
        float32 NHWC). Row-local (sharded decodes use it)."""
        lat = np.asarray(latents_nchw)
        if lat.ndim != 4 or lat.shape[1] != self.latent_channels:
            raise ValueError(f"{self.name}: latents must be (N, {self.latent_channels}, h, w), got {lat.shape}")
        return np.ascontiguousarray(lat.astype(np.float32).transpose(0, 2, 3, 1)) / np.float32(self.scaling_factor)

    def _decode_raw(self, z_nhwc: np.ndarray, clip=None, uint8: bool = False) -> np.ndarray:
        b = self.backend
        # a shard's forward runs eagerly: its collectives meet the other shards' as they come
        forward = self._decode_device if row_shard.current() is None else self.decoder
        return b.to_host_async(forward(b.asarray(z_nhwc)), clip, uint8=uint8).result()

    # ---- encode ----------------------------------------------------------------------------------
    def encode(self, images_nhwc01: np.ndarray, tiled: bool | None = None) -> np.ndarray:
        """Images (N, H, W, 3) in [0, 1], sides multiples of the spatial factor -> the posterior mean
        times scaling_factor (N, C, H/f, W/f), which decode takes back. Untiled: tiled=True is
        refused (diffusers' tiled encode of this class does not run on images)."""
        if not self.has_encoder:
            raise RuntimeError(f"{self.name}: the checkpoint has no encoder weights")
        if tiled:
            raise ValueError(f"{self.name}: tiled encode is not offered ({self.tiled_encode_refusal}); encode untiled")
        img = np.asarray(images_nhwc01, dtype=np.float32)
        f = self.spatial_factor
        if img.ndim != 4 or img.shape[-1] != self.config.in_channels or img.shape[1] % f or img.shape[2] % f:
            raise ValueError(f"{self.name}: images must be (N, H, W, {self.config.in_channels}) with H and W "
                             f"multiples of {f}, got {img.shape}")
        b = self.backend
        mean = b.to_host(self.encoder(b.asarray(img * np.float32(2.0) - np.float32(1.0))))
        lat = np.asarray(mean, np.float32) * np.float32(self.scaling_factor)
        return np.ascontiguousarray(lat.transpose(0, 3, 1, 2))

    # ---- description -----------------------------------------------------------------------------
    def smaller_tiling(self, current: tiling.TileSettings) -> tiling.TileSettings | None:  # models/contract.py
        return tiling.smaller_image_tiles(current, self.spatial_factor)

    def card(self) -> dict:
        t = self.tiling
        return card_fields(self, self.architecture, has_encoder=self.has_encoder,
                           latent_channels=self.latent_channels, spatial_factor=self.spatial_factor,
                           scaling_factor=self.scaling_factor, shift_factor=0.0,
                           limits={"tile_latent_size": t.tile_px // self.spatial_factor,
                                   "tile_overlap_factor": t.overlap,
                                   "memory_budget_bytes": t.memory_budget_bytes},
                           config=self.config.as_dict())
