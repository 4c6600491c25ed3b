"""diffusers `AutoencoderKLFlux2` (the FLUX.2 image VAE) on the backend interface: the FLUX.2 VAE
family's presets, config and model (its `FAMILY` is in the package's __init__.py).

FLUX.2's encoder and decoder are the SD layout of `autoencoder_kl` with 32 latent channels, so the
model is that family's model with the FLUX.2 pipeline's latent handling around it. What the
transformer produces, and what this model takes, is a 2x2-patchified grid (32 * 4 = 128 channels
at half the latent resolution) normalised per channel by the running statistics of the VAE's
`bn` (a BatchNorm2d without affine that is never run as a layer):

    decode: x (N, 128, h', w') -> x * sqrt(bn.running_var + batch_norm_eps) + bn.running_mean
            -> unpatchify -> (N, 32, 2h', 2w') -> decoder -> images (N, 16h', 16w', 3) in [0, 1]
    encode: images -> posterior mean (N, 32, H/8, W/8) -> patchify -> normalise -> (N, 128, H/16, W/16)

A patch's 4 values are channels c*4 + 2*dy + dx (the pipeline's `_patchify_latents`). The checkpoint
holds `bn.running_mean` / `bn.running_var`; its training counter `bn.num_batches_tracked` is dropped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from convkernels import Backend

from ..autoencoder_kl import model as autoencoder_kl
from ..autoencoder_kl.config import _SD_BLOCKS, _TINY_BLOCKS, AutoencoderKLConfig, AutoencoderKLOptions
from ..autoencoder_kl.model import AutoencoderKLModel
from ..contract import ROW_MAJOR_TOKENS
from ..nn.module import Module
from ..nn.weights import ModelConfigError

#: the pipeline patchifies 2x2 (its _patchify_latents is written for that size alone)
PATCH = 2

_FLUX2 = {"latent_channels": 32, "use_quant_conv": True, "use_post_quant_conv": True,
          "mid_block_add_attention": True, "batch_norm_eps": 1e-4, "batch_norm_momentum": 0.1,
          "patch_size": [PATCH, PATCH]}

PRESETS: dict[str, dict] = {
    "flux2-vae": {**_SD_BLOCKS, **_FLUX2, "sample_size": 1024},
    "tiny-flux2-vae": {**_TINY_BLOCKS, **_FLUX2},
}

DESCRIPTIONS = {
    "flux2-vae": "FLUX.2 VAE (black-forest-labs/FLUX.2-dev/vae; input: the pipeline's 128-channel "
                 "patchified, BatchNorm-normalised latents)",
    "tiny-flux2-vae": "tiny FLUX.2-style VAE (32 latent channels, 2x2 patches, BN stats) for tests and CPU demos",
}

#: random init: the BatchNorm statistics start as a fresh BatchNorm2d's (mean 0, variance 1)
INIT_RULES = ((r"^bn\.running_mean$", "zeros"), (r"^bn\.running_var$", "ones"), *autoencoder_kl.INIT_RULES)


@dataclass(frozen=True)
class Flux2VAEConfig(AutoencoderKLConfig):
    """diffusers AutoencoderKLFlux2's config.json fields that shape the computation. It has no
    scaling or shift factor: the BatchNorm statistics take their place."""

    latent_channels: int = 32
    sample_size: int = 1024
    scaling_factor: float = 1.0
    decoder_block_out_channels: tuple[int, ...] | None = None
    batch_norm_eps: float = 1e-4
    #: training only (how the running statistics were updated); kept so the card shows it
    batch_norm_momentum: float = 0.1
    patch_size: tuple[int, ...] = (PATCH, PATCH)

    def validate(self) -> None:
        super().validate()
        problems = []
        if tuple(self.patch_size) != (PATCH, PATCH):
            problems.append(f"patch_size {list(self.patch_size)} (the FLUX.2 pipeline patchifies 2x2)")
        if self.scaling_factor != 1.0 or self.shift_factor:
            problems.append("scaling_factor/shift_factor (FLUX.2 normalises with the BatchNorm statistics)")
        widths = self.decoder_widths
        if len(widths) != len(self.up_block_types) or any(c % self.norm_num_groups for c in widths):
            problems.append(f"decoder_block_out_channels {list(widths)}: one per up block, each a multiple "
                            f"of norm_num_groups {self.norm_num_groups}")
        if problems:
            raise ModelConfigError("unsupported AutoencoderKLFlux2 config: " + "; ".join(problems))

    @property
    def decoder_widths(self) -> tuple[int, ...]:
        return tuple(self.decoder_block_out_channels or self.block_out_channels)


class LatentBatchNormStats(Module):
    """The VAE's `bn`: only its running statistics, kept on the host as the pipeline's
    de-normalisation (mean and sqrt(var + eps), float32 as the pipeline computes them)."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.channels, self.eps = channels, eps

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        return {"running_mean": (self.channels,), "running_var": (self.channels,)}

    def derive(self, tensors: Mapping[str, np.ndarray], prefix: str) -> None:
        self.mean = np.asarray(tensors[prefix + "running_mean"], np.float32)
        var = np.asarray(tensors[prefix + "running_var"], np.float32)
        self.std = np.sqrt(var + np.float32(self.eps))


