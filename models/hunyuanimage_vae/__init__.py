"""The HunyuanImage 2.1 VAE family: diffusers `AutoencoderKLHunyuanImage` (64 latent channels, 32x).

config.py: presets, the config.json fields and structure rules; layers.py: its resamplers (conv and
channel-to-space with a channel-repeating shortcut), attention and the encoder and decoder; model.py:
the model with the pipeline's latent scaling around it."""
from ..contract import IMAGE_DECODER
from ..family import ModelFamily
from .config import DESCRIPTIONS, PRESETS, HunyuanImageVAEConfig, HunyuanImageVAEOptions
from .model import HunyuanImageVAEModel

FAMILY = ModelFamily(IMAGE_DECODER, "HunyuanImage 2.1 VAE", PRESETS, DESCRIPTIONS, HunyuanImageVAEOptions,
                     checkpoint_class="AutoencoderKLHunyuanImage", config=HunyuanImageVAEConfig,
                     model=HunyuanImageVAEModel, row_sharding="hunyuanimage2.1")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "HunyuanImageVAEConfig", "HunyuanImageVAEModel",
           "HunyuanImageVAEOptions", "build"]
