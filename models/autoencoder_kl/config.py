"""diffusers `AutoencoderKL` (SD 1.x/2.x, SDXL, FLUX.1 image VAEs): the presets, the config read
from config.json and the family's options.

Real presets match the published config.json files (widths, latent channels, scaling and shift,
sample_size: diffusers' tile size). Tiny ones keep the real 4-level structure (spatial factor 8) at
widths that decode 32x32 latents in well under a second on 2 CPU cores.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from ..family import ModelOptions
from ..nn.weights import DiffusersConfig, ModelConfigError

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
            raise ModelConfigError("unsupported AutoencoderKL config: " + "; ".join(problems))

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
