"""The ConvNeXt image-encoder family (timm's and Hugging Face's checkpoints).

model.py: presets, config, layers, the encoder and `load`, which reads either checkpoint form (its
checkpoints are not diffusers-shaped, so the family gives a Loader); checkpoint.py: the two namings
and their config files."""
from ..contract import IMAGE_ENCODER
from ..family import ModelFamily, ModelOptions
from .model import DESCRIPTIONS, PRESETS, ConvNeXtConfig, ConvNeXtEncoder, load

FAMILY = ModelFamily(IMAGE_ENCODER, "ConvNeXt", PRESETS, DESCRIPTIONS, ModelOptions, load=load)
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "ConvNeXtConfig", "ConvNeXtEncoder", "build"]