def normalize_keys(tensors: Mapping[str, np.ndarray], config: Flux2VAEConfig) -> dict[str, np.ndarray]:
    """The image VAE's checkpoint names (diffusers, LDM, a `vae.` prefix), less BatchNorm's
    training counter, which the de-normalisation does not use."""
    out = autoencoder_kl.normalize_keys(tensors, config)
    out.pop("bn.num_batches_tracked", None)
    return out


def patchify_nhwc(z: np.ndarray) -> np.ndarray:
    """(N, H, W, C) -> (N, 4C, H/2, W/2), channel c*4 + 2*dy + dx."""
    n, h, w, c = z.shape
    x = z.reshape(n, h // PATCH, PATCH, w // PATCH, PATCH, c).transpose(0, 5, 2, 4, 1, 3)
    return np.ascontiguousarray(x.reshape(n, c * PATCH * PATCH, h // PATCH, w // PATCH))


def unpatchify_to_nhwc(x: np.ndarray) -> np.ndarray:
    """(N, 4C, h, w) -> (N, 2h, 2w, C): the inverse of patchify_nhwc, channels last for the decoder."""
    n, c4, h, w = x.shape
    c = c4 // (PATCH * PATCH)
    z = x.reshape(n, c, PATCH, PATCH, h, w).transpose(0, 4, 2, 5, 3, 1)
    return np.ascontiguousarray(z.reshape(n, h * PATCH, w * PATCH, c))


class Flux2VAEModel(AutoencoderKLModel):
    """An image decoder (and encoder when the checkpoint has one) per docs/interfaces.md, whose
    latents are the FLUX.2 pipeline's: 128 channels, 16 pixels per latent."""

    architecture = "diffusers AutoencoderKLFlux2 (FLUX.2 image VAE)"
    init_rules, normalize_keys = INIT_RULES, staticmethod(normalize_keys)

    def __init__(self, name: str, preset: str, backend: Backend, cfg: Flux2VAEConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: AutoencoderKLOptions | None = None):
        super().__init__(name, preset, backend, cfg, tensors, weights_source, options)
        # what the service sees: the patchified grid; the decoder's own factor stays cfg.spatial_factor
        self.latent_channels = cfg.latent_channels * PATCH * PATCH
        self.spatial_factor = cfg.spatial_factor * PATCH

    def _latent_parts(self) -> dict[str, Module]:
        self.bn = LatentBatchNormStats(self.config.latent_channels * PATCH * PATCH, self.config.batch_norm_eps)
        return {"bn": self.bn}

    def decode(self, latents_nchw: np.ndarray, tiled: bool | None = None, clamp: bool = True, *,
               uint8: bool = False) -> np.ndarray:
        """The pipeline's normalised, patchified latents (N, 128, h', w') -> float32 (N, 16h', 16w', 3)
        in [0, 1]; tiled, clamp and uint8 as AutoencoderKLModel.decode (tiles are of the unpatchified
        latents, as diffusers' tiled decode sees them)."""
        return self._decode_unscaled(self.decoder_latents(latents_nchw), tiled, clamp, uint8)

    def decoder_latents(self, latents_nchw) -> np.ndarray:
        """(N, 128, h', w'), checked -> the decoder's latents (N, 2h', 2w', 32), host float32: the
        BatchNorm de-normalisation, then unpatchify (each patched row gives two: row-local)."""
        lat = np.asarray(latents_nchw)
        if lat.ndim != 4 or lat.shape[1] != self.latent_channels:
            raise ValueError(f"{self.name}: latents must be (N, {self.latent_channels}, h, w), got {lat.shape}")
        x = lat.astype(np.float32) * self.bn.std[:, None, None] + self.bn.mean[:, None, None]
        return unpatchify_to_nhwc(x)

    def encode(self, images_nhwc01: np.ndarray, tiled: bool | None = None) -> np.ndarray:
        """Images (N, H, W, 3) in [0, 1] -> (N, 128, H/16, W/16) as the pipeline's _encode_vae_image:
        the posterior mean, patchified, normalised. The mean's sides (H/8, W/8 floored) must be even."""
        mean = self._encode_unscaled(images_nhwc01, tiled)
        if mean.shape[1] % PATCH or mean.shape[2] % PATCH:
            raise ValueError(f"{self.name}: images {list(np.shape(images_nhwc01))[1:3]} give latents "
                             f"{list(mean.shape[1:3])}, which do not split into 2x2 patches: use sides "
                             f"whose H/8 and W/8 are even (multiples of 16)")
        x = patchify_nhwc(mean)
        return (x - self.bn.mean[:, None, None]) / self.bn.std[:, None, None]

    def card(self) -> dict:
        # the remote-VAE route unpacks this pipeline's (B, h' * w', 128) tokens by it
        # latent_patch: the service checks an encode's image sides give whole patches
        return {**super().card(), "packed_latents": ROW_MAJOR_TOKENS, "latent_patch": PATCH}
