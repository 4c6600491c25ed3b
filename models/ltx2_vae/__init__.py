"""The LTX-2 video-VAE family: diffusers `AutoencoderKLLTX2Video` (128 latent channels, 32x space,
8x time).

config.py: presets, the config.json fields, structure rules and options; layers.py: its causal /
non-causal 3-D convs with reflect padding, pixel-norm resnets with timestep modulation and the
residual depth-to-space upsamplers; encoder.py: the encoder (patchify, space-to-depth downsamplers
with their averaged shortcuts); model.py: the decoder with the pipeline's de-normalisation around it,
whole-clip decode handed out in frame groups, and encode with the image-to-video pipeline's
normalisation."""
from ..contract import VIDEO_DECODER
from ..family import ModelFamily
from .config import DESCRIPTIONS, PRESETS, LTX2VAEConfig, LTX2VAEOptions
from .model import LTX2VAEModel

FAMILY = ModelFamily(VIDEO_DECODER, "LTX-2 VAE", PRESETS, DESCRIPTIONS, LTX2VAEOptions,
                     checkpoint_class="AutoencoderKLLTX2Video", config=LTX2VAEConfig, model=LTX2VAEModel,
                     row_sharding="ltx2")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "LTX2VAEConfig", "LTX2VAEModel", "LTX2VAEOptions", "build"]
