"""The Wan 2.2 video VAE (TI2V-5B's `Wan-AI/Wan2.2-TI2V-5B-Diffusers/vae`: diffusers
`AutoencoderKLWan` with `is_residual=True`), `kind == "video-decoder"`, with its encoder when the
checkpoint holds it: the Wan 2.2 VAE family's presets, config and model (its `FAMILY` is in the package's
__init__.py), built on the
Wan 2.1 family (models/wan_vae/model.py).

What Wan 2.2 changes in the decoder (models/wan22_vae/layers.py): residual up blocks whose input
is added back through a parameter-free DupUp3D shortcut, no channel halving between blocks (each
upsampler keeps its width), its own decoder width (`decoder_base_dim`), and a 2x2 patch: the
decoder gives 3 * 2 * 2 channels at 8x that unpatchify makes RGB at 16x. Decoding is Wan 2.1's:
chunked and causal, one latent frame at a time (1 frame, then 4 per later latent frame).

    decode: x (N, 48, T, h, w), normalised
            -> x / (1 / latents_std) + latents_mean     (the Wan pipelines' de-normalisation, per channel)
            -> post_quant_conv, the residual decoder one latent frame at a time -> unpatchify
            -> clamp to [-1, 1], x / 2 + 0.5 -> frames (N, 1 + 4 (T - 1), 16h, 16w, 3) in [0, 1]

    encode: frames (N, 1 + 4k, H, W, 3) in [0, 1] -> x * 2 - 1 -> patchify (2x2 -> 12 channels)
            -> the residual encoder (AvgDown3D shortcuts, models/wan22_vae/encoder.py) chunk by chunk,
               1 frame then 4, with the causal cache -> quant_conv -> posterior mean
            -> (mean - latents_mean) * (1 / latents_std)   (the TI2V pipeline's prepare_latents)
            -> (N, 48, 1 + k, H/16, W/16)

Tiled decoding follows diffusers' tiled_decode: tiles of `tile_sample_min_size` output pixels
(16 per latent) every `tile_sample_stride`, blended in the decoder's patched pixels (half those
sizes), unpatchified after stitching.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import numpy as np

from convkernels import Backend

from ..nn import interrupt
from ..nn.module import random_state_dict
from ..nn.tiling import plan_video_tiles, stitch_video_tiles, video_tiles
from ..nn.weights import WeightsError
from ..wan_vae.checkpoint import checkpoint_naming, normalize_keys
from ..wan_vae.encoder import EncoderTree
from ..wan_vae.layers import FeatureCache
from ..wan_vae.model import INIT_RULES, WanVAEConfig, WanVAEDecoder, WanVAEOptions
from .encoder import ResidualEncoder3d, patchify
from .layers import ResidualDecoder3d, unpatchify

# Wan-AI/Wan2.2-TI2V-5B-Diffusers, subfolder vae, config.json (the same 48 values as the original
# Wan 2.2 release's Wan2_2_VAE and diffusers' conversion script vae22_diffusers_config)
WAN22_LATENTS_MEAN = [
    -0.2289, -0.0052, -0.1323, -0.2339, -0.2799, 0.0174, 0.1838, 0.1557,
    -0.1382, 0.0542, 0.2813, 0.0891, 0.1570, -0.0098, 0.0375, -0.1825,
    -0.2246, -0.1207, -0.0698, 0.5109, 0.2665, -0.2108, -0.2158, 0.2502,
    -0.2055, -0.0322, 0.1109, 0.1567, -0.0729, 0.0899, -0.2799, -0.1230,
    -0.0313, -0.1649, 0.0117, 0.0723, -0.2839, -0.2083, -0.0520, 0.3748,
    0.0152, 0.1957, 0.1433, -0.2944, 0.3573, -0.0548, -0.1681, -0.0667,
]
WAN22_LATENTS_STD = [
    0.4765, 1.0364, 0.4514, 1.1677, 0.5313, 0.4990, 0.4818, 0.5013,
    0.8158, 1.0344, 0.5894, 1.0901, 0.6885, 0.6165, 0.8454, 0.4978,
    0.5759, 0.3523, 0.7135, 0.6804, 0.5833, 1.4146, 0.8986, 0.5659,
    0.7069, 0.5338, 0.4889, 0.4917, 0.4069, 0.4999, 0.6866, 0.4093,
    0.5709, 0.6065, 0.6415, 0.4944, 0.5726, 1.2042, 0.5458, 1.6887,
    0.3971, 1.0600, 0.3943, 0.5537, 0.5444, 0.4089, 0.7468, 0.7744,
]

PRESETS: dict[str, dict] = {
    "wan2.2-vae": {
        "base_dim": 160, "decoder_base_dim": 256, "z_dim": 48, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
        "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
        "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_temporal": 4,
        "scale_factor_spatial": 16, "latents_mean": WAN22_LATENTS_MEAN, "latents_std": WAN22_LATENTS_STD,
    },
    "tiny-wan2.2-vae": {
        "base_dim": 8, "decoder_base_dim": 8, "z_dim": 12, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
        "attn_scales": [], "temperal_downsample": [False, True, True], "dropout": 0.0, "is_residual": True,
        "in_channels": 12, "out_channels": 12, "patch_size": 2, "scale_factor_temporal": 4,
        "scale_factor_spatial": 16,
        "latents_mean": [round(0.1 * ((7 * i) % 11 - 5), 2) for i in range(12)],
        "latents_std": [round(0.4 + 0.15 * ((5 * i) % 13), 2) for i in range(12)],
    },
}

DESCRIPTIONS = {
    "wan2.2-vae": "Wan 2.2 video VAE decoder and encoder (Wan-AI/Wan2.2-TI2V-5B-Diffusers/vae, AutoencoderKLWan "
                  "is_residual; 48 latent channels, 16x space, 4x time)",
    "tiny-wan2.2-vae": "tiny Wan-2.2-architecture video VAE decoder and encoder for tests and CPU demos "
                       "(12 latent channels, 16x space; 3x4x4 latents -> 9x64x64 in well under a second)",
}

#: frames per chunk of diffusers' AutoencoderKLWan._encode after the first (lone) frame
ENCODE_CHUNK_FRAMES = 4


@dataclass(frozen=True)
class Wan22VAEConfig(WanVAEConfig):
    """diffusers AutoencoderKLWan's config.json fields, Wan 2.2's values by default."""

    base_dim: int = 160
    decoder_base_dim: int | None = 256
    z_dim: int = 48
    latents_mean: tuple[float, ...] = tuple(WAN22_LATENTS_MEAN)
    latents_std: tuple[float, ...] = tuple(WAN22_LATENTS_STD)
    is_residual: bool = True
    in_channels: int = 12
    out_channels: int = 12
    patch_size: int | None = 2
    scale_factor_spatial: int | None = 16
    #: older diffusers' switch for decode's clamp to [-1, 1]; the pipeline clamps its x / 2 + 0.5
    #: to [0, 1] either way, so the frames do not depend on it (read and ignored)
    clip_output: bool = False

    @property
    def patch(self) -> int:
        return self.patch_size or 1

    def variant_problems(self) -> list[str]:
        problems = []
        if not self.is_residual:
            problems.append("is_residual=False is the Wan 2.1 VAE: use the wan2.1-vae preset")
        if self.patch < 1:
            problems.append(f"patch_size must be >= 1, got {self.patch_size}")
        else:
            for what in ("in_channels", "out_channels"):
                if getattr(self, what) != 3 * self.patch ** 2:
                    problems.append(f"{what} must be 3 * patch_size^2 = {3 * self.patch ** 2} (RGB patches), "
                                    f"got {getattr(self, what)}")
        return problems

    @property
    def spatial_factor(self) -> int:
        """Output pixels per latent: the decoder's 2x per upsampling block, times the patch."""
        return 2 ** (len(self.dim_mult) - 1) * self.patch


