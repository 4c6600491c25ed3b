"""diffusers `AutoencoderKLHunyuanVideo15` (the HunyuanVideo 1.5 VAE) decoder on the backend interface.

What the pipeline does around the VAE (diffusers' HunyuanVideo15Pipeline):
    latents / vae.config.scaling_factor -> vae.decode -> (x / 2 + 0.5).clamp(0, 1) (no shift, no
    per-channel statistics); this model takes the latents as the pipeline holds them before that
    division and does the rest, x / 2 + 0.5 folded into conv_out.
diffusers decodes the whole clip at once; here the decoder runs in chunks of latent frames (the
first alone, then one at a time, or on a row shard the runs models/wan_vae/chunk_plan.py gives its
band), which is exact: the convs are causal and keep their last input frames, the temporal
upsamplers treat only the clip's first frame apart, the attention is frame-causal and keeps the keys
and values of the frames so far. So frame groups stream as they are done (docs/interfaces.md), and a
batch of any size decodes (diffusers' own attention mask fails for a batch of 2: compare per sample).
Tiled decode is diffusers' rule for this class (spatial tiles of tile_sample_min_size pixels every
int(tile_latent * (1 - overlap)) latents, blended over int(tile * overlap) pixels, every tile through
the whole clip with its own cache; here the loops are swapped so tiled groups stream too).
The encoder (encoder.py) is served where the checkpoint holds it (`has_encoder`): encode gives what
the image-to-video pipeline's _get_image_latents hands on, the posterior mean (mode) * scaling_factor,
for clips of 1 + 4k frames (the pipeline encodes its one conditioning frame), run in diffusers' own
chunks of frames with the causal cache (the first frame alone, then 4), so memory is one chunk's.
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from convkernels import Backend, pixels_to_uint8

from ..contract import PIXEL_RANGE, VIDEO_DECODER, card_fields
from ..nn import interrupt, row_shard
from ..nn.module import Module, random_state_dict
from ..nn.tiling import TileSettings, plan_video_tiles, smaller_video_tiles, stitch_video_tiles
from ..nn.weights import ModelConfigError, fold_output_affine
from ..wan_vae.chunk_plan import UNSHARDED, ChunkPlan, chunk_plan
from ..wan_vae.layers import FeatureCache
from ..wan_vae.model import joined_groups, one_group_ahead
from ..wan22_vae.model import encode_chunks, video_encoder_input
from .config import HunyuanVideo15VAEConfig, HunyuanVideo15VAEOptions
from .encoder import Encoder
from .layers import Decoder

#: random init: U(+-1/sqrt(fan_in)) as PyTorch's default, RMS-norm gammas one
INIT_RULES = ((r"\.gamma$", "ones"), ("", "uniform"))


def tile_settings(tile_px: int, overlap: float, spatial_factor: int) -> TileSettings:
    """diffusers' tiles for this class: the latent tile is tile_px / f, its stride
    int(tile * (1 - overlap)) latents, the blend int(tile_px * overlap) pixels; refused where the
    blend and the stride's crop disagree (the output would not be f times the latents)."""
    tile = int(tile_px) // spatial_factor
    stride = int(tile * (1 - overlap)) * spatial_factor
    if tile < 2 or stride < spatial_factor or int(tile_px * overlap) != tile_px - stride:
        raise ModelConfigError(f"tiles of {tile_px} px overlapping by {overlap} do not tile consistently at "
                               f"{spatial_factor}x (use a multiple of {4 * spatial_factor} px with overlap 0.25)")
    return TileSettings(tile * spatial_factor, stride, overlap)


