"""diffusers `AutoencoderDC` (SANA's deep-compression autoencoder, DC-AE): presets, the config read
from config.json and the family's options.

The real preset is mit-han-lab/dc-ae-f32c32-sana-1.1-diffusers as we read it: diffusers' conversion
script's SANA config (32 latent channels, 32x: six levels, ResBlocks on the three widest-resolution
levels and EfficientViT blocks with 5x5 multi-scale linear attention on the other three, stride-2
conv downsamplers, nearest-2x-then-conv upsamplers, scaling_factor 0.41407); its config.json was not
checked against the Hub here (no network). The tiny preset keeps that structure (both block types,
both shortcuts, the multi-scale branch) at 8 latent channels, spatial factor 4.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..autoencoder_kl.config import AutoencoderKLOptions
from ..nn.weights import DiffusersConfig, ModelConfigError

#: every RMSNorm of the class: eps 1e-5, weight and bias (fixed in diffusers' code, not the config)
NORM_EPS = 1e-5
#: SanaMultiscaleLinearAttention's eps in its normaliser
ATTENTION_EPS = 1e-15
#: the block activations our backends fuse (diffusers' get_activation names)
ACTIVATIONS = {"silu": "silu", "swish": "silu", "relu": "relu", "gelu": "gelu"}

_SANA_BLOCKS = ["ResBlock", "ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock", "EfficientViTBlock"]

PRESETS: dict[str, dict] = {
    "dc-ae-f32c32": {"in_channels": 3, "latent_channels": 32, "attention_head_dim": 32,
                     "encoder_block_types": _SANA_BLOCKS, "decoder_block_types": _SANA_BLOCKS,
                     "encoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
                     "decoder_block_out_channels": [128, 256, 512, 512, 1024, 1024],
                     "encoder_layers_per_block": [2, 2, 2, 3, 3, 3], "decoder_layers_per_block": [3, 3, 3, 3, 3, 3],
                     "encoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
                     "decoder_qkv_multiscales": [[], [], [], [5], [5], [5]],
                     "upsample_block_type": "interpolate", "downsample_block_type": "Conv",
                     "decoder_norm_types": "rms_norm", "decoder_act_fns": "silu", "encoder_out_shortcut": True,
                     "decoder_in_shortcut": True, "decoder_conv_act_fn": "relu", "scaling_factor": 0.41407},
    "tiny-dc-ae": {"in_channels": 3, "latent_channels": 8, "attention_head_dim": 8,
                   "encoder_block_types": ["ResBlock", "EfficientViTBlock", "EfficientViTBlock"],
                   "decoder_block_types": ["ResBlock", "EfficientViTBlock", "EfficientViTBlock"],
                   "encoder_block_out_channels": [8, 16, 16], "decoder_block_out_channels": [8, 16, 16],
                   "encoder_layers_per_block": [1, 1, 1], "decoder_layers_per_block": [1, 1, 1],
                   "encoder_qkv_multiscales": [[], [5], [5]], "decoder_qkv_multiscales": [[], [5], [5]],
                   "upsample_block_type": "interpolate", "downsample_block_type": "Conv",
                   "decoder_norm_types": "rms_norm", "decoder_act_fns": "silu", "encoder_out_shortcut": True,
                   "decoder_in_shortcut": True, "decoder_conv_act_fn": "relu", "scaling_factor": 0.41407},
}

DESCRIPTIONS = {
    "dc-ae-f32c32": "SANA DC-AE (mit-han-lab/dc-ae-f32c32-sana-1.1-diffusers; 32 latent channels, 32x, "
                    "scaling 0.41407)",
    "tiny-dc-ae": "tiny DC-AE-style autoencoder (8 latent channels, 4x) for tests and CPU demos",
}


@dataclass(frozen=True)
class DCAEOptions(AutoencoderKLOptions):
    """The image VAE's options; AutoencoderDC's tiles are 512 pixels every 448 (diffusers'
    tile_sample_min / tile_sample_stride), an overlap of 1/8. upsample_mode is not read."""

    tile_overlap_factor: float = 0.125


def _per_level(value, levels: int, what: str) -> tuple:
    """diffusers' `str | tuple[str]` fields: one value for every level, or one per level."""
    if isinstance(value, str):
        return (value,) * levels
    value = tuple(value)
    if len(value) != levels:
        raise ModelConfigError(f"unsupported AutoencoderDC config: {what} has {len(value)} entries for {levels} levels")
    return value


