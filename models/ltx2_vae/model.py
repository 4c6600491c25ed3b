"""diffusers `AutoencoderKLLTX2Video` (the LTX-2 video VAE) decoder on the backend interface,
`kind == "video-decoder"`.

What the LTX-2 pipeline does around the VAE (diffusers' LTX2Pipeline, after unpacking the
transformer's tokens to N,128,T,h,w):
    where vae.config.timestep_conditioning: latents = (1 - s) * latents + s * noise, s =
        decode_noise_scale (default: decode_timestep, itself 0.0 by default), and the decoder gets
        timestep = decode_timestep; else timestep None and no noise;
    latents * latents_std / scaling_factor + latents_mean (the checkpoint's buffers);
    vae.decode(latents, timestep); then (x / 2 + 0.5).clamp(0, 1).
This model takes the latents as the pipeline holds them before that and does the rest: the noise
only where options.noise_scale > 0 (a seeded NumPy draw, deterministic; default none), the
timestep from options.timestep, x / 2 + 0.5 folded into conv_out.

The decoder is not causal in time (decoder_causal=False: each conv also sees the next frame), so
no frame can be finished before the clip's last latent frame is read: decode_frames decodes the
whole clip, then hands it out in frame groups (1, then temporal_factor frames each). Memory grows
with the clip. Spatial tiling is diffusers' tiled_decode (tiles of the whole clip blended as
AutoencoderKLWan's, models/nn/tiling.py); diffusers' framewise (temporal) tiling is not offered.

Encode (where the checkpoint holds the encoder: `has_encoder`; models/ltx2_vae/encoder.py) is what
the image-to-video and condition pipelines do before the denoiser: frames in [0, 1] -> x * 2 - 1 ->
vae.encode -> the posterior mean (retrieve_latents "argmax") -> (mean - latents_mean) / latents_std.
Those pipelines call _normalize_latents without scaling_factor (its default 1.0) although decode
divides by it: equal for LTX-2's own checkpoint (scaling_factor 1.0); encode follows the pipelines.
One untiled call on the whole clip (the encoder is causal in time, but one pass is what diffusers runs).
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from convkernels import Backend, pixels_to_uint8
from convkernels.collectives.shard_comm import split_rows

from ..contract import PIXEL_RANGE, VIDEO_DECODER, card_fields
from ..nn import row_shard
from ..nn.module import Module, random_state_dict
from ..nn.tiling import (TileSettings, plan_video_tiles, smaller_video_tiles, stitch_video_tiles, video_tiles,
                         video_tiles_for_size)
from ..nn.weights import ModelConfigError, fold_output_affine
from .config import LTX2VAEConfig, LTX2VAEOptions
from .encoder import Encoder
from .layers import Decoder

#: random init: U(+-1/sqrt(fan_in)) as PyTorch's default; the latent statistics as diffusers inits them
INIT_RULES = ((r"latents_mean$", "zeros"), (r"latents_std$", "ones"), (r"timestep_scale_multiplier$", "ones"),
              ("", "uniform"))


class _Tree(Module):
    """What the checkpoint's decoder side holds: the decoder and the latent statistics (buffers)."""

    def __init__(self, cfg: LTX2VAEConfig, timestep: float):
        super().__init__()
        self.channels = cfg.latent_channels
        self.decoder = self.add("decoder", Decoder(cfg, timestep))
        self.stats = None

    def param_shapes(self):
        return {"latents_mean": (self.channels,), "latents_std": (self.channels,)}

    def derive(self, tensors, prefix) -> None:
        self.stats = tuple(np.asarray(tensors[k], np.float32).reshape(1, -1, 1, 1, 1)
                           for k in ("latents_mean", "latents_std"))


