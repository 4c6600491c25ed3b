"""The Wan 2.1 video VAE decoder (diffusers `AutoencoderKLWan`), `kind == "video-decoder"`: the
Wan-VAE family's presets, config and model (its `FAMILY` is in the package's __init__.py). Wan 2.2
(models/wan22_vae/) and Qwen-Image (models/qwen_image_vae/) build on this decoder.

Decoding is chunked and causal exactly as diffusers' `_decode`: one latent frame at a time
through the decoder with a feature cache of CACHE_T frames per causal conv, so memory does
not grow with clip length and frames can leave as soon as their chunk is done (the first
latent frame gives 1 frame, every later one `temporal_factor` frames).

Latents arrive as the diffusers Wan pipeline hands them to the VAE's caller, i.e. normalised;
the pipeline then does `latents / (1 / latents_std) + latents_mean` before `vae.decode`, and
so does `decode()` here (`latents * std + mean`, per channel, from the config).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Iterator, Mapping

import numpy as np

from convkernels import Backend, pixels_to_uint8

from ..contract import PIXEL_RANGE, VIDEO_DECODER, card_fields
from ..family import ModelOptions
from ..nn import interrupt, row_shard
from ..nn.module import Module, random_state_dict
from ..nn.tiling import (TileSettings, plan_video_tiles, smaller_video_tiles, stitch_video_tiles, video_tiles,
                         video_tiles_for_size)
from ..nn.weights import DiffusersConfig, ModelConfigError, fold_output_affine
from .checkpoint import checkpoint_naming, normalize_keys
from .chunk_plan import UNSHARDED, ChunkPlan, chunk_plan
from .latents import PreparedLatents
from .layers import CACHE_T, CausalConv3d, Decoder3d, FeatureCache

# diffusers AutoencoderKLWan defaults == the published Wan 2.1 VAE config
# (Wan-AI/Wan2.1-T2V-1.3B-Diffusers, subfolder vae)
WAN21_LATENTS_MEAN = [-0.7571, -0.7089, -0.9113, 0.1075, -0.1745, 0.9653, -0.1517, 1.5508,
                      0.4134, -0.0715, 0.5517, -0.3632, -0.1922, -0.9497, 0.2503, -0.2921]
WAN21_LATENTS_STD = [2.8184, 1.4541, 2.3275, 2.6558, 1.2196, 1.7708, 2.6052, 2.0743,
                     3.2687, 2.1526, 2.8652, 1.5579, 1.6382, 1.1253, 2.8251, 1.9160]

PRESETS: dict[str, dict] = {
    "wan2.1-vae": {
        "base_dim": 96, "z_dim": 16, "dim_mult": [1, 2, 4, 4], "num_res_blocks": 2,
        "temperal_downsample": [False, True, True],
        "latents_mean": WAN21_LATENTS_MEAN, "latents_std": WAN21_LATENTS_STD,
    },
    "tiny-wan-vae": {
        "base_dim": 8, "z_dim": 4, "dim_mult": [1, 2, 2, 2], "num_res_blocks": 1,
        "temperal_downsample": [False, True, True],
        "latents_mean": [0.1, -0.2, 0.05, 0.3], "latents_std": [1.5, 0.8, 1.2, 2.0],
    },
}

DESCRIPTIONS = {
    "wan2.1-vae": "Wan 2.1 video VAE decoder (AutoencoderKLWan, 16 latent channels, 8x space, 4x time)",
    "tiny-wan-vae": "tiny Wan-architecture video VAE decoder for tests and CPU demos "
                    "(4 latent channels; 4x16x16 latents -> 13x128x128 in ~0.5 s on a quiet 2-core CPU)",
}

#: random init: U(+-1/sqrt(fan_in)) as PyTorch's default, RMS-norm gammas one
INIT_RULES = ((r"\.gamma$", "ones"), ("", "uniform"))

#: frames up to 720p (1280x720, the largest Wan 2.1 output) decode untiled unless asked, as in diffusers
DEFAULT_MAX_UNTILED_PIXELS = 1280 * 720


@dataclass(frozen=True)
class WanVAEConfig(DiffusersConfig):
    """The fields of diffusers' AutoencoderKLWan config.json that shape the decoder."""

    base_dim: int = 96
    decoder_base_dim: int | None = None
    z_dim: int = 16
    dim_mult: tuple[int, ...] = (1, 2, 4, 4)
    num_res_blocks: int = 2
    temperal_downsample: tuple[bool, ...] = (False, True, True)
    latents_mean: tuple[float, ...] = tuple(WAN21_LATENTS_MEAN)
    latents_std: tuple[float, ...] = tuple(WAN21_LATENTS_STD)
    is_residual: bool = False
    out_channels: int = 3
    patch_size: int | None = None
    # fields of config.json that do not change the decoder's computation
    attn_scales: tuple[float, ...] = ()
    dropout: float = 0.0
    in_channels: int = 3
    scale_factor_temporal: int | None = 4
    scale_factor_spatial: int | None = 8

    def variant_problems(self) -> list[str]:
        """What makes this config not a Wan 2.1 VAE (Wan 2.2's config says so in models/wan22_vae/model.py)."""
        problems = []
        if self.is_residual:
            problems.append("is_residual=True is the Wan 2.2 VAE: use a wan2.2 preset")
        if self.patch_size not in (None, 1):
            problems.append(f"patch_size={self.patch_size} is the Wan 2.2 VAE: use a wan2.2 preset")
        if self.out_channels != 3:
            problems.append(f"out_channels must be 3 (RGB), got {self.out_channels}")
        return problems

    def validate(self) -> None:
        problems = self.variant_problems()
        if len(self.temperal_downsample) != len(self.dim_mult) - 1:
            problems.append(f"temperal_downsample needs {len(self.dim_mult) - 1} entries, "
                            f"got {len(self.temperal_downsample)}")
        for what in ("latents_mean", "latents_std"):
            if len(getattr(self, what)) != self.z_dim:
                problems.append(f"{what} needs z_dim={self.z_dim} entries, got {len(getattr(self, what))}")
        if any(s == 0 for s in self.latents_std):
            problems.append("latents_std has a zero entry")
        if problems:
            raise ModelConfigError("AutoencoderKLWan config: " + "; ".join(problems))

    @property
    def temperal_upsample(self) -> tuple[bool, ...]:
        return tuple(self.temperal_downsample[::-1])

    @property
    def spatial_factor(self) -> int:
        return 2 ** (len(self.dim_mult) - 1)

    @property
    def temporal_factor(self) -> int:
        return 2 ** sum(bool(t) for t in self.temperal_downsample)


