"""diffusers `AutoencoderKL` (SD 1.x/2.x, SDXL, FLUX image VAEs) on the backend interface: the
image-VAE family (its presets, model and builder; `FAMILY`).

The layer tree mirrors diffusers' module names exactly, so a diffusers checkpoint loads by name:
`post_quant_conv`, `decoder.{conv_in, mid_block, up_blocks, conv_norm_out, conv_out}` and, when
the checkpoint holds it, `encoder.*` + `quant_conv`.

Real presets match the published config.json files (widths, latent channels, scaling and shift,
sample_size: diffusers' tile size). Tiny ones keep the real 4-level structure (spatial factor 8) at
widths that decode 32x32 latents in well under a second on 2 CPU cores.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from convkernels import Backend, pixels_to_uint8

from . import interrupt, tiling
from .layers import Conv2d, Downsample2D, GroupNorm, ResnetBlock2D, SpatialAttention, Upsample2D
from .contract import IMAGE_DECODER, PIXEL_RANGE, card_fields
from .family import ModelFamily, ModelOptions, family_options
from .module import Module, random_state_dict
from .autoencoder_kl_checkpoint import normalize_keys
from .weights import DiffusersConfig, diffusers_config, fold_output_affine

log = logging.getLogger("convserve.models")

_SD_BLOCKS = {
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "block_out_channels": [128, 256, 512, 512],
    "layers_per_block": 2,
    "norm_num_groups": 32,
    "act_fn": "silu",
    "in_channels": 3,
    "out_channels": 3,
}

_TINY_BLOCKS = {
    **_SD_BLOCKS,
    "block_out_channels": [16, 32, 32, 64],
    "layers_per_block": 1,
    "norm_num_groups": 8,
    "sample_size": 256,  # 32-latent tiles
}

PRESETS: dict[str, dict] = {
    "sd-vae": {**_SD_BLOCKS, "latent_channels": 4, "sample_size": 512, "scaling_factor": 0.18215},
    "sdxl-vae": {**_SD_BLOCKS, "latent_channels": 4, "sample_size": 1024, "scaling_factor": 0.13025},
    "flux-vae": {**_SD_BLOCKS, "latent_channels": 16, "sample_size": 1024, "scaling_factor": 0.3611,
                 "shift_factor": 0.1159, "use_quant_conv": False, "use_post_quant_conv": False},
    "tiny-vae": {**_TINY_BLOCKS, "latent_channels": 4, "scaling_factor": 0.18215},
    "tiny-flux-vae": {**_TINY_BLOCKS, "latent_channels": 16, "scaling_factor": 0.3611, "shift_factor": 0.1159,
                      "use_quant_conv": False, "use_post_quant_conv": False},
}

DESCRIPTIONS = {
    "sd-vae": "Stable Diffusion 1.x/2.x VAE (4 latent channels)",
    "sdxl-vae": "SDXL VAE (4 latent channels, scaling 0.13025)",
    "flux-vae": "FLUX.1 VAE (16 latent channels, no quant convs, scaling 0.3611, shift 0.1159)",
    "tiny-vae": "tiny SD-style VAE for tests and CPU demos (random init unless weights are given)",
    "tiny-flux-vae": "tiny FLUX-style VAE (16 latent channels) for tests and CPU demos",
}

#: diffusers' VAE blocks use this eps for every GroupNorm (resnets, attention, conv_norm_out)
VAE_NORM_EPS = 1e-6

#: random init: U(+-1/sqrt(fan_in)) as PyTorch's default, norms identity
INIT_RULES = ((r"norm[^.]*\.weight$", "ones"), (r"norm[^.]*\.bias$", "zeros"), ("", "uniform"))


@dataclass(frozen=True)
class AutoencoderKLConfig(DiffusersConfig):
    """The fields of diffusers' AutoencoderKL config.json that shape the computation."""

    in_channels: int = 3
    out_channels: int = 3
    down_block_types: tuple[str, ...] = ("DownEncoderBlock2D",)
    up_block_types: tuple[str, ...] = ("UpDecoderBlock2D",)
    block_out_channels: tuple[int, ...] = (64,)
    layers_per_block: int = 1
    act_fn: str = "silu"
    latent_channels: int = 4
    norm_num_groups: int = 32
    sample_size: int = 32
    scaling_factor: float = 0.18215
    shift_factor: float | None = None
    use_quant_conv: bool = True
    use_post_quant_conv: bool = True
    mid_block_add_attention: bool = True

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "AutoencoderKLConfig":
        if isinstance(d.get("sample_size"), (list, tuple)):
            d = {**d, "sample_size": int(d["sample_size"][0])}  # diffusers tiles with the first entry
        return super().from_dict(d)

    def validate(self) -> None:
        problems = []
        if self.act_fn not in ("silu", "swish"):
            problems.append(f"act_fn {self.act_fn!r} (only silu)")
        if any(t != "DownEncoderBlock2D" for t in self.down_block_types):
            problems.append(f"down_block_types {self.down_block_types} (only DownEncoderBlock2D)")
        if any(t != "UpDecoderBlock2D" for t in self.up_block_types):
            problems.append(f"up_block_types {self.up_block_types} (only UpDecoderBlock2D)")
        n = len(self.block_out_channels)
        if len(self.up_block_types) != n or len(self.down_block_types) != n:
            problems.append("block type lists and block_out_channels differ in length")
        if any(c % self.norm_num_groups for c in self.block_out_channels):
            problems.append(f"norm_num_groups {self.norm_num_groups} must divide every block width "
                            f"{self.block_out_channels}")
        if problems:
            raise ValueError("unsupported AutoencoderKL config: " + "; ".join(problems))

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.block_out_channels) - 1)

    @property
    def decoder_widths(self) -> tuple[int, ...]:
        """The decoder's block widths (FLUX.2's config may give it its own)."""
        return self.block_out_channels


