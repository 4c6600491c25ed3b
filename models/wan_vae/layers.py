"""Building blocks of the Wan 2.1 video VAE decoder, written on the backend op API only.

Layout is channels-last: activations N,T,H,W,C; conv weights O,kT,kH,kW,I. The layers are
models/nn/module.py Modules and run on the backend their parameters were loaded to
(`self.backend`), so the per-chunk calls carry only activations and the feature cache.

The semantics follow diffusers' `autoencoder_kl_wan.py` (Wan 2.1, `is_residual=False`) line
for line where it matters: causal time padding with zeros (2*p on the left, none on the
right), the per-conv feature cache of the last CACHE_T input frames, and the first-chunk
rule of the temporal upsampler (diffusers marks its slot "Rep"; FIRST_CHUNK_SEEN here), which
skips the time conv on the first latent frame.

On a row shard (models/nn/row_shard.py, rows are axis 2) a causal conv with a 3x3 spatial kernel
fetches one row above and one below from its neighbours BEFORE its cache joins the earlier frames,
and the cache keeps those haloed frames: a cached frame's edge rows are then the neighbours' rows
of that frame, as the conv of the whole frame needs, with no second exchange; at the image's own
top and bottom the conv pads zero rows. The attention gathers every shard's keys and values of
each frame, the upsampler takes one halo row; RMS norms, 1x1x1 and time convs are row-local.
"""
from __future__ import annotations

import enum
import math
from typing import Any, Union

import numpy as np

from convkernels import Backend
from convkernels.sharded_ops import halo_rows, halo_upsample_conv2d

from ..nn import row_shard
from ..nn.layers import Conv, Conv2d
from ..nn.module import Module

Array = Any

#: frames of causal context each cached conv keeps between chunks (diffusers' CACHE_T)
CACHE_T = 2


class CacheMarker(enum.Enum):
    """A cache slot's state when it holds no frames but is not empty either."""
    #: a temporal upsampler that has seen the first chunk but has no frames cached yet
    #: (diffusers stores the string "Rep" there)
    FIRST_CHUNK_SEEN = "first chunk seen"


FIRST_CHUNK_SEEN = CacheMarker.FIRST_CHUNK_SEEN
#: what one slot of a FeatureCache holds: cached frames, the marker, or nothing yet
CacheSlot = Union[Array, CacheMarker, None]


def holds_frames(slot: CacheSlot) -> bool:
    return slot is not None and not isinstance(slot, CacheMarker)


#: F.normalize divides by max(||x||, 1e-12); rms_norm's eps (1e-24 / C) plays that role
RMS_EPS = 1e-12


class FeatureCache:
    """Causal state of one decode: one slot per cached conv, visited in the same order on
    every chunk (diffusers' feat_cache/feat_idx). Holds at most CACHE_T frames per slot, so
    memory does not grow with clip length."""

    def __init__(self, slots=()) -> None:
        self.slots: list[CacheSlot] = list(slots)
        self.pos = 0

    def steady(self) -> bool:
        """Every slot holds frames (no first-chunk marker, none missing): from the third chunk
        on, when each chunk's inputs and cache have the same shapes as the last one's."""
        return bool(self.slots) and all(holds_frames(s) for s in self.slots)

    def start_chunk(self) -> None:
        self.pos = 0

    def peek(self) -> CacheSlot:
        if self.pos == len(self.slots):
            self.slots.append(None)
        return self.slots[self.pos]

    def put(self, value: CacheSlot) -> None:
        self.slots[self.pos] = value
        self.pos += 1

    def release(self) -> None:
        """Drop the current slot's frames (already read with peek) before its new ones are
        made, so the old and the new do not sit in memory together; put() follows."""
        self.slots[self.pos] = None


def _own_copy(backend: Backend, x):
    """A tensor that does not pin its parent alive: a slice (of a 4-frame chunk, or of the
    2C-channel norm output, see ChannelRMSNorm) would keep all of it in memory for as long as
    it sits in the cache."""
    return backend.concat([x], axis=1)


def cache_tail(backend: Backend, x, prev):
    """The frames a causal conv keeps for the next chunk: the last CACHE_T input frames,
    topped up with the previous chunk's last frame when this chunk is a single frame."""
    t = x.shape[1]
    tail = backend.slice(x, 1, max(0, t - CACHE_T), t)
    if tail.shape[1] < CACHE_T and holds_frames(prev):
        last = backend.slice(prev, 1, prev.shape[1] - 1, prev.shape[1])
        return backend.concat([last, tail], axis=1)
    return _own_copy(backend, tail)


