"""The HunyuanVideo 1.5 VAE family: diffusers `AutoencoderKLHunyuanVideo15` (32 latent channels, 16x
space, 4x time), its decoder.

config.py: presets, the config.json fields, structure rules and options; layers.py: the
replicate-padded causal conv with its chunk cache, the upsamplers with their channel-repeating
shortcuts, the frame-causal attention and the decoder; model.py: the chunked, streaming decoder with
the pipeline's latent scaling around it."""
from ..contract import VIDEO_DECODER
from ..family import ModelFamily
from .config import DESCRIPTIONS, PRESETS, HunyuanVideo15VAEConfig, HunyuanVideo15VAEOptions
from .model import HunyuanVideo15VAEDecoder

FAMILY = ModelFamily(VIDEO_DECODER, "HunyuanVideo 1.5 VAE", PRESETS, DESCRIPTIONS, HunyuanVideo15VAEOptions,
                     checkpoint_class="AutoencoderKLHunyuanVideo15", config=HunyuanVideo15VAEConfig,
                     model=HunyuanVideo15VAEDecoder, row_sharding="hunyuanvideo1.5")
build = FAMILY.build

__all__ = ["DESCRIPTIONS", "FAMILY", "PRESETS", "HunyuanVideo15VAEConfig", "HunyuanVideo15VAEDecoder",
           "HunyuanVideo15VAEOptions", "build"]
