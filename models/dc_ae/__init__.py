"""SANA's deep-compression autoencoder: diffusers `AutoencoderDC` (DC-AE, 32 latent channels, 32x).

config.py: presets, the config.json fields and structure rules; layers.py: its ResBlocks,
EfficientViT blocks (multi-scale ReLU linear attention, models/nn/linear_attention.py), resamplers
with channel-duplicating and channel-averaging shortcuts, encoder and decoder; model.py: the model
with the pipeline's latent scaling around it."""
from ..contract import IMAGE_DECODER
from ..family import ModelFamily
from .config import DESCRIPTIONS, PRESETS, DCAEConfig, DCAEOptions
from .model import DCAEModel

FAMILY = ModelFamily(IMAGE_DECODER, "SANA DC-AE", PRESETS, DESCRIPTIONS, DCAEOptions,
                     checkpoint_class="AutoencoderDC", config=DCAEConfig, model=DCAEModel, row_sharding="dc-ae")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "DCAEConfig", "DCAEModel", "DCAEOptions", "build"]
