"""The Wan 2.2 video-VAE family: diffusers `AutoencoderKLWan` with is_residual=True (TI2V-5B).

It builds on the Wan 2.1 family (models/wan_vae/: its causal blocks, cache, chunked decode and
encoder); layers.py and encoder.py hold only what Wan 2.2 adds (residual up and down blocks, the
2x2 patch), model.py its presets, config and model."""
from ..contract import VIDEO_DECODER
from ..family import ModelFamily
from ..wan_vae.model import WanVAEOptions
from .model import DESCRIPTIONS, PRESETS, Wan22VAEConfig, Wan22VAEDecoder

FAMILY = ModelFamily(VIDEO_DECODER, "Wan 2.2 VAE", PRESETS, DESCRIPTIONS, WanVAEOptions,
                     checkpoint_class="AutoencoderKLWan", config=Wan22VAEConfig, model=Wan22VAEDecoder, row_sharding="wan2.2")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "Wan22VAEConfig", "Wan22VAEDecoder", "build"]