@dataclass(frozen=True)
class AutoencoderKLOptions(ModelOptions):
    """The image VAE's own settings, beside ModelOptions' tile_size, seed and config."""

    #: latents per tile side; None: tile_size / spatial factor if given, else diffusers' rule
    #: (sample_size / spatial factor)
    tile_latent_size: int | None = None
    #: diffusers' tile_overlap_factor
    tile_overlap_factor: float = 0.25
    #: working memory one decode/encode may take before it tiles; None: the backend's work_memory_budget
    memory_budget_bytes: int | None = None
    #: random init: make encoder weights too (a checkpoint has them or not)
    with_encoder: bool = True
    #: "subpixel" (nearest 2x and the 3x3 conv as one backend op) or "nearest" (two ops)
    upsample_mode: str = "subpixel"


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
        return b.to_host_async(self._decode_device(b.asarray(z_nhwc)), clip, uint8=uint8).result()

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


def build(name: str, preset: str, backend: Backend, weights: str | None = None,
          options: ModelOptions | None = None) -> AutoencoderKLModel:
    """Make a model from a preset, a checkpoint (diffusers folder or .safetensors) whose
    config.json, when present, replaces the preset's architecture, and options (AutoencoderKLOptions;
    their `config` overrides config fields)."""
    if preset not in PRESETS:
        raise KeyError(f"unknown image VAE preset {preset!r}; known: {sorted(PRESETS)}")
    options = family_options(options, AutoencoderKLOptions)
    cfg, tensors = diffusers_config(weights, "AutoencoderKL", AutoencoderKLConfig, PRESETS[preset], options.config)
    return AutoencoderKLModel(name, preset, backend, cfg, tensors, weights_source=weights, options=options)


FAMILY = ModelFamily(IMAGE_DECODER, PRESETS, DESCRIPTIONS, build, AutoencoderKLOptions)