@dataclass(frozen=True)
class DCAEConfig(DiffusersConfig):
    """The fields of diffusers' AutoencoderDC config.json that shape the computation."""

    in_channels: int = 3
    latent_channels: int = 32
    attention_head_dim: int = 32
    encoder_block_types: str | tuple[str, ...] = "ResBlock"
    decoder_block_types: str | tuple[str, ...] = "ResBlock"
    encoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512, 1024, 1024)
    decoder_block_out_channels: tuple[int, ...] = (128, 256, 512, 512, 1024, 1024)
    encoder_layers_per_block: tuple[int, ...] = (2, 2, 2, 3, 3, 3)
    decoder_layers_per_block: tuple[int, ...] = (3, 3, 3, 3, 3, 3)
    encoder_qkv_multiscales: tuple = ((), (), (), (5,), (5,), (5,))
    decoder_qkv_multiscales: tuple = ((), (), (), (5,), (5,), (5,))
    upsample_block_type: str = "pixel_shuffle"
    downsample_block_type: str = "pixel_unshuffle"
    decoder_norm_types: str | tuple[str, ...] = "rms_norm"
    decoder_act_fns: str | tuple[str, ...] = "silu"
    encoder_out_shortcut: bool = True
    decoder_in_shortcut: bool = True
    decoder_conv_act_fn: str = "relu"
    scaling_factor: float = 1.0

    def __post_init__(self) -> None:  # config.json's nested lists, as tuples
        for name in ("encoder_qkv_multiscales", "decoder_qkv_multiscales"):
            object.__setattr__(self, name, tuple(tuple(int(k) for k in ks) for ks in getattr(self, name)))

    def as_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {k: ([list(x) if isinstance(x, tuple) else x for x in v] if isinstance(v, tuple) else v)
                for k, v in out.items()}

    # ---- the structure diffusers builds from these fields ----------------------------------------
    def levels(self, side: str) -> list[tuple[int, str, int, tuple[int, ...]]]:
        """Per level of `side` ("encoder"/"decoder"), finest first: (width, block type, blocks,
        multi-scale kernel sizes)."""
        boc = getattr(self, f"{side}_block_out_channels")
        types = _per_level(getattr(self, f"{side}_block_types"), len(boc), f"{side}_block_types")
        return list(zip(boc, types, getattr(self, f"{side}_layers_per_block"), getattr(self, f"{side}_qkv_multiscales")))

    def decoder_acts(self) -> tuple[str, ...]:
        return _per_level(self.decoder_act_fns, len(self.decoder_block_out_channels), "decoder_act_fns")

    def validate(self) -> None:
        problems = []
        for side in ("encoder", "decoder"):
            boc = getattr(self, f"{side}_block_out_channels")
            lists = [getattr(self, f"{side}_{k}") for k in ("layers_per_block", "qkv_multiscales")]
            if any(len(v) != len(boc) for v in lists):
                problems.append(f"{side} layers_per_block and qkv_multiscales need one entry per level")
                continue
            for width, kind, blocks, scales in self.levels(side):
                if kind not in ("ResBlock", "EfficientViTBlock"):
                    problems.append(f"{side} block type {kind!r}")
                if blocks < 1:
                    problems.append(f"{side} levels without blocks (layers_per_block 0) are not offered")
                if kind == "EfficientViTBlock" and (width % self.attention_head_dim or any(k % 2 == 0 for k in scales)):
                    problems.append(f"an EfficientViT width {width} must be a multiple of attention_head_dim "
                                    f"{self.attention_head_dim} and its multi-scale kernels odd, got {scales}")
        enc, dec = self.encoder_block_out_channels, self.decoder_block_out_channels
        if len(enc) != len(dec):
            problems.append("encoder and decoder need as many levels (spatial_compression_ratio is 2 ** levels - 1)")
        for a, b in zip(enc, enc[1:]):
            if (4 * a) % b:
                problems.append(f"a downsample {a}->{b} (4x{a} must be a multiple of {b})")
        for a, b in zip(dec, dec[1:]):
            if (4 * a) % b:
                problems.append(f"an upsample {b}->{a} (4x{a} must be a multiple of {b})")
        if dec[-1] % self.latent_channels or enc[-1] % self.latent_channels:
            problems.append(f"latent_channels {self.latent_channels} must divide the widest level's width")
        norms = _per_level(self.decoder_norm_types, len(dec), "decoder_norm_types")
        if any(n != "rms_norm" for n in norms):
            problems.append(f"decoder_norm_types {list(norms)}: only rms_norm is offered")
        acts = self.decoder_acts() + (self.decoder_conv_act_fn,)
        if any(a not in ACTIVATIONS for a in acts):
            problems.append(f"activations {list(acts)}: offered are {sorted(ACTIVATIONS)}")
        if problems:
            raise ModelConfigError("unsupported AutoencoderDC config: " + "; ".join(problems))

    # ---- what the shared tiling and card code reads ----------------------------------------------
    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.encoder_block_out_channels) - 1)

    @property
    def block_out_channels(self) -> tuple[int, ...]:  # models/nn/tile_memory.py's estimates read it
        return tuple(self.decoder_block_out_channels)

    @property
    def out_channels(self) -> int:
        return self.in_channels

    @property
    def mid_block_add_attention(self) -> bool:  # linear attention keeps no token-by-token scores
        return False