class Wan22VAEDecoder(WanVAEDecoder):
    """Video decoder per docs/interfaces.md: normalised latents (N, 48, T, h, w) -> float32 frames
    (N, 1 + 4*(T-1), 16h, 16w, 3) in [0, 1]; and, when the checkpoint has the encoder
    (`has_encoder`), frames -> normalised latents."""

    decoder_class = ResidualDecoder3d
    architecture = ("diffusers AutoencoderKLWan, is_residual (Wan 2.2 video VAE: residual up and down blocks "
                    "with DupUp3D and AvgDown3D shortcuts, 2x2 patches)")

    def __init__(self, name: str, preset: str, backend: Backend, cfg: Wan22VAEConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: WanVAEOptions | None = None):
        if tensors is not None and checkpoint_naming(tensors) != "diffusers":
            raise WeightsError(f"{weights_source or 'checkpoint'}: original-Wan tensor names are read for the "
                               "Wan 2.1 VAE only; give the Wan 2.2 VAE in diffusers naming "
                               "(Wan-AI/Wan2.2-TI2V-5B-Diffusers, subfolder vae)")
        options = options or WanVAEOptions()
        super().__init__(name, preset, backend, cfg, tensors, weights_source, options)
        # the pipelines' own form: latents_std = 1 / std (float32), then latents / latents_std + mean
        self._inv_std = np.float32(1.0) / self._std
        self.encoder_tree = EncoderTree(cfg.base_dim, cfg.z_dim, cfg.dim_mult, cfg.num_res_blocks,
                                        cfg.temperal_downsample, cfg.in_channels, ResidualEncoder3d)
        wanted = self.encoder_tree.expected_shapes()
        # random init makes the encoder too (seeded apart from the decoder); a checkpoint has it or not
        encoder = random_state_dict(wanted, options.seed + 1, INIT_RULES) if tensors is None else \
            normalize_keys(tensors, cfg)
        self.has_encoder = any(k in encoder for k in wanted)
        if self.has_encoder:  # a partial encoder is an error like any other gap
            self.encoder_tree.load_checked(encoder, backend, f"{self.reference_class} encoder (preset {preset!r})",
                                           ignore_unexpected=("decoder.", "post_quant_conv."))

    def _denormalise(self, lat: np.ndarray) -> np.ndarray:
        return lat / self._inv_std + self._mean

    def _frames(self, out):
        return unpatchify(self.backend, out, self.config.patch)

    def _tile_plan(self, h: int, w: int):
        # diffusers tiles by latents of the full factor and blends in the patched pixels
        p = self.config.patch
        patched = video_tiles(self.tiling.tile_px // p, self.tiling.stride_px // p)
        return plan_video_tiles(h, w, self.spatial_factor // p, patched)

    def _stitched(self, plan, tiles) -> np.ndarray:
        return host_unpatchify(stitch_video_tiles(plan, tiles), self.config.patch)

    # ---- encode -----------------------------------------------------------------------------------
    def encode(self, video_nfhw01: np.ndarray) -> np.ndarray:
        """Frames (N, 1 + 4k, H, W, 3) in [0, 1], H and W multiples of 16 -> the Wan 2.2 pipelines'
        normalised latents (N, z_dim, 1 + k, H/16, W/16), float32: the posterior mean, then
        (mean - latents_mean) * (1 / latents_std). Chunked as diffusers' _encode (1 frame, then 4
        at a time through the causal cache), so memory is bounded by one chunk; untiled."""
        if not self.has_encoder:
            raise RuntimeError(f"{self.name}: the checkpoint has no encoder weights")
        x = self._encoder_input(video_nfhw01)
        b, z = self.backend, self.latent_channels
        state = FeatureCache()
        means = []
        for start, stop in encode_chunks(x.shape[1]):
            interrupt.check()  # its requesters gone: stop between chunks
            chunk = patchify(b, b.asarray(np.ascontiguousarray(x[:, start:stop])), self.config.patch)
            means.append(np.asarray(b.to_host(self.encoder_tree(chunk, state)), np.float32)[..., :z])
        mean = np.concatenate(means, axis=1).transpose(0, 4, 1, 2, 3)
        return np.ascontiguousarray((mean - self._mean) * self._inv_std)

    def _encoder_input(self, video) -> np.ndarray:
        return video_encoder_input(self.name, video, self.spatial_factor, ENCODE_CHUNK_FRAMES)

    def card(self) -> dict:
        card = super().card()
        card["input"] = "normalised latents (N, C, T, h, w); decode applies latents / (1 / latents_std) + latents_mean"
        card["has_encoder"] = self.has_encoder
        if self.has_encoder:
            card["encode"] = (f"frames (N, 1 + {ENCODE_CHUNK_FRAMES}k, H, W, 3) in [0, 1], H and W multiples of "
                              f"{self.spatial_factor} -> normalised latents (N, C, 1 + k, H/{self.spatial_factor}, "
                              f"W/{self.spatial_factor}): (mean - latents_mean) * (1 / latents_std)")
        return card


def encode_chunks(frames: int, step: int = ENCODE_CHUNK_FRAMES) -> list[tuple[int, int]]:
    """diffusers' _encode chunks of a 1 + 4k frame clip: the first frame alone, then 4 (step) at a time."""
    return [(0, 1)] + [(s, s + step) for s in range(1, frames, step)]


def video_encoder_input(name: str, video, spatial_factor: int, step: int) -> np.ndarray:
    """Validated frames as a video VAE encoder takes them: float32 x * 2 - 1 (the video processor's
    map to [-1, 1]), N,F,H,W,3 with F = 1 + step * k and sides multiples of spatial_factor; every
    refusal a ValueError naming the rule (the service answers 422)."""
    v = np.asarray(video)
    f = spatial_factor
    if v.ndim != 5 or v.shape[-1] != 3 or min(v.shape) < 1:
        raise ValueError(f"{name}: video must be (N, F, H, W, 3) with every size >= 1, got {v.shape}")
    if (v.shape[1] - 1) % step:
        raise ValueError(f"{name}: the frame count must be 1 + {step}k (1, {1 + step}, {1 + 2 * step}, ...), "
                         f"got {v.shape[1]}")
    if v.shape[2] % f or v.shape[3] % f:
        raise ValueError(f"{name}: height and width must be multiples of {f}, got {v.shape[2]}x{v.shape[3]}")
    if v.dtype.kind != "f":
        raise ValueError(f"{name}: video must be floating point in [0, 1], got {v.dtype}")
    x = np.float32(2.0) * v.astype(np.float32) - np.float32(1.0)
    if not np.isfinite(x).all():
        raise ValueError(f"{name}: video contains NaN or Inf")
    return x


def host_unpatchify(x: np.ndarray, patch: int) -> np.ndarray:
    """wan22_vae_layers.unpatchify on host arrays (stitched tiles)."""
    n, t, h, w, cp = x.shape
    c = cp // (patch * patch)
    x = x.reshape(n, t, h, w, c, patch, patch).transpose(0, 1, 2, 6, 3, 5, 4)
    return np.ascontiguousarray(x.reshape(n, t, h * patch, w * patch, c))
