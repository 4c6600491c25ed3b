"""The Qwen-Image 2.1 VAE family: diffusers `AutoencoderKLQwenImage21` (64 latent channels, 16x, RGBA).

It is the Wan 2.2 residual VAE (models/wan22_vae) on one frame with 2-D convs, served as the
Qwen-Image VAE is (models/qwen_image_vae): config.py holds the presets and config.json fields,
layers.py the one layer that differs (the frame conv), model.py the pipeline's latent handling."""
from ..contract import IMAGE_DECODER
from ..family import ModelFamily
from .config import DESCRIPTIONS, PRESETS, QwenImage21VAEConfig, QwenImage21VAEOptions
from .model import QwenImage21VAEModel

FAMILY = ModelFamily(IMAGE_DECODER, "Qwen-Image 2.1 VAE", PRESETS, DESCRIPTIONS, QwenImage21VAEOptions,
                     checkpoint_class="AutoencoderKLQwenImage21", config=QwenImage21VAEConfig,
                     model=QwenImage21VAEModel, row_sharding="qwen-image2.1")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "QwenImage21VAEConfig", "QwenImage21VAEModel",
           "QwenImage21VAEOptions", "build"]
