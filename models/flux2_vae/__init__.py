"""The FLUX.2 image-VAE family: diffusers `AutoencoderKLFlux2`, the AutoencoderKL model with the
FLUX.2 pipeline's latent handling around it (model.py)."""
from ..autoencoder_kl.config import AutoencoderKLOptions
from ..contract import IMAGE_DECODER
from ..family import ModelFamily
from .model import DESCRIPTIONS, PRESETS, Flux2VAEConfig, Flux2VAEModel

FAMILY = ModelFamily(IMAGE_DECODER, "FLUX.2 VAE", PRESETS, DESCRIPTIONS, AutoencoderKLOptions,
                     checkpoint_class="AutoencoderKLFlux2", config=Flux2VAEConfig, model=Flux2VAEModel, row_sharding="flux2")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "Flux2VAEConfig", "Flux2VAEModel", "build"]