class CausalConv3d(Conv):
    """Conv3d padded causally in time: 2*p zero frames on the left, none on the right
    (diffusers pads with zeros, F.pad's default); cached frames of the previous chunk
    replace that many zero frames."""

    def __init__(self, cin: int, cout: int, kernel, padding=0):
        kernel = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        padding = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        super().__init__(cin, cout, kernel)
        self.time_pad = 2 * padding[0]
        self.space_pad = ((padding[1], padding[1]), (padding[2], padding[2]))
        self._last_tap = None

    def derive(self, tensors, prefix):
        self._last_tap = None  # sliced from the weight this load replaced

    def prepare(self) -> None:
        """the weight as a later chunk's call reads it (4 frames of 64 x 64 with the cached ones), and
        the first frame's last tap"""
        self.backend.prepare_conv(self.weight, padding=((self.time_pad, 0), *self.space_pad), size=(4, 64, 64))
        if self.kernel[0] > 1:
            self.backend.prepare_conv(self._last_tap_weight(), padding=((0, 0), *self.space_pad), size=(1, 64, 64))

    def __call__(self, x, cache=None, residual=None):
        lo = self.time_pad
        rows = self._halo(x)
        if rows is not None:
            x = self.backend.concat([r for r in (rows[0], x, rows[1]) if r is not None], axis=2)
        if cache is not None and lo > 0:
            x = self.backend.concat([cache, x], axis=1)
            lo -= cache.shape[1]
        return self.padded(x, lo, residual)

    def _halo(self, x):
        """On a row shard, for a kernel taller than one row: (the rows above, the rows below) from
        the neighbours (None at the image's own top or bottom); else None."""
        shard = row_shard.current()
        halo = (self.kernel[1] - 1) // 2
        if shard is None or not halo:
            return None
        return halo_rows(self.backend, shard.comm, x, halo, axis=2)[0]

    def padded(self, x, lo: int, residual=None):
        """The conv on input that already carries its cached frames, `lo` zero frames still to
        pad on the left (with_cache's pair), and on a row shard its halo rows (zero rows padded
        only at the image's own top and bottom)."""
        b = self.backend
        kt = self.kernel[0]
        space = self.space_pad
        shard = row_shard.current()
        if shard is not None and self.kernel[1] > 1:
            space = (shard.edge_pad(space[0][0]), space[1])
        if kt > 1 and lo == kt - 1 and x.shape[1] == 1:
            # A lone frame with no cache (every conv of the first chunk): all taps but the
            # last fall on zero padding, so skip them, 1/kT of the work for the first frame.
            return b.conv3d(x, self._last_tap_weight(), self.bias, padding=((0, 0), *space),
                            residual=residual)
        return b.conv3d(x, self.weight, self.bias, padding=((lo, 0), *space), residual=residual)

    def _last_tap_weight(self):
        if self._last_tap is None:
            kt = self.kernel[0]
            b = self.backend
            self._last_tap = b.concat([b.slice(self.weight, 1, kt - 1, kt)], axis=1)
        return self._last_tap

    def with_cache(self, x, state: FeatureCache, norm: "ChannelRMSNorm | None" = None):
        """(x with this conv's cached frames in front, zero frames still to pad on the left),
        refreshing the slot with the last CACHE_T of them (cache_tail's frames: with a cache in
        front they are the tail of the joined input). The old slot is freed as soon as it is
        joined, before the new one is copied out; a caller that drops x once this returns holds
        only the joined input through the conv (`h, lo = conv.with_cache(h, state)`, then
        `conv.padded(h, lo)`), not x and the joined copy of it together.
        norm: the RMS norm + SiLU that feeds this conv, applied to x here so that it writes its
        output behind the cached frames (no joined copy of a full chunk).
        On a row shard the conv's halo rows (above, below; axis 2) are fetched as they are, before
        the norm: the norm is per position, so normalising them gives the neighbours' normalised
        rows. The norm, where there is one, writes them where they belong (no joined copy of x)."""
        b = self.backend
        rows = self._halo(x)
        if rows is not None and norm is None:
            x = b.concat([r for r in (rows[0], x, rows[1]) if r is not None], axis=2)
        prev = state.peek()
        if not holds_frames(prev) or self.time_pad == 0:
            if norm is not None:
                x = norm(x, "silu", rows=rows)
            state.put(cache_tail(b, x, prev))
            return x, self.time_pad
        state.release()
        x = b.concat([prev, x], axis=1) if norm is None else norm(x, "silu", prefix=prev, rows=rows)
        lo = self.time_pad - prev.shape[1]
        del prev
        t = x.shape[1]
        state.put(_own_copy(b, b.slice(x, 1, t - CACHE_T, t)))
        return x, lo

    def cached(self, x, state: FeatureCache | None, residual=None):
        """Run on one chunk, reading and refreshing this conv's slot of the feature cache."""
        if state is None:
            return self(x, residual=residual)
        return self.padded(*self.with_cache(x, state), residual=residual)


