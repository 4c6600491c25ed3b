"""The Wan video VAEs' decode split by rows over shards, equal to the unsharded,
untiled decode (models/wan_vae/model.py): Wan 2.1's, Qwen-Image's (Wan 2.1's on one frame) and Wan
2.2's (models/wan22_vae/model.py; below).

Every shard runs the decoder of one `WanVAEDecoder` with the model's own parameters on its rows
of the latents (channels-last N,T,h,w,C, rows on axis 2), the first latent frame alone and
then runs of frames (ChunkPlan: small bands take two at a time) with its own FeatureCache, by
the unsharded decode's cache rules, and talks to the other shards only
through its communicator (convkernels.collectives.shard_comm.ShardComm):
- each causal conv with a 3x3 spatial kernel (conv_in, the residual blocks' convs, conv_out)
  gets one row above and one below from its neighbours (sharded_ops.halo_rows) BEFORE its
  causal cache joins the earlier frames, and the cache keeps those haloed frames: a cached
  frame's edge rows are then the neighbours' rows of that frame, as the conv of the whole frame
  needs, with no second exchange for the cached frames (sharded_ops.haloed_conv3d runs the conv;
  at the image's own top and bottom the conv pads the zero rows);
- 1x1x1 convs (post_quant_conv, conv_shortcut), the RMS norms over channels, SiLU and the
  upsamplers' causal (3,1,1) time conv are row-local and run as they are, their cache slots
  holding the shard's own rows;
- the spatial upsample (rows [a, b) become [2a, 2b)) is the unsharded decode's one op
  (upsample_conv2d: a transposed conv on CUDA) on the shard's rows with one row of each
  neighbour, frame by frame (sharded_ops.halo_upsample_conv2d);
- the mid-block attention, within each frame: each shard's queries attend to the keys and
  values of every position of that frame, all-gathered from every shard in rank order;
- Wan 2.2's up blocks add their input back through DupUp3D (channels to 2x2 pixels, and frames),
  which maps each row to two of its own, in the haloed upsample's epilogue (_shortcut); its 2x2
  output patches (unpatchify) are row-local too.

The first latent frame gives one frame and every later one `temporal_factor` frames, by the
same cache rules as the unsharded decode (the layers' with_cache and the upsampler's first-chunk
marker, shared code). The de-normalisation (latents * std + mean) is per channel, so local.
conv_out holds x / 2 + 0.5 (folded at load), so each shard clips its frames to [0, 1] as
model.decode does. Steady chunks (the third on) of a small band replay a recorded graph where
the backend records one, collectives included, as the unsharded decode's do (see _chunk). A run
of frames is handed out as its frame groups, so a stream's groups are the unsharded decode's.
models.sharding.decode_emulated runs the lot on threads (ThreadShards, NCCL's collective
semantics) and joins the shards' rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Iterator

import numpy as np

from convkernels.collectives.shard_comm import ShardComm
from convkernels.sharded_ops import halo_rows, halo_upsample_conv2d, haloed_conv3d

from ..contract import PIXEL_RANGE
from .autoencoder_kl import Shard
from ..wan22_vae.layers import ResidualDecoder3d, ResidualUpBlock, dup_up_residual
from ..wan_vae.model import joined_groups, one_group_ahead
from ..wan_vae.layers import Decoder3d, FeatureCache

#: rows are axis 2 of the decoder's activations (N, T, H, W, C)
ROWS = 2


def _causal_conv(sh: Shard, conv, x, state: FeatureCache, norm=None, residual=None):
    """CausalConv3d.cached (or with_cache with a norm + SiLU in front) on this shard's rows. The
    neighbours' edge rows are fetched as they are, before the norm: the norm is per position, so
    normalising them gives the neighbours' normalised rows. with_cache then has the norm write
    each of the three (rows above, the shard's, rows below) where the joined rows lie, behind the
    cached frames, in one buffer (no joined copy of the shard's rows), and the cache keeps those
    haloed frames. The image's own top and bottom rows are the conv's zero padding (rows_pad),
    never copied in."""
    halo = (conv.kernel[1] - 1) // 2
    rows, rows_pad = (None, (0, 0)) if not halo else halo_rows(conv.backend, sh.comm, x, halo, axis=ROWS)
    x, lo = conv.with_cache(x, state, norm, rows)
    return haloed_conv3d(conv.backend, x, conv.weight, conv.bias, time_pad=lo, rows_pad=rows_pad, residual=residual)


def _residual_block(sh: Shard, block, x, state: FeatureCache):
    """wan_vae_layers.ResidualBlock: norm-SiLU-conv twice, the (1x1x1, row-local) skip added in
    conv2's epilogue; its two cache slots taken in the same order."""
    skip = x if block.conv_shortcut is None else block.conv_shortcut(x)
    h = _causal_conv(sh, block.conv1, x, state, block.norm1)
    return _causal_conv(sh, block.conv2, h, state, block.norm2, residual=skip)


def _attention(sh: Shard, attn, x):
    """wan_vae_layers.AttentionBlock with this shard's positions of each frame as queries and
    every shard's as keys and values: K and V travel as one all-gathered array (channels
    concatenated), tokens in rank order = row order = the frame's own token order."""
    b = attn.backend
    n, t, h, w, c = x.shape
    frames = b.reshape(x, (n * t, h, w, c))
    qkv = b.reshape(attn.to_qkv(attn.norm(frames)), (n * t, h * w, 3 * c))
    q = b.slice(qkv, -1, 0, c)
    every = b.concat(sh.comm.allgather(b.slice(qkv, -1, c, 3 * c), sh.token_counts(w)), axis=1)
    k, v = b.slice(every, -1, 0, c), b.slice(every, -1, c, 2 * c)
    attended = b.reshape(b.attention(q, k, v, scale=1.0 / math.sqrt(c)), (n * t, h, w, c))
    return b.reshape(attn.proj(attended, residual=frames), (n, t, h, w, c))


def _resample(sh: Shard, upsampler, x, state: FeatureCache, shortcut=None):
    """wan_vae_layers.Resample: the time doubling (a (3,1,1) conv, row-local, its cache the
    shard's own rows; the layer's own code), then nearest 2x and the 3x3 conv as one op on the
    shard's rows with one row of each neighbour (halo_upsample_conv2d), every frame on its own.
    shortcut(above, below) (Wan 2.2's, _shortcut), if given, makes what that op's epilogue adds (a
    ShuffledResidual: frames already)."""
    b = upsampler.backend
    if upsampler.time_conv is not None:
        x = upsampler._double_frames(x, state)
    n, t, h, w, c = x.shape
    frames = halo_upsample_conv2d(b, sh.comm, b.reshape(x, (n * t, h, w, c)), upsampler.conv.weight,
                                  upsampler.conv.bias, residual_for=shortcut)
    return b.reshape(frames, (n, t, 2 * h, 2 * w, upsampler.out_dim))


def _shortcut(up: ResidualUpBlock, x, first_chunk: bool, above: bool, below: bool):
    """Wan 2.2's DupUp3D shortcut of an up block's input x, for the haloed upsample it joins:
    DupUp3D maps each row to two of its own (row-local), and the haloed op computes two output
    rows more on each side where a halo row came (`above`, `below`), then drops them. The
    shortcut's rows there only have to exist: x's own edge row stands in for the neighbour's (no
    exchange, no upload, so a recorded graph holds it too)."""
    b, rows = up.backend, x.shape[ROWS]
    parts = [*([b.slice(x, ROWS, 0, 1)] if above else []), x,
             *([b.slice(x, ROWS, rows - 1, rows)] if below else [])]
    return dup_up_residual(b.concat(parts, axis=ROWS) if len(parts) > 1 else x, up.cout, up.factor_t, 2, first_chunk)


def _up_block(sh: Shard, up, x, state: FeatureCache, first_chunk: bool):
    """An up block: Wan 2.1's UpBlock (resnets, then its upsampler), or Wan 2.2's ResidualUpBlock,
    whose input also comes back through the DupUp3D shortcut into the upsampler's conv."""
    skip = x
    for block in up.resnets:
        x = _residual_block(sh, block, x, state)
    if up.upsampler is None:
        return x
    shortcut = partial(_shortcut, up, skip, first_chunk) if isinstance(up, ResidualUpBlock) else None
    return _resample(sh, up.upsampler, x, state, shortcut)


def sharded_decoder_chunk(model, sh: Shard, z, state: FeatureCache):
    """A run of latent frames through post_quant_conv and the decoder (Decoder3d.__call__'s layers
    in its order, so the cache slots line up) on this shard's rows: backend array (N, t, rows, w, C),
    de-normalised -> this shard's rows of the chunk's frames (x / 2 + 0.5 included, unclipped)."""
    dec = model.tree.decoder
    first_chunk = not state.slots  # Wan 2.2's shortcuts keep one frame of the first chunk's
    state.start_chunk()
    x = _causal_conv(sh, dec.conv_in, model.tree.post_quant_conv(z), state)
    mid = dec.mid_block
    x = _residual_block(sh, mid.resnets[0], x, state)
    x = _attention(sh, mid.attention, x)
    x = _residual_block(sh, mid.resnets[1], x, state)
    for up in dec.up_blocks:
        x = _up_block(sh, up, x, state, first_chunk)
    return model._frames(_causal_conv(sh, dec.conv_out, x, state, dec.norm_out))  # Wan 2.2 unpatchifies


def sharded_wan_frame_groups(model, comm: ShardComm, z_rows, clamp: bool = True, *, total_rows: int,
                             plan: "ChunkPlan | None" = None, uint8: bool = False) -> Iterator[np.ndarray]:
    """This shard's part of model.decode_frames (untiled): z_rows are its rows of the normalised
    latents as the pipeline hands them, host (N, C, T, rows, w), the shard's band of the whole's
    `total_rows` (split as models.sharding.bands splits them); yields its rows of each frame
    group, host float32 (N, 1 then temporal_factor frames, f rows, f w, 3) for the model's
    spatial factor f, in [0, 1] unless clamp=False. Bad latents raise before the first group, as
    the unsharded decode's do.
    plan: how the shard steps its frames (chunk_plan of its band by default; every shard of a
    group must be given the same frames). uint8=True: uint8 groups, converted on the device
    before the copy, as the unsharded decode_frames(uint8=True) gives them."""
    if not isinstance(model.tree.decoder, (Decoder3d, ResidualDecoder3d)):
        raise ValueError(f"{model.name}: the sharded decode is Wan 2.1's and Wan 2.2's (Decoder3d, "
                         f"ResidualDecoder3d), not {type(model.tree.decoder).__name__}")
    z = model._prepare(z_rows)  # validation, latents * std + mean, channels-last: per channel, row-local
    sh = Shard(comm, (int(total_rows), int(z.shape[2])))
    return _groups(model, sh, z, clamp, plan or chunk_plan(max(sh.token_counts(z.shape[3]))), uint8)


def _groups(model, sh: Shard, z: np.ndarray, clamp: bool, plan: "ChunkPlan", uint8: bool) -> Iterator[np.ndarray]:
    """Every shard steps its chunks as the unsharded decode does (one_group_ahead), so the
    collectives still meet in order, and hands out a chunk of several latent frames as their
    frame groups (1 frame, then temporal_factor per latent frame). No interrupt.check() between
    groups, unlike the unsharded decode: a shard that stopped alone would leave the others
    waiting in their next collective."""
    b = model.backend
    state = FeatureCache()
    starts = [0, *range(1, z.shape[1], plan.frames)]
    stops = [*starts[1:], z.shape[1]]

    def started():
        for start, stop in zip(starts, stops):
            x = b.asarray(np.ascontiguousarray(z[:, start:stop]))
            yield b.to_host_async(_chunk(model, sh, x, state, plan), PIXEL_RANGE if clamp else None, uint8=uint8)

    tf = model.temporal_factor
    for frames in one_group_ahead(started(), b.runs_ahead):
        for at in range(0, frames.shape[1], tf):
            yield frames[:, at:at + tf]


@dataclass(frozen=True)
class ChunkPlan:
    """How a shard steps its latent frames after the first (which goes alone: it gives one frame
    and changes the cache's layout): `frames` at a time, and its steady chunks through a recorded
    graph where `graphed` (and the backend records one). Any run of frames is exact: the causal
    convs read the cached frames in front of the run, the time doubling interleaves each input
    frame's two outputs, the attention is per frame (diffusers' own encoder steps 1 then 4). A
    longer run gives a shard's kernels more work each (a band of 15 latent rows leaves an H200's
    kernels short) and halves the launches and exchanges, at its activations' memory."""
    frames: int
    graphed: bool


#: (a shard's latent positions per frame (band rows x width) up to, its chunk plan); larger bands
#: step one frame at a time, eagerly. Measured 2026-11-26 (benchmarks/HISTORY.md, "Sharded Wan in
#: runs of latent frames"), Wan 2.1 81x480x832 bf16: on 4 GPUs (15 x 104 = 1560 positions) runs of
#: 3 took 283.8 ms on 4x H200 (4: 269.7 ms at 1.24x the memory; one frame graphed, the earlier
#: default, 370 ms against 2 eager 350 on 4x H100); on 2 GPUs (3120) runs of 2 took 520.3 ms (4:
#: no faster, at 1.8x the memory). Graphed runs were slower than eager ones on both (a graph's pool
#: holds the run's activations and the causal cache twice more). 121x720x1280 on 4 GPUs (3680) ran
#: one frame at a time in 1072 ms at 0.35x one GPU's memory (the issue's memory bound)
CHUNK_RULES: tuple[tuple[int, ChunkPlan], ...] = ((1600, ChunkPlan(3, False)), (3200, ChunkPlan(2, False)))
ONE_FRAME_EAGER = ChunkPlan(1, False)


def chunk_plan(band_positions: int) -> ChunkPlan:
    """The plan for a shard whose band has this many latent positions per frame (CHUNK_RULES)."""
    return next((plan for limit, plan in CHUNK_RULES if band_positions <= limit), ONE_FRAME_EAGER)


def _chunk(model, sh: Shard, x, state: FeatureCache, plan: ChunkPlan):
    """sharded_decoder_chunk, through a recorded graph for steady chunks of plan.frames where the
    plan says so and the backend records one, as the unsharded decode's steady step: one launch
    for the chunk's hundreds of kernels and its collectives, which are queued on the same stream
    (NCCL calls may be captured). A last, shorter chunk runs eagerly (a graph for a shape seen
    once a decode would only hold memory). Every shard decides alone; a shard that runs a chunk
    eagerly where the others replay issues the same collectives in the same order, so they
    still meet."""
    graphed = plan.graphed and x.shape[1] == plan.frames
    if state.steady() and graphed and model.backend.calls_to_warm > 1:
        step = model.sharded_steps.get(sh)
        if step is None:  # one per shard group and band: sh holds the communicator and the rows
            step = model.sharded_steps[sh] = model.backend.graphed(partial(_step, model, sh))
        if step.records(x, *state.slots):
            out, *slots = step(x, *state.slots)
            state.slots = slots
            return out
    return sharded_decoder_chunk(model, sh, x, state)


def _step(model, sh: Shard, x, *cache):
    """(latent frame, cache slots) -> (this shard's decoder output, the next cache slots): the
    shape of a recordable forward (WanVAEDecoder._step's, sharded)."""
    state = FeatureCache(cache)
    out = sharded_decoder_chunk(model, sh, x, state)
    return (out, *state.slots)


def sharded_wan_decode(model, comm: ShardComm, z_rows, clamp: bool = True, *, total_rows: int,
                       plan: ChunkPlan | None = None) -> np.ndarray:
    """Every frame group of sharded_wan_frame_groups, joined in time: this shard's rows of
    model.decode(latents, tiled=False), (N, 1 + temporal_factor * (T - 1), f rows, f w, 3)."""
    groups = sharded_wan_frame_groups(model, comm, z_rows, clamp, total_rows=total_rows, plan=plan)
    return joined_groups(groups, model.output_frames(np.shape(z_rows)[2]))
