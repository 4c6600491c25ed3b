"""diffusers `AutoencoderDC` (SANA's DC-AE) on the backend interface.

What the pipeline does around the VAE (diffusers' SanaPipeline):
    decode: latents / vae.config.scaling_factor -> vae.decode -> (x / 2 + 0.5).clamp(0, 1)
            (no shift factor); this model takes the latents as the pipeline holds them before that
            division and does the rest, x / 2 + 0.5 folded into conv_out.
    encode: AutoencoderDC's encoder returns the latent itself (no distribution); encode returns it
            times scaling_factor, what the SANA image-to-image pipelines hand the denoiser and what
            decode takes back.
Tiled decode is diffusers' own rule for this class: 512-pixel tiles every 448 (16 latents every
14, an overlap of 1/8), blended linearly and cropped: the image VAE's rule at overlap 0.125
(models/nn/tiling.py). Encode is untiled here (tiled=True is refused).
"""
from __future__ import annotations

from ..hunyuanimage_vae.model import HunyuanImageVAEModel
from .config import DCAEOptions
from .layers import Decoder, Encoder

#: random init: U(+-1/sqrt(fan_in)) as PyTorch's default, norms identity
INIT_RULES = ((r"norm[^.]*\.weight$", "ones"), (r"norm[^.]*\.bias$", "zeros"), ("", "uniform"))


class DCAEModel(HunyuanImageVAEModel):
    """An image decoder (and encoder when the checkpoint has one) per docs/interfaces.md: the
    HunyuanImage VAE's model around DC-AE's own decoder and encoder (both scale the latents by one
    factor, both fold x / 2 + 0.5 into conv_out). The encoder's output is its latent itself (no
    distribution), times scaling_factor, as the HunyuanImage encoder's posterior mean is."""

    architecture = "diffusers AutoencoderDC (SANA DC-AE)"
    checkpoint_class = "AutoencoderDC"
    decoder_class, encoder_class, options_class, init_rules = Decoder, Encoder, DCAEOptions, INIT_RULES
    tiled_encode_refusal = "AutoencoderDC's tiled encode is not ported yet"

    @staticmethod
    def default_tile_latent(cfg) -> int:
        """diffusers: tile_sample_min 512 pixels, 16 latents at 32x"""
        return max(2, 512 // cfg.spatial_factor)
