"""diffusers `AutoencoderTiny` (madebyollin's TAESD, TAESDXL, TAEF1) on the backend interface: the
tiny preview-decoder family's presets, config and model (its `FAMILY` is in the package's __init__.py).

The layer tree mirrors diffusers' names (`decoder.layers.{i}`, `encoder.layers.{i}`, see
layers.py), so a diffusers checkpoint loads by name; madebyollin's original
taesd_{encoder,decoder}.safetensors are renamed onto them (checkpoint.py).

What `AutoencoderTiny.decode` does, and so what this model does: the pipeline first divides its
latents by config.json's scaling_factor and adds shift_factor (1 and 0 for the published TAESD
checkpoints: they decode the pipeline's latents as they are); the decoder squashes its input with
tanh(x / 3) * 3, runs its convs, and maps the result from [0, 1] to [-1, 1], which diffusers'
image processor maps straight back before clipping to [0, 1]. The two maps cancel, so the
decoder's last conv already writes image space here. The encoder likewise maps its [-1, 1] input
to [0, 1] first: it takes our [0, 1] images as they are.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convkernels import Backend, pixels_to_uint8

from ..contract import IMAGE_DECODER, PIXEL_RANGE, card_fields
from ..family import ModelOptions
from ..nn import row_shard, tiling
from ..nn.module import Module, random_state_dict
from ..nn.weights import DiffusersConfig, ModelConfigError
from .checkpoint import checkpoint_naming, normalize_keys
from .layers import TinyDecoder, TinyEncoder

#: AutoencoderTiny's defaults, which the published config.json files keep
_TAESD = {
    "encoder_block_out_channels": [64, 64, 64, 64],
    "decoder_block_out_channels": [64, 64, 64, 64],
    "num_encoder_blocks": [1, 3, 3, 3],
    "num_decoder_blocks": [3, 3, 3, 1],
    "act_fn": "relu",
    "upsample_fn": "nearest",
    "upsampling_scaling_factor": 2,
    "in_channels": 3,
    "out_channels": 3,
    "scaling_factor": 1.0,
    "shift_factor": 0.0,
}

PRESETS: dict[str, dict] = {
    "taesd": {**_TAESD, "latent_channels": 4},
    "taesdxl": {**_TAESD, "latent_channels": 4},
    # TAEF1 decodes FLUX.1's normalised latents as the pipeline holds them: no scale or shift either
    "taef1": {**_TAESD, "latent_channels": 16},
    # the real 4-stage structure (factor 8) at a quarter of the width, one block a stage
    "tiny-taesd": {**_TAESD, "latent_channels": 4, "encoder_block_out_channels": [16, 16, 16, 16],
                   "decoder_block_out_channels": [16, 16, 16, 16], "num_encoder_blocks": [1, 1, 1, 1],
                   "num_decoder_blocks": [1, 1, 1, 1]},
}

DESCRIPTIONS = {
    "taesd": "TAESD tiny preview decoder/encoder for SD 1.x/2.x latents (madebyollin/taesd)",
    "taesdxl": "TAESDXL tiny preview decoder/encoder for SDXL latents (madebyollin/taesdxl)",
    "taef1": "TAEF1 tiny preview decoder/encoder for FLUX.1 latents, 16 channels (madebyollin/taef1)",
    "tiny-taesd": "tiny TAESD-shaped decoder for tests and CPU demos (random init unless weights are given)",
}

#: AutoencoderTiny's tile_sample_min_size (512 px) in latents, and its tile_overlap_factor
DEFAULT_TILE_LATENT = 64
DEFAULT_OVERLAP = 0.125

#: random init: U(+-1/sqrt(fan_in)) as PyTorch's default (there are no norms)
INIT_RULES = (("", "uniform"),)


@dataclass(frozen=True)
class AutoencoderTinyConfig(DiffusersConfig):
    """The fields of diffusers' AutoencoderTiny config.json that shape the computation; the others
    (latent_magnitude, latent_shift, force_upcast, block_out_channels ...) are read and ignored."""

    in_channels: int = 3
    out_channels: int = 3
    encoder_block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    decoder_block_out_channels: tuple[int, ...] = (64, 64, 64, 64)
    num_encoder_blocks: tuple[int, ...] = (1, 3, 3, 3)
    num_decoder_blocks: tuple[int, ...] = (3, 3, 3, 1)
    act_fn: str = "relu"
    upsample_fn: str = "nearest"
    upsampling_scaling_factor: int = 2
    latent_channels: int = 4
    scaling_factor: float = 1.0
    shift_factor: float | None = 0.0

    def validate(self) -> None:
        problems = []
        if self.act_fn != "relu":
            problems.append(f"act_fn {self.act_fn!r} (only relu)")
        if self.upsample_fn != "nearest" or self.upsampling_scaling_factor != 2:
            problems.append(f"upsampling {self.upsample_fn!r} x{self.upsampling_scaling_factor} (only nearest x2)")
        for half in ("encoder", "decoder"):
            widths, blocks = getattr(self, f"{half}_block_out_channels"), getattr(self, f"num_{half}_blocks")
            if len(widths) != len(blocks):
                problems.append(f"{half}_block_out_channels and num_{half}_blocks differ in length")
            if len(set(widths)) > 1:  # diffusers' own blocks only chain at one width
                problems.append(f"{half}_block_out_channels {widths} must all be equal")
        if len(self.encoder_block_out_channels) != len(self.decoder_block_out_channels):
            problems.append("encoder and decoder have different stage counts (their spatial factors differ)")
        if problems:
            raise ModelConfigError("unsupported AutoencoderTiny config: " + "; ".join(problems))

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.decoder_block_out_channels) - 1)


@dataclass(frozen=True)
class TAESDOptions(ModelOptions):
    """The tiny decoders' own settings, beside ModelOptions' tile_size, seed and config."""

    #: latents per tile side; None: tile_size / spatial factor if given, else AutoencoderTiny's 64
    tile_latent_size: int | None = None
    tile_overlap_factor: float = DEFAULT_OVERLAP
    #: working memory one decode/encode may take before it tiles; None: the backend's work_memory_budget
    memory_budget_bytes: int | None = None
    #: random init: make encoder weights too (a checkpoint has them or not)
    with_encoder: bool = True


class AutoencoderTinyModel:
    """An image decoder (and encoder when the checkpoint has one) per docs/interfaces.md."""

    kind = IMAGE_DECODER
    #: Hub weights only; load_model sets it (models/contract.py)
    weights_provenance: dict | None = None

    def __init__(self, name: str, preset: str, backend: Backend, cfg: AutoencoderTinyConfig,
                 tensors=None, weights_source: str | None = None, options: TAESDOptions | None = None):
        options = options or TAESDOptions()
        self.name, self.preset, self.backend, self.config = name, preset, backend, cfg
        self.latent_channels = cfg.latent_channels
        self.spatial_factor = cfg.spatial_factor
        self.scaling_factor = float(cfg.scaling_factor)
        self.shift_factor = float(cfg.shift_factor or 0.0)
        tile_latent = options.tile_latent_size or (int(options.tile_size) // cfg.spatial_factor
                                                   if options.tile_size else DEFAULT_TILE_LATENT)
        self.tiling = tiling.tiny_tiles(max(1, tile_latent), cfg.spatial_factor, float(options.tile_overlap_factor),
                                        int(options.memory_budget_bytes or backend.work_memory_budget))

        self.tree = Module()  # what the checkpoint holds, by its names
        self.decoder = self.tree.add("decoder", TinyDecoder(cfg.latent_channels, cfg.out_channels,
                                                            cfg.decoder_block_out_channels, cfg.num_decoder_blocks))
        encoder_side = Module()
        self.encoder = encoder_side.add("encoder", TinyEncoder(cfg.in_channels, cfg.latent_channels,
                                                               cfg.encoder_block_out_channels, cfg.num_encoder_blocks))
        encoder_shapes = encoder_side.expected_shapes()
        self.checkpoint_naming = None if tensors is None else checkpoint_naming(tensors)
        if tensors is None:
            self.weights_source = "random init"
            wanted = {**self.tree.expected_shapes(), **(encoder_shapes if options.with_encoder else {})}
            tensors = random_state_dict(wanted, options.seed, INIT_RULES)
        else:
            self.weights_source = weights_source or "given tensors"
            tensors = normalize_keys(tensors, cfg)
        # a decoder-only checkpoint is fine; a partial encoder is an error like any other gap
        self.has_encoder = any(k in tensors for k in encoder_shapes)
        if self.has_encoder:
            self.tree.add("encoder", self.encoder)
        else:
            self.encoder = None
        self.tree.load_checked(tensors, backend, f"AutoencoderTiny preset {preset!r}")
        # device latents -> device images; a backend may record and replay it (CUDA graphs)
        self._decode_device = backend.graphed(self.decoder)

    # ---- decode ----------------------------------------------------------------------------------
    def _decode_raw(self, z_nhwc: np.ndarray, clip=None, uint8: bool = False) -> np.ndarray:
        """Squashed decoder input (host NHWC) -> images (host NHWC float32, about [0, 1]), clipped
        to `clip` on the way out if given; uint8: as 8-bit pixels, converted before the copy."""
        b = self.backend
        # a shard's forward runs eagerly: its collectives meet the other shards' as they come
        forward = self._decode_device if row_shard.current() is None else self.decoder
        return b.to_host_async(forward(b.asarray(z_nhwc)), clip, uint8=uint8).result()

    def decode(self, latents_nchw: np.ndarray, tiled: bool | None = None, clamp: bool = True, *,
               uint8: bool = False) -> np.ndarray:
        """Latents (N, C, h, w) as the pipeline hands them -> float32 (N, 8h, 8w, 3) in [0, 1].
        tiled: True = AutoencoderTiny's tiled decode (when larger than one tile), False = never,
        None = when the untiled decode's estimated memory exceeds the budget. clamp=False skips the
        final clip: 2*x - 1 is then diffusers' `decode(...).sample`. uint8=True: uint8 pixels
        (convkernels.pixels_to_uint8; clamp implied)."""
        lat = np.asarray(latents_nchw)
        if lat.ndim != 4 or lat.shape[1] != self.latent_channels:
            raise ValueError(f"{self.name}: latents must be (N, {self.latent_channels}, h, w), got {lat.shape}")
        z = np.ascontiguousarray(lat.astype(np.float32).transpose(0, 2, 3, 1))
        z = z / np.float32(self.scaling_factor) + np.float32(self.shift_factor)
        # DecoderTiny's input squash runs here, on the host, beside the de-normalisation: latents
        # are 1/64 of the pixels, and no backend op is needed for a tanh this small
        z = np.tanh(z / np.float32(3.0)) * np.float32(3.0)
        tile = self._tile_latents(z.shape, tiled, self._decode_peak_bytes(*z.shape[:3]))
        if tile is None:
            return self._decode_raw(z, PIXEL_RANGE if clamp or uint8 else None, uint8)
        f = self.spatial_factor
        out = tiling.ramp_blended_map(self._decode_raw, z, tile, self.tiling.overlap, f, self.config.out_channels)
        if uint8:
            return pixels_to_uint8(out)
        if clamp:
            np.clip(out, *PIXEL_RANGE, out=out)
        return out

    # ---- encode ----------------------------------------------------------------------------------
    def encode(self, images_nhwc01: np.ndarray, tiled: bool | None = None) -> np.ndarray:
        """Images (N, H, W, 3) in [0, 1] -> latents (N, C, H//8, W//8) as the pipeline holds them:
        (encoder output - shift_factor) * scaling_factor. tiled: as decode's, with
        AutoencoderTiny's tiled encode."""
        if not self.has_encoder:
            raise RuntimeError(f"{self.name}: the checkpoint has no encoder weights")
        img = np.asarray(images_nhwc01, dtype=np.float32)
        if img.ndim != 4 or img.shape[-1] != self.config.in_channels:
            raise ValueError(f"{self.name}: images must be (N, H, W, {self.config.in_channels}), got {img.shape}")
        img = np.ascontiguousarray(img)
        f = self.spatial_factor
        n, h, w = img.shape[:3]
        tile = self._tile_latents((n, -(-h // f), -(-w // f)), tiled, self._decode_peak_bytes(n, h // f, w // f))
        if tile is None:
            # sides not a multiple of 8: floored, as the service's encoded shapes and diffusers'
            # tiled encode are; its untiled encode keeps one more latent that half sees padding
            lat = self._encode_raw(img)[:, :h // f, :w // f]
        else:
            lat = tiling.ramp_blended_map(self._encode_raw, img, tile * f, self.tiling.overlap, 1 / f,
                                          self.latent_channels)
        lat = (lat - np.float32(self.shift_factor)) * np.float32(self.scaling_factor)
        return np.ascontiguousarray(lat.transpose(0, 3, 1, 2))

    def _encode_raw(self, x_nhwc: np.ndarray) -> np.ndarray:
        b = self.backend
        return np.asarray(b.to_host(self.encoder(b.asarray(x_nhwc))), dtype=np.float32)

    # ---- tiling ----------------------------------------------------------------------------------
    def _decode_peak_bytes(self, n: int, h: int, w: int) -> int:
        """Working memory of an untiled decode (or an encode of the same image) of (n, h, w)
        latents: the full-resolution stage's activations and conv scratch, plus the output."""
        px = n * h * w * self.spatial_factor ** 2
        width = max(self.config.decoder_block_out_channels)
        return tiling.stage_bytes(self, px, width) + 2 * px * self.config.out_channels * 4

    def _tile_latents(self, shape, tiled: bool | None, untiled_bytes: int) -> int | None:
        """The tile size in latents, or None = one piece (also when the input fits one tile)."""
        s = self.tiling
        if tiled is False or (tiled is None and untiled_bytes <= s.memory_budget_bytes):
            return None
        tile = s.tile_px // self.spatial_factor
        return None if shape[1] <= tile and shape[2] <= tile else tile

    def smaller_tiling(self, current: tiling.TileSettings) -> tiling.TileSettings | None:  # models/contract.py
        return tiling.smaller_tiny_tiles(current, self.spatial_factor)

    # ---- description -----------------------------------------------------------------------------
    def card(self) -> dict:
        t = self.tiling
        return card_fields(self, "diffusers AutoencoderTiny (TAESD tiny VAE)", has_encoder=self.has_encoder,
                           latent_channels=self.latent_channels, spatial_factor=self.spatial_factor,
                           scaling_factor=self.scaling_factor, shift_factor=self.shift_factor,
                           limits={"tile_latent_size": t.tile_px // self.spatial_factor,
                                   "tile_overlap_factor": t.overlap,
                                   "memory_budget_bytes": t.memory_budget_bytes},
                           checkpoint_naming=self.checkpoint_naming, config=self.config.as_dict())
