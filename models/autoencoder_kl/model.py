"""diffusers `AutoencoderKL` (SD 1.x/2.x, SDXL, FLUX image VAEs) on the backend interface: the
image-VAE family's model (its presets and config are in config.py).

The layer tree mirrors diffusers' module names exactly, so a diffusers checkpoint loads by name:
`post_quant_conv`, `decoder.{conv_in, mid_block, up_blocks, conv_norm_out, conv_out}` and, when
the checkpoint holds it, `encoder.*` + `quant_conv`.
"""
from __future__ import annotations

import logging
from typing import Mapping

import numpy as np

from convkernels import Backend, pixels_to_uint8

from ..contract import IMAGE_DECODER, PIXEL_RANGE, card_fields
from ..nn import interrupt, row_shard, tiling
from ..nn.layers import Conv2d, Downsample2D, GroupNorm, ResnetBlock2D, SpatialAttention, Upsample2D
from ..nn.module import Module, random_state_dict
from ..nn.weights import fold_output_affine
from .checkpoint import normalize_keys
from .config import AutoencoderKLConfig, AutoencoderKLOptions

log = logging.getLogger("convserve.models")

#: diffusers' VAE blocks use this eps for every GroupNorm (resnets, attention, conv_norm_out)
VAE_NORM_EPS = 1e-6

#: random init: U(+-1/sqrt(fan_in)) as PyTorch's default, norms identity
INIT_RULES = ((r"norm[^.]*\.weight$", "ones"), (r"norm[^.]*\.bias$", "zeros"), ("", "uniform"))


class MidBlock(Module):
    """UNetMidBlock2D as the VAE uses it: resnet, [attention, resnet]."""

    def __init__(self, channels: int, groups: int, add_attention: bool):
        super().__init__()
        self.resnets = [self.add(f"resnets.{i}", ResnetBlock2D(channels, channels, groups, VAE_NORM_EPS))
                        for i in range(2)]
        self.attention = None
        if add_attention:
            self.attention = self.add("attentions.0", SpatialAttention(channels, groups, VAE_NORM_EPS))

    def __call__(self, x):
        x = self.resnets[0](x)
        if self.attention is not None:
            x = self.attention(x)
        return self.resnets[1](x)


def _add_stages(parent: Module, blocks: str, widths, n_resnets: int, groups: int, sampler: str, make_sampler):
    """diffusers' Up/DownEncoderBlock2D list under `blocks`: per width, `n_resnets` resnets, then a
    resampler (`sampler`) on every stage but the last. -> [(resnets, resampler or None)]."""
    stages, prev = [], widths[0]
    for i, ch in enumerate(widths):
        resnets = [parent.add(f"{blocks}.{i}.resnets.{j}", ResnetBlock2D(prev if j == 0 else ch, ch, groups,
                                                                           VAE_NORM_EPS)) for j in range(n_resnets)]
        resample = parent.add(f"{blocks}.{i}.{sampler}", make_sampler(ch)) if i < len(widths) - 1 else None
        stages.append((resnets, resample))
        prev = ch
    return stages


def _run_stages(stages, x):
    for resnets, resample in stages:
        interrupt.check()  # an untiled decode nobody waits for stops between blocks
        for r in resnets:
            x = r(x)
        if resample is not None:
            x = resample(x)
    return x


class Decoder(Module):
    def __init__(self, cfg: AutoencoderKLConfig, upsample_mode: str = "subpixel"):
        super().__init__()
        boc, groups = cfg.decoder_widths, cfg.norm_num_groups
        self.conv_in = self.add("conv_in", Conv2d(cfg.latent_channels, boc[-1], 3, padding=1))
        self.mid_block = self.add("mid_block", MidBlock(boc[-1], groups, cfg.mid_block_add_attention))
        self.stages = _add_stages(self, "up_blocks", list(reversed(boc)), cfg.layers_per_block + 1, groups,
                                  "upsamplers.0", lambda ch: Upsample2D(ch, upsample_mode))
        self.conv_norm_out = self.add("conv_norm_out", GroupNorm(groups, boc[0], VAE_NORM_EPS))
        self.conv_out = self.add("conv_out", Conv2d(boc[0], cfg.out_channels, 3, padding=1))

    def __call__(self, z):
        x = _run_stages(self.stages, self.mid_block(self.conv_in(z)))
        x = self.conv_norm_out(x, activation="silu")
        return self.conv_out(x)


