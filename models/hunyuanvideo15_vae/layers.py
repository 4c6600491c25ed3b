"""The HunyuanVideo 1.5 VAE decoder's blocks, on backend ops (channels-last: activations N,T,H,W,C).

Every 3x3x3 conv is HunyuanVideo15CausalConv3d: F.pad(..., mode="replicate") of one row and column
on each side and kT - 1 frames in front, then an unpadded Conv3d. Here:
- space: on a row shard the rows above and below are the neighbours' (convkernels.sharded_ops.halo_rows);
  at the image's own top and bottom, and left and right, the edge is replicated (backend.pad).
- time: a decode runs in chunks of latent frames (the first alone), each conv keeping the last
  kT - 1 frames of its (space-padded) input in the chunk's FeatureCache slot; on the first chunk the
  first frame is replicated in front, as diffusers pads the whole clip. The cached frames carry the
  halo rows they were given, so no second exchange is needed for them (as the Wan decoder).
Upsample (HunyuanVideo15Upsample): conv to factor x out channels plus x's channels repeated, both
moved to space (and time) in diffusers' order; here the conv's output channels are reordered at load
to backend.pixel_shuffle's order (c * factor + offset) and the shortcut is a 0/1 channel selection
(row-local) added in the conv's epilogue, so one pixel_shuffle finishes both. A temporal upsampler's
first frame gives one frame from half of the channels (every other one in our order: a strided
slice of the weight) and repeats x half as often. conv_in adds the latents repeated the same way.
The mid-block attention (HunyuanVideo15AttnBlock) is single-head over every position of every frame
with a frame-causal mask: a query of frame f sees the keys of frames 0..f. It runs one query frame
at a time against the keys and values of the frames up to it, which the attention keeps (all frames
so far, in its cache slot: O(frames) memory at latent resolution) so chunks stream; on a row shard
the keys and values of each chunk are all-gathered (rank order = row order = token order).
RMS norms (F.normalize over channels * sqrt(C) * gamma) and 1x1x1 convs are row-local.
"""
from __future__ import annotations

import math

import numpy as np

from convkernels.sharded_ops import halo_rows

from ..nn import interrupt, row_shard
from ..nn.layers import Conv, Linear
from ..nn.module import Module
from ..wan_vae.layers import ChannelRMSNorm, FeatureCache


class Conv1x1x1(Linear):
    """A 1x1x1 Conv3d's checkpoint weight (O, I, 1, 1, 1) run as a Linear over the channels."""

    def param_shapes(self):
        return {"weight": (self.cout, self.cin, 1, 1, 1), "bias": (self.cout,)}

    def convert(self, name, host):
        return host.reshape(host.shape[:2]) if name == "weight" else host


class _Weights(Conv):
    """The nn.Conv3d inside HunyuanVideo15CausalConv3d (`<name>.conv.weight`); `order` reorders
    its output channels at load."""

    def __init__(self, cin: int, cout: int, k: int, order: np.ndarray | None = None):
        super().__init__(cin, cout, (k, k, k))
        self.order = order

    def convert(self, name, host):
        host = np.asarray(host, np.float32)
        return super().convert(name, host if self.order is None else host[self.order])


class CausalConv3d(Module):
    """HunyuanVideo15CausalConv3d (replicate padding in time and space), chunked with a cache."""

    def __init__(self, cin: int, cout: int, k: int = 3, order: np.ndarray | None = None):
        super().__init__()
        self.k = k
        self.conv = self.add("conv", _Weights(cin, cout, k, order))

    def _padded(self, x, frames: int):
        """x with its rows and columns replicate-padded (on a row shard, the neighbours' halo rows
        between), and `frames` copies of its first frame in front: one pad, one copy."""
        b, p = self.backend, self.k // 2
        if not p and not frames:
            return x
        top = bottom = p
        shard = row_shard.current()
        if shard is not None and p:
            (above, below), (top, bottom) = halo_rows(b, shard.comm, x, p, axis=2)
            if above is not None or below is not None:
                x = b.concat([r for r in (above, x, below) if r is not None], axis=2)
        return b.pad(x, ((frames, 0), (top, bottom), (p, p)), mode="replicate")

    def __call__(self, x, state: FeatureCache, weight=None, bias=None, residual=None):
        """One chunk (N, t, H, W, C) -> (N, t, H, W, cout); weight/bias replace the conv's own
        (the upsampler's first frame)."""
        b, lo = self.backend, self.k - 1
        prev = state.peek() if lo else None
        # the clip's first frame is replicated in front (diffusers pads so), in the same pad as space
        x = self._padded(x, lo if lo and prev is None else 0)
        if lo:
            if prev is not None:
                state.release()
                x = b.concat([prev, x], axis=1)
                del prev
            t = x.shape[1]
            state.put(b.concat([b.slice(x, 1, t - lo, t)], axis=1))  # an own copy, not a view of x
        return b.conv3d(x, self.conv.weight if weight is None else weight,
                        self.conv.bias if bias is None else bias, residual=residual)


