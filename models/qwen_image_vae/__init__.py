"""The Qwen-Image VAE family: diffusers `AutoencoderKLQwenImage`, the Wan 2.1 VAE run on one frame
as an image VAE (model.py, built on models/wan_vae/)."""
from ..contract import IMAGE_DECODER
from ..family import ModelFamily
from .model import DESCRIPTIONS, PRESETS, QwenImageVAEConfig, QwenImageVAEDecoder, QwenImageVAEOptions

FAMILY = ModelFamily(IMAGE_DECODER, "Qwen-Image VAE", PRESETS, DESCRIPTIONS, QwenImageVAEOptions,
                     checkpoint_class="AutoencoderKLQwenImage", config=QwenImageVAEConfig, model=QwenImageVAEDecoder, row_sharding="qwen-image")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "QwenImageVAEConfig", "QwenImageVAEDecoder", "QwenImageVAEOptions",
           "build"]