class Encoder(Module):
    prepared_at_load = False  # transformed on the first encode (models/nn/module.py)

    def __init__(self, cfg: AutoencoderKLConfig):
        super().__init__()
        boc, groups = cfg.block_out_channels, cfg.norm_num_groups
        self.conv_in = self.add("conv_in", Conv2d(cfg.in_channels, boc[0], 3, padding=1))
        self.stages = _add_stages(self, "down_blocks", list(boc), cfg.layers_per_block, groups, "downsamplers.0",
                                  Downsample2D)
        self.mid_block = self.add("mid_block", MidBlock(boc[-1], groups, cfg.mid_block_add_attention))
        self.conv_norm_out = self.add("conv_norm_out", GroupNorm(groups, boc[-1], VAE_NORM_EPS))
        self.conv_out = self.add("conv_out", Conv2d(boc[-1], 2 * cfg.latent_channels, 3, padding=1))

    def __call__(self, x):
        x = self.mid_block(_run_stages(self.stages, self.conv_in(x)))
        x = self.conv_norm_out(x, activation="silu")
        return self.conv_out(x)


class _MeanConv(Conv2d):
    """quant_conv (1x1, moments -> moments) keeping only the mean half of its outputs: encode
    uses the posterior mean alone."""

    def __init__(self, moments: int):
        super().__init__(moments, moments, 1)

    def convert(self, name, host):
        return super().convert(name, host[:self.cout // 2])


class AutoencoderKLModel:
    """An image decoder (and encoder when the checkpoint has one) per docs/interfaces.md."""

    kind = IMAGE_DECODER
    #: Hub weights only; load_model sets it (models/contract.py)
    weights_provenance: dict | None = None
    architecture = "diffusers AutoencoderKL (image VAE)"
    #: random init and checkpoint names -> ours (a subclass with tensors of its own extends both)
    init_rules, normalize_keys = INIT_RULES, staticmethod(normalize_keys)

    def __init__(self, name: str, preset: str, backend: Backend, cfg: AutoencoderKLConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: AutoencoderKLOptions | None = None):
        options = options or AutoencoderKLOptions()
        self.name, self.preset, self.backend, self.config = name, preset, backend, cfg
        tile_latent_size = options.tile_latent_size
        if options.tile_size and not tile_latent_size:
            tile_latent_size = max(1, int(options.tile_size) // cfg.spatial_factor)
        self.latent_channels = cfg.latent_channels
        self.spatial_factor = cfg.spatial_factor
        self.scaling_factor = float(cfg.scaling_factor)
        self.shift_factor = float(cfg.shift_factor or 0.0)
        # diffusers: tile_latent_min_size = sample_size / 2**(len(block_out_channels) - 1)
        self.tiling = tiling.image_tiles(int(tile_latent_size or cfg.sample_size / cfg.spatial_factor),
                                         cfg.spatial_factor, float(options.tile_overlap_factor),
                                         int(options.memory_budget_bytes or backend.work_memory_budget))

        lc = cfg.latent_channels
        self.tree = Module()  # what the checkpoint holds, by its names
        self.post_quant_conv = self.tree.add("post_quant_conv", Conv2d(lc, lc, 1)) \
            if cfg.use_post_quant_conv else None
        self.decoder = self.tree.add("decoder", Decoder(cfg, options.upsample_mode))
        for part, child in self._latent_parts().items():
            self.tree.add(part, child)
        self.upsample_mode = options.upsample_mode
        encoder_side = Module()
        self.encoder = encoder_side.add("encoder", Encoder(cfg))
        self.quant_conv = encoder_side.add("quant_conv", _MeanConv(2 * lc)) if cfg.use_quant_conv else None
        encoder_shapes = encoder_side.expected_shapes()
        if tensors is None:
            self.weights_source = "random init"
            wanted = {**self.tree.expected_shapes(), **(encoder_shapes if options.with_encoder else {})}
            tensors = random_state_dict(wanted, options.seed, self.init_rules)
        else:
            self.weights_source = weights_source or "given tensors"
            tensors = self.normalize_keys(tensors, cfg)
        # a decoder-only checkpoint is fine; a partial encoder is an error like any other gap
        self.has_encoder = any(k in tensors for k in encoder_shapes)
        if self.has_encoder:
            for part, child in encoder_side.children.items():
                self.tree.add(part, child)
        else:
            self.encoder = self.quant_conv = None
        # diffusers' VaeImageProcessor maps x / 2 + 0.5 before its clip: done by conv_out itself
        self.tree.load_checked(fold_output_affine(tensors, "decoder.conv_out", 0.5, 0.5), backend,
                               f"AutoencoderKL preset {preset!r}")
        # device latents -> device images; a backend may record and replay it (CUDA graphs)
        self._decode_device = backend.graphed(self._decoder_forward)

    def _latent_parts(self) -> dict[str, Module]:  # checkpoint parts beside the decoder (FLUX.2's `bn`)
        return {}

    # ---- decode ----------------------------------------------------------------------------------
    def _decoder_forward(self, z):
        if self.post_quant_conv is not None:
            z = self.post_quant_conv(z)
        return self.decoder(z)

    def _decode_raw(self, z_nhwc: np.ndarray, clip=None, uint8: bool = False) -> np.ndarray:
        """Unscaled latents (host NHWC) -> images (host NHWC float32, about [0, 1]: x / 2 + 0.5 is in
        conv_out), clipped to `clip` on the device if given; uint8: converted there (pixels_to_uint8)."""
        b = self.backend
        # a shard's forward runs eagerly: its collectives meet the other shards' as they come
        forward = self._decode_device if row_shard.current() is None else self._decoder_forward
        return b.to_host_async(forward(b.asarray(z_nhwc)), clip, uint8=uint8).result()

    def decode(self, latents_nchw: np.ndarray, tiled: bool | None = None, clamp: bool = True, *,
               uint8: bool = False) -> np.ndarray:
        """Scaled latents (N, C, h, w) as the pipeline hands them -> float32 (N, 8h, 8w, 3) in [0, 1].
        tiled: True = diffusers tiling (when larger than one tile), False = never, None = when the
        untiled decode's estimated peak memory exceeds the budget. clamp=False skips the clip to
        [0, 1] (2*x - 1 is diffusers' unclamped `vae.decode(...).sample`, remote_decode's `pt`).
        uint8=True: convkernels.pixels_to_uint8 of the images (clamp implied), on the device when
        untiled; tiled, the float32 tiles are blended on the host and converted there."""
        return self._decode_unscaled(self.decoder_latents(latents_nchw), tiled, clamp, uint8)

    def decoder_latents(self, latents_nchw) -> np.ndarray:
        """Pipeline latents (N, C, h, w), checked -> the decoder's (host float32 NHWC), as diffusers
        pipelines do: latents / scaling_factor + shift_factor. Row-local (sharded decodes use it)."""
        lat = np.asarray(latents_nchw)
        if lat.ndim != 4 or lat.shape[1] != self.latent_channels:
            raise ValueError(f"{self.name}: latents must be (N, {self.latent_channels}, h, w), got {lat.shape}")
        return np.ascontiguousarray(lat.astype(np.float32).transpose(0, 2, 3, 1)) / np.float32(
            self.scaling_factor) + np.float32(self.shift_factor)

    def _decode_unscaled(self, z: np.ndarray, tiled: bool | None, clamp: bool, uint8: bool) -> np.ndarray:
        """The decoder's own latents (host NHWC float32) -> images, as decode() describes."""
        plan = tiling.plan_decode(self, z.shape, tiled)
        # (x / 2 + 0.5).clamp(0, 1) as VaeImageProcessor: tiles blend unclipped (as diffusers'), then clip
        if plan is None:
            return self._decode_raw(z, PIXEL_RANGE if clamp or uint8 else None, uint8)
        out = tiling.tiled_decode(self._decode_raw, z, plan)
        if uint8:
            return pixels_to_uint8(out)
        if clamp:
            np.clip(out, *PIXEL_RANGE, out=out)
        return out

    # ---- encode ----------------------------------------------------------------------------------
    def encode(self, images_nhwc01: np.ndarray, tiled: bool | None = None) -> np.ndarray:
        """Images (N, H, W, 3) in [0, 1] -> scaled latents (N, C, H/8, W/8): the mean of the
        posterior, then (mean - shift_factor) * scaling_factor as pipelines do, so that
        decode(encode(x)) round-trips. tiled: as decode's, with diffusers' tiled encode."""
        mean = self._encode_unscaled(images_nhwc01, tiled)
        lat = (mean - np.float32(self.shift_factor)) * np.float32(self.scaling_factor)
        return np.ascontiguousarray(lat.transpose(0, 3, 1, 2))

    def _encode_unscaled(self, images_nhwc01: np.ndarray, tiled: bool | None) -> np.ndarray:
        """Images (N, H, W, 3) in [0, 1] -> the posterior mean, unscaled (host NHWC float32)."""
        if not self.has_encoder:
            raise RuntimeError(f"{self.name}: the checkpoint has no encoder weights")
        img = np.asarray(images_nhwc01, dtype=np.float32)
        if img.ndim != 4 or img.shape[-1] != self.config.in_channels:
            raise ValueError(f"{self.name}: images must be (N, H, W, {self.config.in_channels}), got {img.shape}")
        x = img * np.float32(2.0) - np.float32(1.0)
        plan = tiling.plan_encode(self, x.shape, tiled)
        if plan is None:
            mean = self._encode_mean(x)
        else:
            # blending is linear per channel: blending the means equals the mean of the blended moments
            mean = tiling.tiled_encode(self._encode_mean, x, plan, len(self.config.block_out_channels) - 1)
        return mean

    def _encode_mean(self, x_nhwc: np.ndarray) -> np.ndarray:
        """Images in [-1, 1] (host NHWC) -> posterior mean (host NHWC, unscaled)."""
        b = self.backend
        moments = self.encoder(b.asarray(x_nhwc))
        if self.quant_conv is not None:
            mean = self.quant_conv(moments)
        else:
            mean = b.slice(moments, -1, 0, self.latent_channels)
        return np.asarray(b.to_host(mean), dtype=np.float32)

    # ---- description -----------------------------------------------------------------------------
    def smaller_tiling(self, current: tiling.TileSettings) -> tiling.TileSettings | None:  # models/contract.py
        return tiling.smaller_image_tiles(current, self.config.spatial_factor)

    def card(self) -> dict:
        t = self.tiling
        return card_fields(self, self.architecture, has_encoder=self.has_encoder,
                           latent_channels=self.latent_channels, spatial_factor=self.spatial_factor,
                           scaling_factor=self.scaling_factor, shift_factor=self.shift_factor,
                           limits={"tile_latent_size": t.tile_px // self.config.spatial_factor,
                                   "tile_overlap_factor": t.overlap,
                                   "memory_budget_bytes": t.memory_budget_bytes},
                           upsample_mode=self.upsample_mode, config=self.config.as_dict())
