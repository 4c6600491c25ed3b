"""diffusers `AutoencoderKLHunyuanVideo15` (the HunyuanVideo 1.5 video VAE): presets, the config read
from config.json and the family's options.

The real preset is the diffusers class's defaults, which is how we read
hunyuanvideo-community/HunyuanVideo-1.5-Diffusers-480p_t2v/vae (32 latent channels, 16x space, 4x
time, scaling_factor 1.03682); its config.json was not checked against the Hub here (no network).
The tiny preset keeps the structure (replicate-padded causal convs, channel-repeating shortcuts
around conv_in and every upsampler, temporal and spatial-only upsamplers, the frame-causal
mid-block attention) at a few channels, spatial factor 8.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..family import ModelOptions
from ..nn.weights import DiffusersConfig, ModelConfigError

PRESETS: dict[str, dict] = {
    "hunyuanvideo1.5-vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 32,
                            "block_out_channels": [128, 256, 512, 1024, 1024], "layers_per_block": 2,
                            "spatial_compression_ratio": 16, "temporal_compression_ratio": 4,
                            "downsample_match_channel": True, "upsample_match_channel": True,
                            "scaling_factor": 1.03682},
    "tiny-hunyuanvideo1.5-vae": {"in_channels": 3, "out_channels": 3, "latent_channels": 8,
                                 "block_out_channels": [16, 32, 32, 64], "layers_per_block": 1,
                                 "spatial_compression_ratio": 8, "temporal_compression_ratio": 4,
                                 "downsample_match_channel": True, "upsample_match_channel": True,
                                 "scaling_factor": 1.03682},
}

DESCRIPTIONS = {
    "hunyuanvideo1.5-vae": "HunyuanVideo 1.5 video VAE decoder (hunyuanvideo-community/HunyuanVideo-1.5-"
                           "Diffusers-480p_t2v/vae; 32 latent channels, 16x space, 4x time, scaling 1.03682)",
    "tiny-hunyuanvideo1.5-vae": "tiny HunyuanVideo-1.5-style video VAE decoder (8 latent channels, 8x space, "
                                "4x time) for tests and CPU demos",
}

#: frames up to 720p decode untiled unless asked (tiled=None), as the Wan decoders
DEFAULT_MAX_UNTILED_PIXELS = 1280 * 720


@dataclass(frozen=True)
class HunyuanVideo15VAEOptions(ModelOptions):
    """The family's own settings, beside ModelOptions' tile_size (which, when given, replaces
    tile_sample_min_size), seed and config."""

    #: diffusers' tile_sample_min_height/width: output pixels per tile side (the latent tile is
    #: this / spatial factor, as diffusers derives it)
    tile_sample_min_size: int = 256
    #: diffusers' tile_overlap_factor
    tile_overlap_factor: float = 0.25
    #: tiled=None tiles only frames above this many output pixels
    max_untiled_pixels: int = DEFAULT_MAX_UNTILED_PIXELS


@dataclass(frozen=True)
class HunyuanVideo15VAEConfig(DiffusersConfig):
    """The fields of diffusers' AutoencoderKLHunyuanVideo15 config.json that shape the decoder."""

    in_channels: int = 3
    out_channels: int = 3
    latent_channels: int = 32
    block_out_channels: tuple[int, ...] = (128, 256, 512, 1024, 1024)
    layers_per_block: int = 2
    spatial_compression_ratio: int = 16
    temporal_compression_ratio: int = 4
    downsample_match_channel: bool = True
    upsample_match_channel: bool = True
    scaling_factor: float = 1.03682

    # ---- the structure diffusers builds from these fields ----------------------------------------
    def decoder_levels(self) -> list[tuple[int, int, int | None, bool]]:
        """Per up block (resnet input, resnet width, upsample output or None, temporal upsample),
        from the widest level, as HunyuanVideo15Decoder3D builds them."""
        widths, out = list(reversed(self.block_out_channels)), []
        prev = widths[0]
        for i, ch in enumerate(widths):
            spatial = i < np.log2(self.spatial_compression_ratio)
            temporal = bool(i < np.log2(self.temporal_compression_ratio))
            up = None
            if spatial or temporal:
                up = widths[i + 1] if self.upsample_match_channel and i + 1 < len(widths) else ch
            out.append((prev, ch, up, temporal))
            prev = up or ch
        return out

    def encoder_levels(self) -> list[tuple[int, int, int | None, bool]]:
        """Per down block (resnet input, resnet width, downsample output or None, temporal
        downsample), as HunyuanVideo15Encoder3D builds them."""
        widths, out = list(self.block_out_channels), []
        prev, s, t = widths[0], self.spatial_compression_ratio, self.temporal_compression_ratio
        for i, ch in enumerate(widths):
            down, temporal = None, False
            if i < np.log2(s):
                temporal = bool(i >= np.log2(s // t))
                down = widths[i + 1] if self.downsample_match_channel else ch
            out.append((prev, ch, down, temporal))
            prev = down or ch
        return out

    def encoder_problems(self) -> list[str]:
        """What diffusers' encoder could not run with these fields (its views would fail); checked
        only where a checkpoint holds the encoder, so a decoder-only config is not refused for it."""
        problems, z2 = [], 2 * self.latent_channels
        if self.block_out_channels[-1] % z2:
            problems.append(f"2 * latent_channels ({z2}) must divide block_out_channels[-1] "
                            f"({self.block_out_channels[-1]}: the encoder's output shortcut averages groups)")
        for _, ch, down, temporal in self.encoder_levels():
            factor = 8 if temporal else 4
            if down is not None and (down % factor or (factor * ch) % down or (temporal and (factor * ch // down) % 2)):
                problems.append(f"a downsample {ch}->{down} (its conv gives {down}/{factor} channels, its shortcut "
                                f"averages {factor}x{ch} channels to {down}{', in even groups' if temporal else ''})")
        return problems

    def validate(self) -> None:
        problems, widths, z = [], list(reversed(self.block_out_channels)), self.latent_channels
        s, t = self.spatial_compression_ratio, self.temporal_compression_ratio
        if s < 1 or s & (s - 1) or t < 1 or t & (t - 1):
            problems.append(f"spatial {s} and temporal {t} compression ratios must be powers of two")
        elif not t <= s <= 2 ** (len(widths) - 1):
            problems.append(f"need temporal {t} <= spatial {s} <= 2 ** {len(widths) - 1} (one upsampler per "
                            f"level but the last; a temporal upsampler is a spatial one too)")
        if widths[0] % z:
            problems.append(f"latent_channels {z} must divide block_out_channels[-1] ({widths[0]}: conv_in's "
                            f"shortcut repeats the latents)")
        if not problems:
            for cin, ch, up, temporal in self.decoder_levels():
                factor = 8 if temporal else 4
                if up is not None and ((factor * up) % ch or (temporal and (factor * up // ch) % 2)):
                    problems.append(f"an upsample {ch}->{up} (its shortcut repeats {ch} channels to {factor}x{up}"
                                    f"{', an even number of times' if temporal else ''})")
        if self.out_channels != 3:
            problems.append(f"out_channels must be 3 (RGB), got {self.out_channels}")
        if problems:
            raise ModelConfigError("unsupported AutoencoderKLHunyuanVideo15 config: " + "; ".join(problems))

    @property
    def spatial_factor(self) -> int:
        return int(self.spatial_compression_ratio)

    @property
    def temporal_factor(self) -> int:
        return int(self.temporal_compression_ratio)
