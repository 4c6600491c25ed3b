"""diffusers `AutoencoderKLLTX2Video` (the LTX-2 video VAE): presets, the config read from
config.json, strict structure rules and the family's options.

The real preset is the LTX-2.0 VAE as diffusers' LTX-2 conversion script (convert_ltx2_to_diffusers) writes it for
Lightricks/LTX-2 (folder `vae`): 128 latent channels, 4x4 patches and three 2x2x2 residual
depth-to-space upsamplers (32x space, 8x time), a non-causal decoder (decoder_causal=False) with
reflect padding and no timestep conditioning. Its config.json was not checked against the Hub here
(no network). The tiny preset keeps that structure at 8 latent channels and widths 8..32.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..family import ModelOptions
from ..nn.weights import DiffusersConfig, ModelConfigError

#: PerChannelRMSNorm's eps (fixed in diffusers' code, not the config)
RMS_EPS = 1e-8
#: the timestep embedding's sinusoid width (PixArtAlphaCombinedTimestepSizeEmbeddings' Timesteps(256))
TIME_PROJ = 256
_STRIDES = {"spatial": (1, 2, 2), "temporal": (2, 1, 1), "spatiotemporal": (2, 2, 2)}

_LTX2 = {"in_channels": 3, "out_channels": 3, "latent_channels": 128,
         "block_out_channels": [256, 512, 1024, 2048], "decoder_block_out_channels": [256, 512, 1024],
         "layers_per_block": [4, 6, 6, 2, 2], "decoder_layers_per_block": [5, 5, 5, 5],
         "spatio_temporal_scaling": [True, True, True, True], "decoder_spatio_temporal_scaling": [True, True, True],
         "decoder_inject_noise": [False, False, False, False],
         "downsample_type": ["spatial", "temporal", "spatiotemporal", "spatiotemporal"],
         "upsample_type": ["spatiotemporal", "spatiotemporal", "spatiotemporal"],
         "upsample_residual": [True, True, True], "upsample_factor": [2, 2, 2], "timestep_conditioning": False,
         "patch_size": 4, "patch_size_t": 1, "resnet_norm_eps": 1e-6, "scaling_factor": 1.0,
         "encoder_causal": True, "decoder_causal": False, "encoder_spatial_padding_mode": "zeros",
         "decoder_spatial_padding_mode": "reflect", "spatial_compression_ratio": 32,
         "temporal_compression_ratio": 8}

PRESETS: dict[str, dict] = {
    "ltx2-vae": _LTX2,
    "tiny-ltx2-vae": {**_LTX2, "latent_channels": 8, "block_out_channels": [16, 32, 32, 64],
                      "decoder_block_out_channels": [16, 32, 64], "layers_per_block": [1, 1, 1, 1, 1],
                      "decoder_layers_per_block": [1, 1, 1, 1]},
}

DESCRIPTIONS = {
    "ltx2-vae": "LTX-2 video VAE decoder and encoder (Lightricks/LTX-2, folder vae; AutoencoderKLLTX2Video, 128 latent "
                "channels, 32x space, 8x time, non-causal decoder)",
    "tiny-ltx2-vae": "tiny LTX-2-architecture video VAE decoder and encoder for tests and CPU demos (8 latent channels, "
                     "32x space, 8x time)",
}


@dataclass(frozen=True)
class LTX2VAEOptions(ModelOptions):
    """The LTX-2 VAE's own settings beside ModelOptions' (tile_size replaces the tile size and
    stride below, the stride a quarter smaller)."""

    #: diffusers' tile_sample_min_height/width: output pixels per tile side (its default 512)
    tile_sample_min_size: int = 512
    #: diffusers' tile_sample_stride_height/width (its default 448)
    tile_sample_stride: int = 448
    #: tiled=None tiles only frames above this many output pixels
    max_untiled_pixels: int = 1280 * 720
    #: the pipeline's decode_timestep (its default 0.0), read only where timestep_conditioning
    timestep: float = 0.0
    #: the pipeline's decode_noise_scale: latents = (1 - s) * latents + s * noise before the
    #: de-normalisation, where timestep_conditioning. 0.0 (the default): no noise, deterministic
    #: (the pipeline's default is s = timestep, which is 0.0 at its default timestep)
    noise_scale: float = 0.0
    #: the seed of that noise (NumPy's generator, not torch's: not the pipeline's noise bit for bit)
    noise_seed: int = 0


@dataclass(frozen=True)
class LTX2VAEConfig(DiffusersConfig):
    """The fields of diffusers' AutoencoderKLLTX2Video config.json: the decoder's, and the
    encoder's (built where the checkpoint holds it: models/ltx2_vae/encoder.py)."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 128
    block_out_channels: tuple[int, ...] = (256, 512, 1024, 2048)
    decoder_block_out_channels: tuple[int, ...] = (256, 512, 1024)
    layers_per_block: tuple[int, ...] = (4, 6, 6, 2, 2)
    decoder_layers_per_block: tuple[int, ...] = (5, 5, 5, 5)
    spatio_temporal_scaling: tuple[bool, ...] | bool = (True, True, True, True)
    decoder_spatio_temporal_scaling: tuple[bool, ...] | bool = (True, True, True)
    decoder_inject_noise: tuple[bool, ...] | bool = (False, False, False, False)
    downsample_type: tuple[str, ...] = ("spatial", "temporal", "spatiotemporal", "spatiotemporal")
    upsample_type: tuple[str, ...] = ("spatiotemporal", "spatiotemporal", "spatiotemporal")
    upsample_residual: tuple[bool, ...] | bool = (True, True, True)
    upsample_factor: tuple[int, ...] = (2, 2, 2)
    timestep_conditioning: bool = False
    patch_size: int = 4
    patch_size_t: int = 1
    resnet_norm_eps: float = 1e-6
    scaling_factor: float = 1.0
    encoder_causal: bool = True
    decoder_causal: bool = True
    encoder_spatial_padding_mode: str = "zeros"
    decoder_spatial_padding_mode: str = "reflect"
    spatial_compression_ratio: int | None = None
    temporal_compression_ratio: int | None = None

    # ---- the structure diffusers builds from these fields ----------------------------------------
    def _per_block(self, value, n: int) -> tuple:
        return (value,) * n if isinstance(value, bool) else tuple(value)

    def decoder_levels(self) -> list[tuple[int, tuple[int, int, int] | None, int, bool, int]]:
        """Per up block, widest first: (its width, upsample stride or None, upsample_factor,
        residual, resnets), as LTX2VideoDecoder3d reads the config (reversed)."""
        n = len(self.decoder_layers_per_block)
        boc = tuple(reversed(self.decoder_block_out_channels))
        scaling = tuple(reversed(self._per_block(self.decoder_spatio_temporal_scaling, n - 1)))
        residual = tuple(reversed(self._per_block(self.upsample_residual, n - 1)))
        factors = tuple(reversed(self.upsample_factor))
        kinds = tuple(self.upsample_type)
        layers = tuple(reversed(self.decoder_layers_per_block))
        return [(boc[i] // factors[i], _STRIDES.get(kinds[i]) if scaling[i] else None, factors[i], residual[i],
                 layers[i + 1]) for i in range(len(boc))]

    def encoder_levels(self) -> list[tuple[int, int, tuple[int, int, int] | None]]:
        """Per down block: (its output width, resnets, downsample stride or None), as
        LTX2VideoEncoder3d reads the config."""
        n = len(self.block_out_channels)
        scaling = self._per_block(self.spatio_temporal_scaling, n)
        return [(self.block_out_channels[i], self.layers_per_block[i],
                 _STRIDES.get(self.downsample_type[i]) if scaling[i] else None) for i in range(n)]

    def encoder_problems(self) -> list[str]:
        """Why diffusers' encoder would not run this config, or runs it as we do not (empty: fine)."""
        n = len(self.block_out_channels)
        if len(self.layers_per_block) != n + 1 or len(self.downsample_type) != n or \
                len(self._per_block(self.spatio_temporal_scaling, n)) != n:
            return [f"block_out_channels has {n} entries: downsample_type and spatio_temporal_scaling must have "
                    f"{n}, layers_per_block {n + 1}"]
        problems = []
        scaling = self._per_block(self.spatio_temporal_scaling, n)
        if any(s and k not in _STRIDES for s, k in zip(scaling, self.downsample_type)):
            problems.append(f"downsample_type entries must be {sorted(_STRIDES)} (the strided 'conv' downsampler "
                            f"is not offered), got {list(self.downsample_type)}")
            return problems
        if self.patch_size_t != 1:
            problems.append(f"patch_size_t {self.patch_size_t}: diffusers' encoder sizes conv_in for 1")
        width, st, ss = self.latent_channels, 1, 1
        for i, (out, _, stride) in enumerate(self.encoder_levels()):
            size = int(np.prod(stride)) if stride is not None else 1
            if stride is None and out != width or stride is not None and (out % size or (width * size) % out):
                problems.append(f"down block {i} takes {width} channels to {out}: diffusers' encoder does not "
                                "run that config")
                break
            if stride is not None:
                st, ss = st * stride[0], ss * stride[1]
            width = out
        if not problems and (self.patch_size * ss, st) != (self.spatial_factor, self.temporal_factor):
            problems.append(f"the encoder compresses {self.patch_size * ss}x space and {st}x time, the decoder "
                            f"expands {self.spatial_factor}x and {self.temporal_factor}x")
        if self.encoder_spatial_padding_mode not in ("reflect", "zeros"):
            problems.append(f"encoder_spatial_padding_mode must be 'reflect' or 'zeros', got "
                            f"{self.encoder_spatial_padding_mode!r}")
        return problems

    @property
    def mid_width(self) -> int:
        return self.decoder_block_out_channels[-1]

    @property
    def mid_layers(self) -> int:
        return self.decoder_layers_per_block[-1]

    def validate(self) -> None:
        problems, n = [], len(self.decoder_layers_per_block)
        boc = self.decoder_block_out_channels
        lengths = {"decoder_block_out_channels": len(boc), "upsample_type": len(self.upsample_type),
                   "upsample_factor": len(self.upsample_factor)}
        if any(v != n - 1 for v in lengths.values()):
            problems.append(f"decoder_layers_per_block has {n} entries: {lengths} must each have {n - 1}")
        elif any(k not in _STRIDES for k in self.upsample_type):
            problems.append(f"upsample_type entries must be {sorted(_STRIDES)}, got {list(self.upsample_type)}")
        else:
            width = self.mid_width
            for i, (out, stride, factor, _, _) in enumerate(self.decoder_levels()):
                # diffusers' up block takes `width` channels into its upsampler, which expects out * factor;
                # an up block whose nominal input differs from its width adds a conv_in resnet that
                # crashes under timestep conditioning: both are refused
                want = out * factor if stride is not None else out
                prev_out = tuple(reversed(boc))[i - 1] // tuple(reversed(self.upsample_factor))[i - 1] if i else width
                nominal = prev_out // factor
                if width != want or nominal != out:
                    problems.append(f"up block {i} would take {width} channels into a block of {out} "
                                    f"(upsample_factor {factor}): diffusers' decoder does not run that config")
                    break
                width = out
        noise = self._per_block(self.decoder_inject_noise, n)
        if any(noise):
            problems.append("decoder_inject_noise draws torch noise inside the decoder (not deterministic): "
                            "not offered")
        if self.decoder_spatial_padding_mode not in ("reflect", "zeros"):
            problems.append(f"decoder_spatial_padding_mode must be 'reflect' or 'zeros', got "
                            f"{self.decoder_spatial_padding_mode!r}")
        if self.out_channels != 3:
            problems.append(f"out_channels must be 3 (RGB), got {self.out_channels}")
        if self.scaling_factor == 0:
            problems.append("scaling_factor is 0")
        if not problems:
            derived = (self.patch_size * self.spatial_upsampling, self.patch_size_t * self.temporal_upsampling)
            for what, given, made in (("spatial", self.spatial_compression_ratio, derived[0]),
                                      ("temporal", self.temporal_compression_ratio, derived[1])):
                if given is not None and given != made:
                    problems.append(f"{what}_compression_ratio {given} is not what the decoder makes ({made})")
        if problems:
            raise ModelConfigError("unsupported AutoencoderKLLTX2Video config: " + "; ".join(problems))

    @property
    def spatial_upsampling(self) -> int:
        return int(np.prod([s[1] for _, s, *_ in self.decoder_levels() if s is not None] or [1]))

    @property
    def temporal_upsampling(self) -> int:
        return int(np.prod([s[0] for _, s, *_ in self.decoder_levels() if s is not None] or [1]))

    @property
    def spatial_factor(self) -> int:
        return self.patch_size * self.spatial_upsampling

    @property
    def temporal_factor(self) -> int:
        return self.patch_size_t * self.temporal_upsampling
