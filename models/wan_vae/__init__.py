"""The Wan 2.1 video-VAE family: diffusers `AutoencoderKLWan` (is_residual=False).

model.py: presets, config, options and the chunked causal decoder; layers.py: the causal 3-D blocks
and their feature cache, which Wan 2.2 (models/wan22_vae/) and Qwen-Image (models/qwen_image_vae/)
build on; encoder.py: the encoder; checkpoint.py: original-Wan names -> diffusers'; latents.py:
latents de-normalised frame by frame as the decode reaches them."""
from ..contract import VIDEO_DECODER
from ..family import ModelFamily
from .model import DESCRIPTIONS, PRESETS, WanVAEConfig, WanVAEDecoder, WanVAEOptions

FAMILY = ModelFamily(VIDEO_DECODER, "Wan VAE", PRESETS, DESCRIPTIONS, WanVAEOptions,
                     checkpoint_class="AutoencoderKLWan", config=WanVAEConfig, model=WanVAEDecoder, row_sharding="wan2.1")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "WanVAEConfig", "WanVAEDecoder", "WanVAEOptions", "build"]