class HunyuanVideo15VAEDecoder:
    """Video decoder per docs/interfaces.md: latents (N, C, T, h, w) as the pipeline holds them ->
    float32 frames (N, 1 + 4*(T-1), 16h, 16w, 3) in [0, 1] (the real VAE's factors)."""

    kind = VIDEO_DECODER
    #: Hub weights only; load_model sets it (models/contract.py)
    weights_provenance: dict | None = None
    architecture = "diffusers AutoencoderKLHunyuanVideo15 decoder (HunyuanVideo 1.5 VAE, causal 3-D convs)"
    #: set at load: whether the checkpoint holds the encoder (random init makes one)
    has_encoder = False

    def __init__(self, name: str, preset: str, backend: Backend, cfg: HunyuanVideo15VAEConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: HunyuanVideo15VAEOptions | None = None):
        options = options or HunyuanVideo15VAEOptions()
        self.name, self.preset, self.backend, self.config = name, preset, backend, cfg
        self.latent_channels = cfg.latent_channels
        self.spatial_factor, self.temporal_factor = cfg.spatial_factor, cfg.temporal_factor
        self.scaling_factor = float(cfg.scaling_factor)
        self.tiling = tile_settings(int(options.tile_size or options.tile_sample_min_size),
                                    float(options.tile_overlap_factor), self.spatial_factor)
        self.max_untiled_pixels = int(options.max_untiled_pixels)
        self.tree = Module()  # what the checkpoint holds, by its names
        self.decoder = self.tree.add("decoder", Decoder(cfg))
        if tensors is None:
            self.weights_source = "random init"
            tensors = random_state_dict(self.tree.expected_shapes(), options.seed, INIT_RULES)
        else:
            self.weights_source = weights_source or "given tensors"
            prefix = "vae."  # a whole pipeline's state dict: only when every name has it
            if tensors and all(k.startswith(prefix) for k in tensors):
                tensors = {k[len(prefix):]: v for k, v in tensors.items()}
        # the video processor's x / 2 + 0.5 is done by conv_out itself; the encoder is not served
        self.tree.load_checked(fold_output_affine(tensors, "decoder.conv_out.conv", 0.5, 0.5), backend,
                               f"AutoencoderKLHunyuanVideo15 decoder (preset {preset!r})",
                               ignore_unexpected=("encoder.",))
        self._load_encoder(cfg, tensors, options.seed + 1 if self.weights_source == "random init" else None)

    def _load_encoder(self, cfg: HunyuanVideo15VAEConfig, tensors: Mapping[str, np.ndarray], seed: int | None):
        """The encoder where the checkpoint holds any of it (random init makes one, seeded apart from
        the decoder); a partial encoder is an error naming every missing or mis-shaped tensor."""
        self.encoder_tree = Module()
        self.encoder = self.encoder_tree.add("encoder", Encoder(cfg))
        wanted = self.encoder_tree.expected_shapes()
        if seed is not None:
            tensors = random_state_dict(wanted, seed, INIT_RULES)
        self.has_encoder = any(k in tensors for k in wanted)
        if not self.has_encoder:
            return
        problems = cfg.encoder_problems()
        if problems:
            raise ModelConfigError("unsupported AutoencoderKLHunyuanVideo15 encoder config: " + "; ".join(problems))
        self.encoder_tree.load_checked(tensors, self.backend, f"AutoencoderKLHunyuanVideo15 encoder (preset "
                                       f"{self.preset!r})", ignore_unexpected=("decoder.",))

    # ---- encode ----------------------------------------------------------------------------------
    def encode(self, video_nfhw01) -> np.ndarray:
        """Frames (N, 1 + 4k, H, W, 3) in [0, 1], H and W multiples of the spatial factor -> the
        image-to-video pipeline's latents (N, C, 1 + k, H/16, W/16), float32: the posterior mean
        (its mode, as the pipeline's retrieve_latents(sample_mode="argmax")) * scaling_factor.
        Chunked (the first frame alone, then 4), exact: the convs are causal, the temporal
        downsamplers treat only the clip's first frame apart, the attention is frame-causal. Untiled."""
        if not self.has_encoder:
            raise RuntimeError(f"{self.name}: the checkpoint has no encoder weights")
        x = video_encoder_input(self.name, video_nfhw01, self.spatial_factor, self.temporal_factor)
        b, z = self.backend, self.latent_channels
        state = FeatureCache()
        means = []
        for start, stop in encode_chunks(x.shape[1], self.temporal_factor):
            interrupt.check()  # its requesters gone: stop between chunks
            out = self.encoder(b.asarray(np.ascontiguousarray(x[:, start:stop])), state)
            means.append(np.asarray(b.to_host(out), np.float32)[..., :z])
        mean = np.concatenate(means, axis=1).transpose(0, 4, 1, 2, 3)
        return np.ascontiguousarray(mean * np.float32(self.scaling_factor))

    # ---- decode ----------------------------------------------------------------------------------
    def _prepare(self, latents_ncthw) -> np.ndarray:
        """Checked latents -> latents / scaling_factor, channels-last N,T,h,w,C float32 (row-local)."""
        lat = np.asarray(latents_ncthw)
        if lat.ndim != 5 or lat.shape[1] != self.latent_channels or min(lat.shape) < 1:
            raise ValueError(f"{self.name}: latents must be (N, {self.latent_channels}, T, h, w) with "
                             f"every size >= 1, got {lat.shape}")
        z = lat.astype(np.float32).transpose(0, 2, 3, 4, 1) / np.float32(self.scaling_factor)
        return np.ascontiguousarray(z)

    def decode_frames(self, latents_ncthw, tiled: bool | None = None, *, uint8: bool = False,
                      clamp: bool = True, chunks: ChunkPlan | None = None) -> Iterator[np.ndarray]:
        """Frame groups (the first latent frame's one frame, then temporal_factor frames per latent
        frame), each computed when asked for (back-pressure); bad latents raise here, before the first
        group. tiled: True = diffusers' tiling (when larger than one tile), False = never, None = when a
        frame has more than max_untiled_pixels. uint8: pixels_to_uint8 of the frames; clamp=False:
        x / 2 + 0.5 unclipped. chunks: how the untiled decode steps its latent frames after the first
        (by default one at a time, or on a row shard what its band calls for)."""
        z = self._prepare(latents_ncthw)
        _, _, h, w, _ = z.shape
        sf = self.spatial_factor
        if tiled is None:
            tiled = h * w * sf * sf > self.max_untiled_pixels
        plan = plan_video_tiles(h, w, sf, self.tiling) if tiled else None
        if plan is None:
            return self._untiled_groups(z, uint8, PIXEL_RANGE if clamp or uint8 else None, chunks)
        return self._tiled_groups(z, plan, uint8, clamp)

    def _untiled_groups(self, z: np.ndarray, uint8: bool, clip, chunks: ChunkPlan | None) -> Iterator[np.ndarray]:
        shard = row_shard.current()
        if chunks is None:
            chunks = UNSHARDED if shard is None else chunk_plan(max(shard.token_counts(shard.own, z.shape[3])))
        state = FeatureCache()
        starts = [0, *range(1, z.shape[1], chunks.frames)]
        stops = [*starts[1:], z.shape[1]]
        b = self.backend

        def started():
            for start, stop in zip(starts, stops):
                interrupt.check()  # its requesters gone: stop between frame groups
                out = self.decoder(b.asarray(np.ascontiguousarray(z[:, start:stop])), state)
                yield b.to_host_async(out, clip, uint8=uint8)

        tf = self.temporal_factor
        for frames in one_group_ahead(started(), b.runs_ahead):
            for at in range(0, frames.shape[1], tf):
                yield frames[:, at:at + tf]

    def _tiled_groups(self, z: np.ndarray, plan, uint8: bool, clamp: bool) -> Iterator[np.ndarray]:
        b, size = self.backend, plan.tile_latent
        states = [[FeatureCache() for _ in plan.cols] for _ in plan.rows]
        for k in range(z.shape[1]):
            interrupt.check()
            tiles = [[b.to_host(self.decoder(b.asarray(np.ascontiguousarray(z[:, k:k + 1, i:i + size, j:j + size])),
                                             states[a][c])).astype(np.float32, copy=False)
                      for c, j in enumerate(plan.cols)] for a, i in enumerate(plan.rows)]
            out = stitch_video_tiles(plan, tiles)  # tiles blend unclipped, as diffusers'
            if uint8:
                yield pixels_to_uint8(out)
            else:
                yield np.clip(out, *PIXEL_RANGE, out=out) if clamp else out

    def decode(self, latents_ncthw, tiled: bool | None = None, *, uint8: bool = False,
               clamp: bool = True) -> np.ndarray:
        """All frames at once: float32 (N, 1 + 4*(T-1), 16h, 16w, 3) in [0, 1]; uint8=True: uint8,
        clamp=False: unclipped, as decode_frames gives them."""
        groups = self.decode_frames(latents_ncthw, tiled, uint8=uint8, clamp=clamp)
        return joined_groups(groups, self.output_frames(np.shape(latents_ncthw)[2]))

    def output_frames(self, latent_frames: int) -> int:
        """Frames decoded from this many latent frames: the first gives one, every later one
        temporal_factor."""
        return 1 + self.temporal_factor * (latent_frames - 1)

    # ---- description -----------------------------------------------------------------------------
    def smaller_tiling(self, current: TileSettings) -> TileSettings | None:  # models/contract.py
        smaller = smaller_video_tiles(current, self.spatial_factor)
        try:
            return None if smaller is None else tile_settings(smaller.tile_px, current.overlap, self.spatial_factor)
        except ModelConfigError:
            return None

    def card(self) -> dict:
        f, t = self.spatial_factor, self.temporal_factor
        encode = {} if not self.has_encoder else {
            "encode": f"frames (N, 1 + {t}k, H, W, 3) in [0, 1], H and W multiples of {f} -> latents (N, C, 1 + k, "
                      f"H/{f}, W/{f}) as the image-to-video pipeline holds them: posterior mean * scaling_factor"}
        return card_fields(self, self.architecture, has_encoder=self.has_encoder, **encode,
                           latent_channels=self.latent_channels, spatial_factor=f, temporal_factor=t,
                           scaling_factor=self.scaling_factor, shift_factor=0.0,
                           input="latents (N, C, T, h, w) as the pipeline holds them; decode applies "
                                 "latents / scaling_factor",
                           output=f"float32 (N, 1 + {t}*(T-1), {f}h, {f}w, 3) in [0, 1]",
                           limits={"streaming": True, "frames_per_chunk": [1, t],
                                   "memory": "one chunk's activations, the convs' last 2 input frames and the "
                                             "attention's keys and values of every frame so far (latent size)",
                                   "tile_sample_min_size": self.tiling.tile_px,
                                   "tile_overlap_factor": self.tiling.overlap,
                                   "max_untiled_pixels": self.max_untiled_pixels},
                           config=self.config.as_dict())