@dataclass(frozen=True)
class WanVAEOptions(ModelOptions):
    """The Wan VAE's own settings, beside ModelOptions' tile_size (which, when given, replaces
    the tile size and stride below, the stride a quarter smaller), seed and config."""

    #: diffusers' tile_sample_min_height/width: output pixels per tile side
    tile_sample_min_size: int = 256
    #: diffusers' tile_sample_stride_height/width: output pixels between tile starts
    tile_sample_stride: int = 192
    #: tiled=None tiles only frames above this many output pixels
    max_untiled_pixels: int = DEFAULT_MAX_UNTILED_PIXELS


class _VAEDecoderTree(Module):
    """The checkpoint's decoder side: post_quant_conv (1x1x1) and the decoder."""

    def __init__(self, cfg: WanVAEConfig, decoder: type[Module]):
        super().__init__()
        z = cfg.z_dim
        self.post_quant_conv = self.add("post_quant_conv", CausalConv3d(z, z, 1))
        self.decoder = self.add("decoder", decoder(cfg.decoder_base_dim or cfg.base_dim, z, cfg.dim_mult,
                                                   cfg.num_res_blocks, cfg.temperal_upsample, cfg.out_channels))


class WanVAEDecoder:
    """Video decoder per docs/interfaces.md: normalised latents (N, C, T, h, w) ->
    float32 frames (N, 1 + 4*(T-1), 8h, 8w, 3) in [0, 1]."""

    kind = VIDEO_DECODER
    #: Hub weights only; load_model sets it (models/contract.py)
    weights_provenance: dict | None = None
    architecture = "diffusers AutoencoderKLWan decoder (Wan 2.1 video VAE, causal 3-D convs)"
    #: the diffusers class whose decoder this is (load errors name it)
    reference_class = "AutoencoderKLWan"
    #: the decoder's layer tree: Wan 2.1's; Wan 2.2's model names its residual one
    decoder_class: type[Module] = Decoder3d

    def __init__(self, name: str, preset: str, backend: Backend, cfg: WanVAEConfig,
                 tensors: Mapping[str, np.ndarray] | None = None, weights_source: str | None = None,
                 options: WanVAEOptions | None = None):
        options = options or WanVAEOptions()
        self.name, self.preset, self.backend, self.config = name, preset, backend, cfg
        self.tiling = video_tiles_for_size(options.tile_size) if options.tile_size else \
            video_tiles(int(options.tile_sample_min_size), int(options.tile_sample_stride))
        self.max_untiled_pixels = int(options.max_untiled_pixels)
        self.latent_channels = cfg.z_dim
        self.spatial_factor = cfg.spatial_factor
        self.temporal_factor = cfg.temporal_factor
        self._mean = np.asarray(cfg.latents_mean, np.float32).reshape(1, -1, 1, 1, 1)
        self._std = np.asarray(cfg.latents_std, np.float32).reshape(1, -1, 1, 1, 1)
        self.tree = self._decoder_tree(cfg)
        if tensors is None:
            self.weights_source, self.weights_naming = "random init", None
            tensors = random_state_dict(self.tree.expected_shapes(), options.seed, INIT_RULES)
        else:
            self.weights_source = weights_source or "given tensors"
            self.weights_naming = checkpoint_naming(tensors)
            tensors = normalize_keys(tensors, cfg)
        # the encoder half of a full VAE checkpoint is fine to carry; the decoder must be exact
        naming = "" if self.weights_naming in (None, "diffusers") else \
            f", {self.weights_naming} names shown as diffusers names"
        # the video processor's x / 2 + 0.5 is done by conv_out itself
        self.tree.load_checked(fold_output_affine(tensors, "decoder.conv_out", 0.5, 0.5), backend,
                               f"{self.reference_class} decoder (preset {preset!r}{naming})",
                               ignore_unexpected=("encoder.", "quant_conv."))
        self._steady_step = backend.graphed(self._step)
        #: a row shard's recorded steady steps (their collectives are captured with them), one per
        #: shard group and band
        self.sharded_steps: dict = {}

    def _decoder_tree(self, cfg: WanVAEConfig) -> Module:  # a family whose convs differ builds its own
        return _VAEDecoderTree(cfg, self.decoder_class)

    # ---- decode ----------------------------------------------------------------------------------
    def _prepare(self, latents_ncthw) -> PreparedLatents:
        """Validate, then see the latents as the de-normalised (latents * std + mean), channels-last
        N,T,h,w,C clip the decode reads, each frame prepared when the decode reaches it."""
        lat = np.asarray(latents_ncthw)
        if lat.ndim != 5 or lat.shape[1] != self.latent_channels or min(lat.shape) < 1:
            raise ValueError(f"{self.name}: latents must be (N, {self.latent_channels}, T, h, w) with "
                             f"every size >= 1, got {lat.shape}")
        return PreparedLatents(lat, self._denormalise, self.name)

    def _denormalise(self, lat: np.ndarray) -> np.ndarray:
        """float32 normalised latents (N, C, T, h, w) -> the VAE's own: latents * std + mean."""
        return lat * self._std + self._mean

    def decode_frames(self, latents_ncthw, tiled: bool | None = None, *, uint8: bool = False,
                      clamp: bool = True, chunks: ChunkPlan | None = None) -> Iterator[np.ndarray]:
        """Frame groups as docs/interfaces.md describes them. Each group is computed only when asked
        for, so a slow reader holds back the decode (back-pressure); bad latents raise here, before
        the first group is asked for. uint8=True: uint8 groups, floor(clip(x, 0, 1) * 255 + 0.5) of
        the float32 frames (convkernels.pixels_to_uint8): untiled, converted on the device before
        the copy; tiled, the float32 tiles are stitched on the host and converted there.
        clamp=False: float32 frames unclipped (x / 2 + 0.5 of the decoder's output).
        chunks: how the untiled decode steps its latent frames (chunk_plan.py; by default one at a
        time, or on a row shard what its band calls for; every shard of a group takes the same)."""
        z = self._prepare(latents_ncthw)
        _, _, h, w, _ = z.shape
        sf = self.spatial_factor
        if tiled is None:
            tiled = h * w * sf * sf > self.max_untiled_pixels
        plan = self._tile_plan(h, w) if tiled else None
        if plan is None:
            return self._untiled_groups(z, uint8, PIXEL_RANGE if clamp or uint8 else None, chunks)
        return self._tiled_groups(z, plan, uint8, clamp)

    def _untiled_groups(self, z: np.ndarray, uint8: bool, clip, chunks: ChunkPlan | None) -> Iterator[np.ndarray]:
        """The untiled decode in runs of latent frames (`chunks`), each run handed out as its frame
        groups, so a stream's groups are the same whatever the runs. On a row shard (read when the
        first group is asked for: the runner makes the shard current around each step) there is no
        interrupt.check() between runs: a shard that stopped alone would leave the others waiting."""
        shard = row_shard.current()
        if chunks is None:
            chunks = UNSHARDED if shard is None else chunk_plan(max(shard.token_counts(shard.own, z.shape[3])))
        state = FeatureCache()
        starts = [0, *range(1, z.shape[1], chunks.frames)]
        stops = [*starts[1:], z.shape[1]]

        def started():
            for start, stop in zip(starts, stops):
                interrupt.check()  # its requesters gone: stop between frame groups
                yield self._decode_chunk(z[:, start:stop], state, clip=clip, uint8=uint8,
                                         graphed=chunks.graphed and stop - start == chunks.frames)

        tf = self.temporal_factor
        for frames in one_group_ahead(started(), self.backend.runs_ahead):
            if frames.shape[1] <= tf:
                yield frames
            else:
                for at in range(0, frames.shape[1], tf):
                    yield frames[:, at:at + tf]

    def _tiled_groups(self, z: np.ndarray, plan, uint8: bool = False, clamp: bool = True) -> Iterator[np.ndarray]:
        size = plan.tile_latent
        states = [[FeatureCache() for _ in plan.cols] for _ in plan.rows]
        for k in range(z.shape[1]):
            interrupt.check()
            tiles = [[self._decode_chunk(z[:, k:k + 1, i:i + size, j:j + size], states[a][b], whole=False).result()
                      for b, j in enumerate(plan.cols)] for a, i in enumerate(plan.rows)]
            yield self._to_pixels(self._stitched(plan, tiles), uint8, clamp)

    def _tile_plan(self, h: int, w: int):
        """The tile grid for latents of h x w (None: one tile)."""
        return plan_video_tiles(h, w, self.spatial_factor, self.tiling)

    def _stitched(self, plan, tiles) -> np.ndarray:
        """One chunk's decoded tiles (as the decoder gives them) blended into frames."""
        return stitch_video_tiles(plan, tiles)

    def _frames(self, out):
        """The decoder's output (on the device) as the frames it stands for (Wan 2.2 unpatchifies)."""
        return out

    def _decode_chunk(self, z_chunk: np.ndarray, state: FeatureCache, clip=None, uint8: bool = False,
                      whole: bool = True, graphed: bool = True):
        """One latent frame (host N,1,h,w,C, de-normalised) -> the decoder output's way to the
        host (`.result()`: float32, mapped to image space by conv_out's folded x / 2 + 0.5,
        clipped to `clip` if given; uint8: 8-bit pixels, converted on the device), advancing
        `state`; the device may still be working when this returns. whole=False (a tile): the
        decoder's output as it is, not yet made frames (_frames; the stitched tiles are, _stitched).
        Steady chunks (the third on) go through the graphed step where `graphed` and the backend
        records it: their shapes repeat, so it replays them; the first two change the cache's
        layout."""
        b = self.backend
        x = b.asarray(np.ascontiguousarray(z_chunk))
        step = self._recorded_step() if graphed and state.steady() else None
        # eagerly, the in-place route frees each old cache slot as its new one is made; the
        # functional step would hold the whole old cache (2.3 GB at 480x832) until it returns
        if step is not None and step.records(x, *state.slots):
            out, *slots = step(x, *state.slots)
            state.slots = slots
        else:
            out = self.tree.decoder(self.tree.post_quant_conv(x), state)
        return b.to_host_async(self._frames(out) if whole else out, clip, uint8=uint8)

    def _recorded_step(self):
        """The recorded steady step of the current shard (one per shard group and band: its
        collectives are captured with it), or the unsharded one; None where a shard's backend
        records nothing (calls_to_warm 1: the step would only run eagerly)."""
        shard = row_shard.current()
        if shard is None:
            return self._steady_step
        if self.backend.calls_to_warm <= 1:
            return None
        step = self.sharded_steps.get(shard)
        if step is None:
            step = self.sharded_steps[shard] = self.backend.graphed(self._step)
        return step

    def _step(self, x, *cache):
        """(latent frame, cache slots) -> (decoder output, the next chunk's cache slots), all on
        the device and nothing else read or kept: the shape of a recordable forward."""
        state = FeatureCache(cache)
        out = self.tree.decoder(self.tree.post_quant_conv(x), state)
        return (out, *state.slots)

    @staticmethod
    def _to_pixels(x, uint8: bool = False, clamp: bool = True) -> np.ndarray:
        """Stitched tiles -> pixels (an untiled group is clipped on its way to the host)."""
        out = np.asarray(x, dtype=np.float32)
        if uint8:
            return pixels_to_uint8(out)
        if clamp:
            np.clip(out, *PIXEL_RANGE, out=out)
        return out

    def decode(self, latents_ncthw, tiled: bool | None = None, *, uint8: bool = False,
               clamp: bool = True) -> np.ndarray:
        """All frames at once: float32 (N, 1 + 4*(T-1), 8h, 8w, 3) in [0, 1]; uint8=True: uint8,
        clamp=False: unclipped, as decode_frames gives them."""
        groups = self.decode_frames(latents_ncthw, tiled, uint8=uint8, clamp=clamp)
        return joined_groups(groups, self.output_frames(np.shape(latents_ncthw)[2]))

    def output_frames(self, latent_frames: int) -> int:
        """Frames decoded from this many latent frames: the first gives one, every later one
        temporal_factor."""
        return 1 + self.temporal_factor * (latent_frames - 1)

    # ---- description -----------------------------------------------------------------------------
    @property
    def latent_stats(self) -> tuple[tuple[float, ...], tuple[float, ...]]:  # models/contract.py PerChannelLatents
        return tuple(self.config.latents_mean), tuple(self.config.latents_std)

    def smaller_tiling(self, current: TileSettings) -> TileSettings | None:  # models/contract.py
        return smaller_video_tiles(current, self.spatial_factor)

    def card(self) -> dict:
        return card_fields(self, self.architecture, weights_naming=self.weights_naming,
                           latent_channels=self.latent_channels, spatial_factor=self.spatial_factor,
                           temporal_factor=self.temporal_factor,
                           input="normalised latents (N, C, T, h, w); decode applies latents * latents_std "
                                 "+ latents_mean",
                           output=f"float32 (N, 1 + {self.temporal_factor}*(T-1), {self.spatial_factor}h, "
                                  f"{self.spatial_factor}w, 3) in [0, 1]",
                           limits={"streaming": True, "frames_per_chunk": [1, self.temporal_factor],
                                   "cache_frames_per_conv": CACHE_T,
                                   "memory": "bounded by one latent frame's activations, not by clip length",
                                   "tile_sample_min_size": self.tiling.tile_px,
                                   "tile_sample_stride": self.tiling.stride_px,
                                   "max_untiled_pixels": self.max_untiled_pixels},
                           config=self.config.as_dict())


