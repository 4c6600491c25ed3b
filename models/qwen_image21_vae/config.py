"""diffusers `AutoencoderKLQwenImage21` (the Qwen-Image 2.1 VAE): presets, the config read from
config.json and the family's options.

The real preset is diffusers' class defaults, which we read as Qwen/Qwen-Image-2.1/vae's config.json
(not checked against the Hub here: no network): the Wan 2.2 residual layout (is_residual) at five
levels (dim_mult 1, 2, 4, 8, 8: 16x, no patch), encoder width 96, decoder width 144, 64 latent
channels and RGBA pixels (in_channels = out_channels = 4: the Qwen-Image 2.1 pipeline converts every
image to RGBA and "the VAE still reads all four channels"). The tiny preset keeps that structure
(four resamplers, temporal flags, RGBA, a wider decoder) at a few channels.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..nn.weights import ModelConfigError
from ..qwen_image_vae.model import QwenImageVAEOptions
from ..wan_vae.model import WanVAEConfig

# diffusers AutoencoderKLQwenImage21's defaults (== the pipeline's Qwen/Qwen-Image-2.1 vae, unchecked)
QWEN21_LATENTS_MEAN = [
    0.5126, 0.7721, -0.0631, 1.3506, -0.7855, -2.1025, -0.3458, 1.3722,
    1.8873, -1.7177, -0.6510, 0.2732, 0.7562, -0.6163, -1.0277, 3.8363,
    2.0210, 0.0472, 0.9320, 2.0087, 2.4954, -0.1391, -1.4249, 1.8464,
    -0.5236, 1.2826, 3.7046, -1.3035, 2.7286, -1.4518, -1.9036, -1.9955,
    -0.0342, -1.0265, -0.7636, 3.0555, 0.0746, -3.0751, -0.1076, 1.7376,
    -1.0914, -1.9435, -0.2784, -1.3680, 0.4809, -0.4433, 0.3764, 0.5729,
    -2.0595, 1.0960, -1.3260, -2.0211, -5.0179, 0.5275, 4.0162, 1.8505,
    0.3026, 1.9373, 1.4937, 0.2632, 0.5547, -1.7121, -0.1562, 0.0304,
]
QWEN21_LATENTS_STD = [
    3.2001, 3.2936, 3.4321, 3.0091, 3.1061, 4.0379, 4.0705, 3.7910,
    3.0785, 3.6500, 3.9308, 3.0904, 2.8778, 3.7675, 3.7320, 5.0756,
    3.2864, 4.0397, 3.1317, 4.0443, 2.9249, 3.9454, 3.0988, 4.2489,
    3.4896, 3.8513, 3.9323, 3.4719, 3.7498, 4.2830, 3.5694, 4.2467,
    3.9037, 3.2947, 5.0770, 3.5075, 3.2700, 3.4767, 2.8063, 5.1125,
    3.5327, 4.7833, 3.1286, 4.1819, 3.8527, 3.8312, 3.5605, 4.3875,
    3.9624, 4.0168, 3.5643, 4.0550, 5.5614, 4.2963, 4.4080, 3.4959,
    3.8747, 3.7608, 3.5735, 3.1490, 3.7662, 3.6746, 3.4563, 3.8161,
]

#: the pipeline's pixels: RGB and alpha (PIL "RGBA"); decode() serves the first three
RGBA = 4

PRESETS: dict[str, dict] = {
    "qwen-image2.1-vae": {
        "base_dim": 96, "decoder_base_dim": 144, "z_dim": 64, "dim_mult": [1, 2, 4, 8, 8], "num_res_blocks": 2,
        "attn_scales": [], "temperal_downsample": [False, True, True, True], "dropout": 0.0, "is_residual": True,
        "in_channels": RGBA, "out_channels": RGBA, "patch_size": None, "scale_factor_temporal": 8,
        "scale_factor_spatial": 16, "latents_mean": QWEN21_LATENTS_MEAN, "latents_std": QWEN21_LATENTS_STD,
    },
    "tiny-qwen-image2.1-vae": {
        "base_dim": 4, "decoder_base_dim": 6, "z_dim": 8, "dim_mult": [1, 2, 2, 2, 2], "num_res_blocks": 1,
        "attn_scales": [], "temperal_downsample": [False, True, True, True], "dropout": 0.0, "is_residual": True,
        "in_channels": RGBA, "out_channels": RGBA, "patch_size": None, "scale_factor_temporal": 8,
        "scale_factor_spatial": 16,
        "latents_mean": [round(0.1 * ((7 * i) % 11 - 5), 2) for i in range(8)],
        "latents_std": [round(0.6 + 0.15 * ((5 * i) % 13), 2) for i in range(8)],
    },
}

DESCRIPTIONS = {
    "qwen-image2.1-vae": "Qwen-Image 2.1 VAE (Qwen/Qwen-Image-2.1/vae, AutoencoderKLQwenImage21: the Wan 2.2 "
                         "residual VAE on one frame with 2-D convs; 64 latent channels, 16x space, RGBA, "
                         "served as RGB)",
    "tiny-qwen-image2.1-vae": "tiny Qwen-Image-2.1-architecture VAE for tests and CPU demos "
                              "(8 latent channels, 16x; 8x8 latents -> 128x128 in well under a second)",
}


@dataclass(frozen=True)
class QwenImage21VAEConfig(WanVAEConfig):
    """The fields of diffusers' AutoencoderKLQwenImage21 config.json, its defaults by default."""

    base_dim: int = 96
    decoder_base_dim: int | None = 144
    z_dim: int = 64
    dim_mult: tuple[int, ...] = (1, 2, 4, 8, 8)
    temperal_downsample: tuple[bool, ...] = (False, True, True, True)
    latents_mean: tuple[float, ...] = tuple(QWEN21_LATENTS_MEAN)
    latents_std: tuple[float, ...] = tuple(QWEN21_LATENTS_STD)
    is_residual: bool = True
    in_channels: int = RGBA
    out_channels: int = RGBA
    patch_size: int | None = None
    scale_factor_temporal: int | None = 8
    scale_factor_spatial: int | None = 16

    def variant_problems(self) -> list[str]:
        problems = []
        if not self.is_residual:
            problems.append("is_residual must be true (the class's residual up and down blocks)")
        if self.patch_size not in (None, 1):
            problems.append(f"patch_size must be null (the Qwen-Image 2.1 VAE has no patching), got {self.patch_size}")
        for what in ("in_channels", "out_channels"):
            if getattr(self, what) != RGBA:
                problems.append(f"{what} must be {RGBA} (RGBA, as the Qwen-Image 2.1 pipeline feeds and reads it), "
                                f"got {getattr(self, what)}")
        if self.scale_factor_spatial not in (None, self.spatial_factor):
            problems.append(f"scale_factor_spatial {self.scale_factor_spatial} must be 2 ** (len(dim_mult) - 1) "
                            f"= {self.spatial_factor}")
        return problems

    def validate(self) -> None:
        try:
            super().validate()
        except ModelConfigError as exc:  # the message names this class, not AutoencoderKLWan
            raise ModelConfigError(str(exc).replace("AutoencoderKLWan", "AutoencoderKLQwenImage21")) from None


#: the Qwen-Image VAE's options: the Wan tiles (tile_sample_min_size 256, stride 192, as diffusers'
#: AutoencoderKLQwenImage21) and 1328x1328 pixels untiled
QwenImage21VAEOptions = QwenImageVAEOptions