class ChannelRMSNorm(Module):
    """WanRMS_norm: F.normalize over channels * sqrt(C) * gamma (no bias in the decoder), i.e.
    the backend's rms_norm with eps = 1e-24 / C (F.normalize's 1e-12 floor on ||x||). (A backend
    without an RMS kernel bounds its temporaries itself, Backend.RMS_BAND_BYTES.)"""

    def __init__(self, dim: int, images: bool):
        super().__init__()
        self.dim = dim
        self.shape = (dim, 1, 1) if images else (dim, 1, 1, 1)
        self.gamma = None
        self.eps = RMS_EPS ** 2 / dim

    def param_shapes(self):
        return {"gamma": self.shape}

    def convert(self, name, host):
        return np.ascontiguousarray(host.reshape(self.dim))

    def __call__(self, x, activation=None, prefix=None, rows=None):
        return self.backend.rms_norm(x, self.gamma, self.eps, activation, prefix=prefix, rows=rows)


class ResidualBlock(Module):
    """WanResidualBlock: RMS norm, SiLU, causal 3x3x3 conv, twice, plus a (1x1x1) shortcut."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = self.add("norm1", ChannelRMSNorm(cin, images=False))
        self.conv1 = self.add("conv1", CausalConv3d(cin, cout, 3, padding=1))
        self.norm2 = self.add("norm2", ChannelRMSNorm(cout, images=False))
        self.conv2 = self.add("conv2", CausalConv3d(cout, cout, 3, padding=1))
        self.conv_shortcut = self.add("conv_shortcut", CausalConv3d(cin, cout, 1)) if cin != cout else None

    def __call__(self, x, state):
        # each step rebinds h, so every intermediate dies as soon as the next one exists (a
        # nested call would keep its argument alive until it returned): at most the skip, the
        # cache-joined conv input and the conv output are alive at once
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        if state is None:
            h = self.conv1(self.norm1(x, "silu"))
            return self.conv2(self.norm2(h, "silu"), residual=skip)
        h, lo = self.conv1.with_cache(x, state, self.norm1)
        h = self.conv1.padded(h, lo)
        h, lo = self.conv2.with_cache(h, state, self.norm2)
        return self.conv2.padded(h, lo, residual=skip)


class AttentionBlock(Module):
    """WanAttentionBlock: single-head self-attention within each frame (no time mixing)."""

    def __init__(self, dim: int):
        super().__init__()
        self.dim = dim
        self.norm = self.add("norm", ChannelRMSNorm(dim, images=True))
        self.to_qkv = self.add("to_qkv", Conv2d(dim, 3 * dim, 1))
        self.proj = self.add("proj", Conv2d(dim, dim, 1))

    def __call__(self, x):
        b = self.backend
        n, t, h, w, c = x.shape
        frames = b.reshape(x, (n * t, h, w, c))
        qkv = b.reshape(self.to_qkv(self.norm(frames)), (n * t, h * w, 3 * c))
        shard = row_shard.current()
        if shard is None:
            q, k, v = (b.slice(qkv, -1, i * c, (i + 1) * c) for i in range(3))
        else:
            # this shard's positions of each frame are the queries; every shard's the keys and
            # values (one all-gathered array, rank order = row order = the frame's token order)
            q = b.slice(qkv, -1, 0, c)
            every = b.concat(shard.comm.allgather(b.slice(qkv, -1, c, 3 * c), shard.token_counts(h, w)), axis=1)
            k, v = b.slice(every, -1, 0, c), b.slice(every, -1, c, 2 * c)
        attended = b.reshape(b.attention(q, k, v, scale=1.0 / math.sqrt(c)), (n * t, h, w, c))
        return b.reshape(self.proj(attended, residual=frames), (n, t, h, w, c))


class Resample(Module):
    """WanResample in its decoder modes: 'upsample2d' (nearest x2 in space + 3x3 conv per
    frame) and 'upsample3d' (first a causal (3,1,1) time conv to 2C channels that become two
    frames each, then the same spatial step)."""

    def __init__(self, dim: int, mode: str, out_dim: int | None = None):
        super().__init__()
        if mode not in ("upsample2d", "upsample3d"):
            raise ValueError(f"Resample: decoder modes are upsample2d/upsample3d, got {mode!r}")
        self.dim, self.mode = dim, mode
        self.out_dim = dim // 2 if out_dim is None else out_dim
        self.conv = self.add("resample.1", Conv2d(dim, self.out_dim, 3, padding=1))
        self.time_conv = self.add("time_conv", CausalConv3d(dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0))) \
            if mode == "upsample3d" else None

    def _double_frames(self, x, state: FeatureCache):
        b = self.backend
        prev = state.peek()
        if prev is None:
            # first chunk: diffusers leaves it at one frame and only marks the slot
            state.put(FIRST_CHUNK_SEEN)
            return x
        keep = cache_tail(b, x, prev)
        if keep.shape[1] < CACHE_T and prev is FIRST_CHUNK_SEEN:
            zeros = b.asarray(np.zeros(tuple(keep.shape), np.float32), dtype=b.dtype_of(keep))
            keep = b.concat([zeros, keep], axis=1)
        out = self.time_conv(x, prev if holds_frames(prev) else None)
        state.put(keep)
        n, t, h, w, _ = x.shape
        c = self.dim
        # channel k*C + c of time step t is channel c of output frame 2t + k
        out = b.transpose(b.reshape(out, (n, t, h, w, 2, c)), (0, 1, 4, 2, 3, 5))
        return b.reshape(out, (n, 2 * t, h, w, c))

    def __call__(self, x, state: FeatureCache, residual_for=None):
        """residual_for(above, below), if given, makes what the conv's epilogue adds, as
        upsample_conv2d takes it: frames (N*T', 2H, 2W, out_dim), Wan 2.2's shortcut a
        ShuffledResidual (no separate add pass over the block's largest activation, and on CUDA no
        shuffled copy of it either). above/below: whether the op also computes the rows of a halo
        row from that side (on a row shard; convkernels.sharded_ops.halo_upsample_conv2d)."""
        b = self.backend
        if self.time_conv is not None:
            x = self._double_frames(x, state)
        n, t, h, w, c = x.shape
        frames = b.reshape(x, (n * t, h, w, c))
        shard = row_shard.current()
        if shard is None:
            residual = None if residual_for is None else residual_for(False, False)
            frames = b.upsample_conv2d(frames, self.conv.weight, self.conv.bias, residual=residual)
        else:  # one row of each neighbour, every frame on its own
            frames = halo_upsample_conv2d(b, shard.comm, frames, self.conv.weight, self.conv.bias,
                                          residual_for=residual_for)
        return b.reshape(frames, (n, t, 2 * h, 2 * w, self.out_dim))


class UpBlock(Module):
    """WanUpBlock: num_res_blocks + 1 residual blocks, then an optional upsampler."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, upsample_mode: str | None):
        super().__init__()
        self.resnets = [self.add(f"resnets.{i}", ResidualBlock(cin if i == 0 else cout, cout))
                        for i in range(num_res_blocks + 1)]
        self.upsampler = self.add("upsamplers.0", Resample(cout, upsample_mode)) if upsample_mode else None

    def steps(self) -> list:
        """The layers in order, each called as step(x, state)."""
        return [*self.resnets, *([self.upsampler] if self.upsampler is not None else [])]


class MidBlock(Module):
    """WanMidBlock (num_layers=1): residual, attention, residual."""

    def __init__(self, dim: int):
        super().__init__()
        self.resnets = [self.add(f"resnets.{i}", ResidualBlock(dim, dim)) for i in range(2)]
        self.attention = self.add("attentions.0", AttentionBlock(dim))

    def steps(self) -> list:
        """The layers in order, each called as step(x, state)."""
        return [self.resnets[0], lambda x, state: self.attention(x), self.resnets[1]]


class Decoder3d(Module):
    """WanDecoder3d (Wan 2.1): conv_in, mid block, up blocks, RMS norm + SiLU, conv_out.
    Called once per latent frame with the decode's FeatureCache."""

    def __init__(self, dim: int, z_dim: int, dim_mult, num_res_blocks: int, temperal_upsample,
                 out_channels: int = 3):
        super().__init__()
        dims = [dim * u for u in [dim_mult[-1], *dim_mult[::-1]]]
        self.conv_in = self.add("conv_in", CausalConv3d(z_dim, dims[0], 3, padding=1))
        self.mid_block = self.add("mid_block", MidBlock(dims[0]))
        self.up_blocks = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                cin //= 2  # the previous upsampler halved the channels (Wan 2.1)
            mode = None if i == len(dim_mult) - 1 else "upsample3d" if temperal_upsample[i] else "upsample2d"
            self.up_blocks.append(self.add(f"up_blocks.{i}", UpBlock(cin, cout, num_res_blocks, mode)))
        self.norm_out = self.add("norm_out", ChannelRMSNorm(dims[-1], images=False))
        self.conv_out = self.add("conv_out", CausalConv3d(dims[-1], out_channels, 3, padding=1))

    def __call__(self, x, state: FeatureCache):
        # one flat loop over the blocks' layers: a block called as a whole would keep its
        # input alive (its caller's argument) until its last layer returned
        state.start_chunk()
        x = self.conv_in.cached(x, state)
        for step in self.mid_block.steps() + [s for up in self.up_blocks for s in up.steps()]:
            x = step(x, state)
        x, lo = self.conv_out.with_cache(x, state, self.norm_out)
        return self.conv_out.padded(x, lo)
