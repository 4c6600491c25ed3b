"""The tiny preview-decoder family: diffusers `AutoencoderTiny` (TAESD, TAESDXL, TAEF1).

model.py: presets, config, options and the model; layers.py: its encoder and decoder blocks;
checkpoint.py: madebyollin's original names -> diffusers'."""
from ..contract import IMAGE_DECODER
from ..family import ModelFamily
from .model import DESCRIPTIONS, PRESETS, AutoencoderTinyConfig, AutoencoderTinyModel, TAESDOptions

FAMILY = ModelFamily(IMAGE_DECODER, "TAESD", PRESETS, DESCRIPTIONS, TAESDOptions,
                     checkpoint_class="AutoencoderTiny", config=AutoencoderTinyConfig, model=AutoencoderTinyModel, row_sharding="taesd")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "AutoencoderTinyConfig", "AutoencoderTinyModel", "TAESDOptions", "build"]