class LTX2VAEModel:
    """Video decoder per docs/interfaces.md: normalised latents (N, C, T, h, w) -> float32 frames
    (N, 1 + 8*(T-1), 32h, 32w, 3) in [0, 1] for the real VAE."""

    kind = VIDEO_DECODER
    #: Hub weights only; load_model sets it (models/contract.py)
    weights_provenance: dict | None = None
    architecture = "diffusers AutoencoderKLLTX2Video decoder (LTX-2 video VAE)"

    def __init__(self, name: str, preset: str, backend: Backend, cfg: LTX2VAEConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: LTX2VAEOptions | None = None):
        options = options or LTX2VAEOptions()
        self.name, self.preset, self.backend, self.config = name, preset, backend, cfg
        self.tiling = video_tiles_for_size(options.tile_size) if options.tile_size else \
            video_tiles(int(options.tile_sample_min_size), int(options.tile_sample_stride))
        self.max_untiled_pixels = int(options.max_untiled_pixels)
        self.latent_channels = cfg.latent_channels
        self.spatial_factor, self.temporal_factor = cfg.spatial_factor, cfg.temporal_factor
        self.scaling_factor = float(cfg.scaling_factor)
        conditioned = bool(cfg.timestep_conditioning)
        self.timestep = float(options.timestep) if conditioned else None
        self.noise_scale = float(options.noise_scale) if conditioned else 0.0
        self.noise_seed = int(options.noise_seed)
        self.tree = _Tree(cfg, float(options.timestep))
        random_init = tensors is None
        if tensors is None:
            self.weights_source = "random init"
            tensors = random_state_dict(self.tree.expected_shapes(), options.seed, INIT_RULES)
        else:
            self.weights_source = weights_source or "given tensors"
            prefix = "vae."  # a whole pipeline's state dict: only when every name has it
            if tensors and all(k.startswith(prefix) for k in tensors):
                tensors = {k[len(prefix):]: v for k, v in tensors.items()}
        # the encoder half of a full VAE checkpoint is loaded apart (below)
        self.tree.load_checked(fold_output_affine(tensors, "decoder.conv_out.conv", 0.5, 0.5), backend,
                               f"AutoencoderKLLTX2Video decoder (preset {preset!r})", ignore_unexpected=("encoder.",))
        self._mean, self._std = self.tree.stats
        self._decode_device = backend.graphed(self.tree.decoder.__call__)
        self.has_encoder, self._encode_device = False, None
        self._load_encoder(cfg, None if random_init else tensors, options.seed + 1, backend, preset)

    def _load_encoder(self, cfg: LTX2VAEConfig, tensors, seed: int, backend: Backend, preset: str) -> None:
        """The encoder, where the checkpoint holds any of it (strict: a partial one is an error), or
        seeded apart from the decoder under random init (where the config is one diffusers runs)."""
        if tensors is not None and not any(k.startswith("encoder.") for k in tensors):
            return  # a decoder-only checkpoint: decode only
        problems = cfg.encoder_problems()
        if problems:
            if tensors is None:
                return
            raise ModelConfigError("unsupported AutoencoderKLLTX2Video encoder config: " + "; ".join(problems))
        tree = Module()
        encoder = tree.add("encoder", Encoder(cfg))
        if tensors is None:
            tensors = random_state_dict(tree.expected_shapes(), seed, INIT_RULES)
        tree.load_checked(tensors, backend, f"AutoencoderKLLTX2Video encoder (preset {preset!r})",
                          ignore_unexpected=("decoder.", "latents_"))
        self.has_encoder, self._encode_device = True, backend.graphed(encoder.__call__)

    # ---- decode ----------------------------------------------------------------------------------
    def _prepare(self, latents_ncthw) -> np.ndarray:
        """Checked latents -> the decoder's input, host float32 N,T,h,w,C: the pipeline's noise
        (where asked for) and de-normalisation. Row-local: on a row shard the noise is the whole's
        drawn once and this band's rows of it taken."""
        lat = np.asarray(latents_ncthw)
        shard = row_shard.current()
        rows = shard.whole if shard is not None else (lat.shape[3] if lat.ndim == 5 else 0)
        if lat.ndim != 5 or lat.shape[1] != self.latent_channels or min(lat.shape) < 1:
            raise ValueError(f"{self.name}: latents must be (N, {self.latent_channels}, T, h, w) with every size "
                             f">= 1, got {lat.shape}")
        lat = lat.astype(np.float32)
        if self.noise_scale:
            n, c, t, _, w = lat.shape
            noise = np.random.default_rng(self.noise_seed).standard_normal((n, c, t, rows, w), dtype=np.float32)
            if shard is not None:
                lo, hi = split_rows(shard.whole, shard.comm.size)[shard.comm.rank]
                noise = noise[..., lo:hi, :]
            s = np.float32(self.noise_scale)
            lat = (np.float32(1) - s) * lat + s * noise
        lat = lat * self._std / np.float32(self.scaling_factor) + self._mean
        return np.ascontiguousarray(lat.transpose(0, 2, 3, 4, 1))

    def _run(self, z, clip=None, uint8: bool = False) -> np.ndarray:
        """The decoder on host latents N,T,h,w,C -> host frames (clipped to `clip`, or uint8)."""
        b = self.backend
        # a shard's forward runs eagerly: its collectives meet the other shards' as they come
        forward = self._decode_device if row_shard.current() is None else self.tree.decoder
        return b.to_host_async(forward(b.asarray(z)), clip, uint8=uint8).result()

    def _decode_all(self, z: np.ndarray, tiled: bool | None, uint8: bool, clamp: bool) -> np.ndarray:
        _, _, h, w, _ = z.shape
        sf = self.spatial_factor
        if tiled is None:
            tiled = h * w * sf * sf > self.max_untiled_pixels
        plan = plan_video_tiles(h, w, sf, self.tiling) if tiled else None
        if plan is None:
            return self._run(z, PIXEL_RANGE if clamp or uint8 else None, uint8)
        size = plan.tile_latent  # each tile decodes the whole clip, blended unclipped as diffusers'
        tiles = [[self._run(z[:, :, i:i + size, j:j + size]) for j in plan.cols] for i in plan.rows]
        out = stitch_video_tiles(plan, tiles)
        if uint8:
            return pixels_to_uint8(out)
        if clamp:
            np.clip(out, *PIXEL_RANGE, out=out)
        return out

    def decode_frames(self, latents_ncthw, tiled: bool | None = None, *, uint8: bool = False,
                      clamp: bool = True, chunks=None) -> Iterator[np.ndarray]:
        """Frame groups (1 frame, then temporal_factor each) of the whole clip's decode, which runs
        when the first group is asked for (the decoder is not causal in time; the module docstring
        says why). Bad latents raise here. uint8/clamp as decode; chunks (a causal decoder's frame
        stepping) has nothing to step here and is ignored."""
        z = self._prepare(latents_ncthw)

        def groups():
            frames = self._decode_all(z, tiled, uint8, clamp)
            tf = self.temporal_factor
            yield frames[:, :1]
            for at in range(1, frames.shape[1], tf):
                yield frames[:, at:at + tf]

        return groups()

    def decode(self, latents_ncthw, tiled: bool | None = None, *, uint8: bool = False,
               clamp: bool = True) -> np.ndarray:
        """All frames at once: float32 (N, 1 + 8*(T-1), 32h, 32w, 3) in [0, 1] (uint8=True: uint8;
        clamp=False: unclipped x / 2 + 0.5). tiled: True = diffusers' spatial tiling (when larger
        than one tile), False = never, None = when a frame exceeds max_untiled_pixels."""
        return self._decode_all(self._prepare(latents_ncthw), tiled, uint8, clamp)

    # ---- encode ----------------------------------------------------------------------------------
    def encode(self, video_nfhw01) -> np.ndarray:
        """Frames (N, 1 + 8k, H, W, 3) in [0, 1], H and W multiples of 32 -> what diffusers' LTX-2
        image-to-video (and condition) pipeline hands the denoiser: the posterior mean of
        vae.encode(x * 2 - 1) (retrieve_latents "argmax"), then (mean - latents_mean) / latents_std,
        float32 (N, C, 1 + k, H/32, W/32). The pipelines' _normalize_latents is called there without
        scaling_factor (its default 1.0), so none is applied here either. Untiled, whole clip."""
        if not self.has_encoder:
            raise RuntimeError(f"{self.name}: the checkpoint has no encoder weights")
        b = self.backend
        mean = np.asarray(b.to_host(self._encode_device(b.asarray(self._encoder_input(video_nfhw01)))), np.float32)
        mean = mean.transpose(0, 4, 1, 2, 3)
        return np.ascontiguousarray((mean - self._mean) / self._std)

    def _encoder_input(self, video) -> np.ndarray:
        """Validated frames as the encoder takes them: float32 x * 2 - 1 (the video processor's map
        to [-1, 1]), N,F,H,W,3."""
        v = np.asarray(video)
        s, t = self.spatial_factor, self.temporal_factor
        if v.ndim != 5 or v.shape[-1] != 3 or min(v.shape) < 1:
            raise ValueError(f"{self.name}: video must be (N, F, H, W, 3) with every size >= 1, got {v.shape}")
        if (v.shape[1] - 1) % t:
            raise ValueError(f"{self.name}: the frame count must be 1 + {t}k (1, {1 + t}, {1 + 2 * t}, ...), "
                             f"got {v.shape[1]}")
        if v.shape[2] % s or v.shape[3] % s:
            raise ValueError(f"{self.name}: height and width must be multiples of {s}, got {v.shape[2]}x{v.shape[3]}")
        if v.dtype.kind != "f":
            raise ValueError(f"{self.name}: video must be floating point in [0, 1], got {v.dtype}")
        x = np.float32(2.0) * v.astype(np.float32) - np.float32(1.0)
        if not np.isfinite(x).all():
            raise ValueError(f"{self.name}: video contains NaN or Inf")
        return np.ascontiguousarray(x)

    def output_frames(self, latent_frames: int) -> int:
        """Frames decoded from this many latent frames: 1 + temporal_factor * (T - 1)."""
        return 1 + self.temporal_factor * (latent_frames - 1)

    # ---- description -----------------------------------------------------------------------------
    @property
    def latent_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:  # models/contract.py PerChannelLatents
        """(latents_mean, latents_std / scaling_factor): what the pipeline's de-normalisation
        multiplies and adds (the checkpoint's buffers)."""
        return (tuple(float(v) for v in self._mean.ravel()),
                tuple(float(v) / self.scaling_factor for v in self._std.ravel()))

    def smaller_tiling(self, current: TileSettings) -> TileSettings | None:  # models/contract.py
        return smaller_video_tiles(current, self.spatial_factor)

    def card(self) -> dict:
        return card_fields(self, self.architecture, latent_channels=self.latent_channels,
                           spatial_factor=self.spatial_factor, temporal_factor=self.temporal_factor,
                           scaling_factor=self.scaling_factor,
                           input="normalised latents (N, C, T, h, w); decode applies latents * latents_std / "
                                 "scaling_factor + latents_mean (the checkpoint's buffers)",
                           output=f"float32 (N, 1 + {self.temporal_factor}*(T-1), {self.spatial_factor}h, "
                                  f"{self.spatial_factor}w, 3) in [0, 1]",
                           timestep=self.timestep, noise_scale=self.noise_scale, has_encoder=self.has_encoder,
                           **({"encode": f"frames (N, 1 + {self.temporal_factor}k, H, W, 3) in [0, 1], H and W "
                                         f"multiples of {self.spatial_factor} -> normalised latents (N, C, 1 + k, "
                                         f"H/{self.spatial_factor}, W/{self.spatial_factor}): (posterior mean - "
                                         "latents_mean) / latents_std, as the image-to-video pipeline"}
                              if self.has_encoder else {}),
                           limits={"streaming": "frame groups after a whole-clip decode (the decoder is not "
                                                "causal in time)" if not self.config.decoder_causal else
                                                "frame groups after a whole-clip decode",
                                   "frames_per_chunk": [1, self.temporal_factor],
                                   "memory": "grows with clip length (the whole clip is decoded at once)",
                                   "tile_sample_min_size": self.tiling.tile_px,
                                   "tile_sample_stride": self.tiling.stride_px,
                                   "max_untiled_pixels": self.max_untiled_pixels},
                           config=self.config.as_dict())
