"""diffusers `AutoencoderKLHunyuanImage` (the HunyuanImage 2.1 image VAE): presets, the config read
from config.json and the family's options.

The real preset follows hunyuanvideo-community/HunyuanImage-2.1-Diffusers/vae as we read it (64
latent channels, 32x: six levels, five resamplers); its config.json was not checked against the Hub
here (no network). The tiny preset keeps the structure (channel-repeating shortcuts around every
resampler, one mid-block attention) at widths GroupNorm's fixed 32 groups allow, spatial factor 4.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..autoencoder_kl.config import AutoencoderKLOptions
from ..nn.weights import DiffusersConfig, ModelConfigError

#: every GroupNorm of the class has 32 groups and eps 1e-6 (fixed in diffusers' code, not the config)
GROUPS, NORM_EPS = 32, 1e-6

PRESETS: dict[str, dict] = {
    "hunyuanimage2.1-vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 64,
                            "block_out_channels": [128, 256, 512, 512, 1024, 1024], "layers_per_block": 2,
                            "spatial_compression_ratio": 32, "sample_size": 384, "scaling_factor": 0.75289,
                            "downsample_match_channel": True, "upsample_match_channel": True},
    "tiny-hunyuanimage-vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 16,
                              "block_out_channels": [32, 64, 64], "layers_per_block": 1,
                              "spatial_compression_ratio": 4, "sample_size": 64, "scaling_factor": 0.75289,
                              "downsample_match_channel": True, "upsample_match_channel": True},
}

DESCRIPTIONS = {
    "hunyuanimage2.1-vae": "HunyuanImage 2.1 VAE (hunyuanvideo-community/HunyuanImage-2.1-Diffusers/vae; "
                           "64 latent channels, 32x, scaling 0.75289)",
    "tiny-hunyuanimage-vae": "tiny HunyuanImage-2.1-style VAE (16 latent channels, 4x) for tests and CPU demos",
}

#: the image VAE's options (tile size and overlap, memory budget, with_encoder); upsample_mode is
#: not read: this decoder's upsamplers are convs followed by a channel-to-space shuffle
HunyuanImageVAEOptions = AutoencoderKLOptions


@dataclass(frozen=True)
class HunyuanImageVAEConfig(DiffusersConfig):
    """The fields of diffusers' AutoencoderKLHunyuanImage config.json that shape the computation."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 64
    block_out_channels: tuple[int, ...] = (128, 256, 512, 512, 1024, 1024)
    layers_per_block: int = 2
    spatial_compression_ratio: int = 32
    sample_size: int = 384
    scaling_factor: float = 0.75289
    downsample_match_channel: bool = True
    upsample_match_channel: bool = True

    # ---- the structure diffusers builds from these fields ----------------------------------------
    def _resampled(self, i: int) -> bool:
        return i < np.log2(self.spatial_compression_ratio) and i != len(self.block_out_channels) - 1

    def encoder_levels(self) -> list[tuple[int, int, int | None]]:
        """Per level (resnet input, resnet width, downsample output or None), as diffusers' encoder."""
        boc, out, prev = self.block_out_channels, [], self.block_out_channels[0]
        for i, ch in enumerate(boc):
            down = (boc[i + 1] if self.downsample_match_channel else ch) if self._resampled(i) else None
            out.append((prev, ch, down))
            prev = down or ch
        return out

    def decoder_levels(self) -> list[tuple[int, int, int | None]]:
        """Per level (resnet input, resnet width, upsample output or None), from the widest level."""
        widths, out = list(reversed(self.block_out_channels)), []
        prev = widths[0]
        for i, ch in enumerate(widths):
            up = (widths[i + 1] if self.upsample_match_channel else ch) if self._resampled(i) else None
            out.append((prev, ch, up))
            prev = up or ch
        return out

    def validate(self) -> None:
        problems, boc, z = [], self.block_out_channels, self.latent_channels
        if any(c % GROUPS for c in boc):
            problems.append(f"block_out_channels {list(boc)} must be multiples of 32 (GroupNorm's 32 groups)")
        if boc[0] % z or boc[-1] % (2 * z):
            problems.append(f"latent_channels {z} must divide block_out_channels[0] and half of [-1]")
        # diffusers' resnet adds its input unchanged: a resnet that changes width fails there too
        for side, levels in (("encoder", self.encoder_levels()), ("decoder", self.decoder_levels())):
            if any(cin != ch for cin, ch, _ in levels):
                problems.append(f"the {side} would change width inside a level (set its *_match_channel)")
        for cin, ch, down in self.encoder_levels():
            if down is not None and (down % 4 or (4 * ch) % down):
                problems.append(f"a downsample {ch}->{down} (4x{ch} must be a multiple of {down}, itself of 4)")
        for cin, ch, up in self.decoder_levels():
            if up is not None and (4 * up) % ch:
                problems.append(f"an upsample {ch}->{up} (4x{up} must be a multiple of {ch})")
        if self.spatial_compression_ratio != 2 ** sum(up is not None for *_, up in self.decoder_levels()):
            problems.append(f"spatial_compression_ratio {self.spatial_compression_ratio} must be 2 ** the "
                            f"number of resamplers ({len(boc) - 1} at most)")
        if problems:
            raise ModelConfigError("unsupported AutoencoderKLHunyuanImage config: " + "; ".join(problems))

    @property
    def spatial_factor(self) -> int:
        return int(self.spatial_compression_ratio)

    @property
    def mid_block_add_attention(self) -> bool:  # models/nn/tile_memory.py's estimates read it
        return True