def _selection(backend, rows: int, cin: int, source: np.ndarray):
    """A 0/1 (rows, cin) matrix picking input channel source[r] for output channel r."""
    select = np.zeros((rows, cin), np.float32)
    select[np.arange(rows), source] = 1.0
    return backend.asarray(select)


class ResnetBlock(Module):
    """HunyuanVideo15ResnetBlock: RMS norm, SiLU, causal conv, twice, plus the (1x1x1) shortcut."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.norm1 = self.add("norm1", ChannelRMSNorm(cin, images=False))
        self.conv1 = self.add("conv1", CausalConv3d(cin, cout))
        self.norm2 = self.add("norm2", ChannelRMSNorm(cout, images=False))
        self.conv2 = self.add("conv2", CausalConv3d(cout, cout))
        self.conv_shortcut = self.add("conv_shortcut", Conv1x1x1(cin, cout)) if cin != cout else None

    def __call__(self, x, state):
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        h = self.conv1(self.norm1(x, "silu"), state)
        return self.conv2(self.norm2(h, "silu"), state, residual=skip)


class AttnBlock(Module):
    """HunyuanVideo15AttnBlock: the frame-causal attention (the module docstring says how)."""

    def __init__(self, channels: int):
        super().__init__()
        self.channels = channels
        self.norm = self.add("norm", ChannelRMSNorm(channels, images=False))
        self.to_q = self.add("to_q", Conv1x1x1(channels, channels))
        self.to_k = self.add("to_k", Conv1x1x1(channels, channels))
        self.to_v = self.add("to_v", Conv1x1x1(channels, channels))
        self.proj_out = self.add("proj_out", Conv1x1x1(channels, channels))

    def __call__(self, x, state: FeatureCache):
        b, c = self.backend, self.channels
        n, t, h, w, _ = x.shape
        normed = self.norm(x)
        q = b.reshape(self.to_q(normed), (n, t, h * w, c))
        kv = b.reshape(b.concat([self.to_k(normed), self.to_v(normed)], axis=-1), (n * t, h * w, 2 * c))
        del normed
        shard = row_shard.current()
        if shard is not None:  # every shard's positions of each frame, in row order
            kv = b.concat(shard.comm.allgather(kv, shard.token_counts(h, w)), axis=1)
        kv = b.reshape(kv, (n, t, kv.shape[1], 2 * c))
        prev = state.peek()
        seen = 0 if prev is None else prev.shape[1]
        if prev is not None:
            state.release()
            kv = b.concat([prev, kv], axis=1)
            del prev
        state.put(kv)
        tokens = kv.shape[2]
        outs = []
        for i in range(t):  # query frame seen + i sees the frames up to it
            upto = b.reshape(b.slice(kv, 1, 0, seen + i + 1), (n, (seen + i + 1) * tokens, 2 * c))
            query = b.reshape(b.slice(q, 1, i, i + 1), (n, h * w, c))
            outs.append(b.attention(query, b.slice(upto, -1, 0, c), b.slice(upto, -1, c, 2 * c),
                                    scale=1.0 / math.sqrt(c)))
        attended = b.reshape(outs[0] if t == 1 else b.concat(outs, axis=1), (n, t, h, w, c))
        return self.proj_out(attended, residual=x)


class Upsample(Module):
    """HunyuanVideo15Upsample: (N, t, H, W, cin) -> (N, 2t, 2H, 2W, cout) (temporal; the clip's
    first frame gives one) or (N, t, 2H, 2W, cout)."""

    def __init__(self, cin: int, cout: int, temporal: bool):
        super().__init__()
        self.cin, self.cout, self.temporal = cin, cout, temporal
        self.factor = 8 if temporal else 4
        packed = self.factor * cout
        self.repeats = packed // cin
        # ours c * factor + r <- diffusers' r * cout + c (r: the offset in time, rows, columns)
        order = np.arange(packed).reshape(self.factor, cout).T.reshape(-1)
        self.conv = self.add("conv", CausalConv3d(cin, packed, 3, order=order))
        self.select = self.first_weight = self.first_bias = self.first_select = None

    def derive(self, tensors, prefix) -> None:
        b, f, c = self.backend, self.factor, self.cout
        co, r = np.divmod(np.arange(f * c), f)
        if self.temporal:  # diffusers: x rearranged to cin / 8 channels, then repeated
            self.select = _selection(b, f * c, self.cin, r * (self.cin // 8) + co // self.repeats)
            # the first frame: diffusers' channels r2 * 2c + c (r2 over rows and columns) = ours c * 8 + 2 * r2
            w, bias = self.conv.conv.weight, self.conv.conv.bias
            self.first_weight = b.concat([b.slice(w, 0, 0, f * c, 2)], axis=0)
            self.first_bias = b.concat([b.slice(bias, 0, 0, f * c, 2)], axis=0)
            co4, r4 = np.divmod(np.arange(4 * c), 4)
            self.first_select = _selection(b, 4 * c, self.cin, r4 * (self.cin // 4) + co4 // (self.repeats // 2))
        else:  # diffusers: x repeated, then rearranged
            self.select = _selection(b, f * c, self.cin, (r * c + co) // self.repeats)

    def __call__(self, x, state: FeatureCache):
        b = self.backend
        if self.temporal and state.peek() is None:  # the clip's first frame (a chunk of its own)
            h = self.conv(x, state, self.first_weight, self.first_bias, residual=b.linear(x, self.first_select))
            return b.pixel_shuffle(h, (1, 2, 2))
        h = self.conv(x, state, residual=b.linear(x, self.select))
        return b.pixel_shuffle(h, (2, 2, 2) if self.temporal else (1, 2, 2))


class MidBlock(Module):
    """HunyuanVideo15MidBlock(num_layers=1): resnet, attention, resnet."""

    def __init__(self, channels: int):
        super().__init__()
        self.resnets = [self.add(f"resnets.{i}", ResnetBlock(channels, channels)) for i in range(2)]
        self.attention = self.add("attentions.0", AttnBlock(channels))

    def steps(self) -> list:
        return [self.resnets[0], self.attention, self.resnets[1]]


class Decoder(Module):
    """HunyuanVideo15Decoder3D, called once per chunk of latent frames with the decode's
    FeatureCache (the first chunk is the first frame alone); conv_out's output is x / 2 + 0.5 once
    the model folds it in."""

    def __init__(self, cfg):
        super().__init__()
        levels = cfg.decoder_levels()
        width, z = levels[0][0], cfg.latent_channels
        self.conv_in = self.add("conv_in", CausalConv3d(z, width))
        self.mid_block = self.add("mid_block", MidBlock(width))
        self.blocks = []
        for i, (cin, ch, up, temporal) in enumerate(levels):
            for j in range(cfg.layers_per_block + 1):
                self.blocks.append(self.add(f"up_blocks.{i}.resnets.{j}", ResnetBlock(cin if j == 0 else ch, ch)))
            if up is not None:
                self.blocks.append(self.add(f"up_blocks.{i}.upsamplers.0", Upsample(ch, up, temporal)))
        self.norm_out = self.add("norm_out", ChannelRMSNorm(levels[-1][1], images=False))
        self.conv_out = self.add("conv_out", CausalConv3d(levels[-1][1], cfg.out_channels))
        self.width, self.latents = width, z
        self.repeat_in = None

    def derive(self, tensors, prefix) -> None:
        # conv_in(z) + z.repeat_interleave(width / latents) over the channels
        self.repeat_in = _selection(self.backend, self.width, self.latents,
                                    np.arange(self.width) // (self.width // self.latents))

    def __call__(self, z, state: FeatureCache):
        b = self.backend
        state.start_chunk()
        x = self.conv_in(z, state, residual=b.linear(z, self.repeat_in))
        for step in self.mid_block.steps() + self.blocks:
            interrupt.check()  # an untiled decode nobody waits for stops between blocks
            x = step(x, state)
        return self.conv_out(self.norm_out(x, "silu"), state)
