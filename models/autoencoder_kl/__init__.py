"""The image-VAE family: diffusers `AutoencoderKL` (SD 1.x/2.x, SDXL, FLUX.1).

config.py: presets, the config.json fields and the family's options; checkpoint.py: original
(LDM) checkpoint names -> diffusers'; model.py: the layer tree and the model."""
from ..contract import IMAGE_DECODER
from ..family import ModelFamily
from .config import DESCRIPTIONS, PRESETS, AutoencoderKLConfig, AutoencoderKLOptions
from .model import AutoencoderKLModel

FAMILY = ModelFamily(IMAGE_DECODER, "image VAE", PRESETS, DESCRIPTIONS, AutoencoderKLOptions,
                     checkpoint_class="AutoencoderKL", config=AutoencoderKLConfig, model=AutoencoderKLModel, row_sharding="autoencoder-kl")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "AutoencoderKLConfig", "AutoencoderKLModel", "AutoencoderKLOptions",
           "build"]