def joined_groups(groups: Iterable[np.ndarray], frames: int) -> np.ndarray:
    """Frame groups (N, f, ...) joined in time into one (N, frames, ...) array, each copied in as
    it lands, while the device works on the next (one_group_ahead): no join of the whole clip
    after the last group (at 81x480x832 that copy is 390 MB)."""
    out, at = None, 0
    for g in groups:
        if out is None:
            out = np.empty((g.shape[0], frames, *g.shape[2:]), g.dtype)
        out[:, at:at + g.shape[1]] = g
        at += g.shape[1]
    return out


def one_group_ahead(started: Iterator, ahead: bool) -> Iterator[np.ndarray]:
    """The results of frame groups started one by one (each item of `started` queues a group and
    returns its way to the host, `.result()`). Where the backend runs ahead, group k+1 is queued
    on the device before group k is waited for (from the second group on), so k's copy and host
    work overlap k+1's kernels: one group of look-ahead; a slow reader still holds the decode back,
    and the first group leaves as soon as it is done. Elsewhere each group is computed when asked
    for."""
    pending = None
    for k, group in enumerate(started):
        if pending is not None:
            yield pending.result()
        pending = group
        if k == 0 or not ahead:
            yield pending.result()
            pending = None
    if pending is not None:
        yield pending.result()
