"""Image VAE presets: diffusers AutoencoderKL configs by name.

The real ones match the published config.json files (block widths, latent channels, scaling and
shift factors, sample_size, which sets diffusers' tile size). The tiny ones keep the real block
structure (4 levels, so the spatial factor stays 8) at widths that decode 32x32 latents in well
under a second on 2 CPU cores.
"""
from __future__ import annotations

from convkernels import Backend

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


def build(name: str, preset: str, backend: Backend, weights: str | None = None, **overrides):
    from .autoencoder_kl import build as build_vae
    if preset not in PRESETS:
        raise KeyError(f"unknown image VAE preset {preset!r}; known: {sorted(PRESETS)}")
    return build_vae(name, PRESETS[preset], preset, backend, weights, **overrides)
