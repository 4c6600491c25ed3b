"""The Wan VAE encoder: diffusers' WanEncoder3d + quant_conv, on one frame (an image, all an image
VAE built on it, Qwen-Image, needs) or chunked and causal with a FeatureCache as diffusers' `_encode`
runs a video (1 frame, then 4 per chunk; the Wan 2.2 encoder, models/wan22_vae/encoder.py, does).

On a lone first frame every causal conv sees only zero padding before it (CausalConv3d's lone-frame
path) and the temporal downsamplers' time convs do not run (diffusers only caches that frame for the
next chunk), so `downsample3d` is `downsample2d` there: ZeroPad2d (0, 1, 0, 1) + a 3x3 stride-2 conv per
frame. From the second chunk on, the time conv (3, 1, 1), stride 2 in time, runs over the previous
chunk's last frame and this chunk's. Channels-last as the decoder: activations N,T,H,W,C.
"""
from __future__ import annotations

from ..nn.layers import Conv2d
from ..nn.module import Module
from .layers import CausalConv3d, ChannelRMSNorm, FeatureCache, MidBlock, ResidualBlock


class Downsample(Module):
    """WanResample in an encoder mode ('downsample2d' / 'downsample3d'). Without a FeatureCache (or on
    the first chunk) no time conv runs; with one, downsample3d halves later chunks' frames."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        if mode not in ("downsample2d", "downsample3d"):
            raise ValueError(f"Downsample: encoder modes are downsample2d/downsample3d, got {mode!r}")
        self.dim = dim
        self.conv = self.add("resample.1", Conv2d(dim, dim, 3, stride=2, padding=((0, 1), (0, 1))))
        # (3, 1, 1) with stride 2 in time: from the second chunk on only, never for an image
        self.time_conv = self.add("time_conv", CausalConv3d(dim, dim, (3, 1, 1))) if mode == "downsample3d" else None

    def __call__(self, x, state: FeatureCache | None = None):
        b = self.backend
        n, t, h, w, c = x.shape
        frames = self.conv(b.reshape(x, (n * t, h, w, c)))
        x = b.reshape(frames, (n, t, *frames.shape[1:3], c))
        if self.time_conv is None or state is None:
            return x
        return self._halve_frames(x, state)

    def _halve_frames(self, x, state: FeatureCache):
        """diffusers' downsample3d with its cache: the first chunk passes through and leaves its last
        frame; later chunks are joined to the last frame before them and convolved (3, 1, 1) with
        stride 2 and no padding, 1 + 4 frames -> 2, 1 + 2 -> 1."""
        b = self.backend
        prev = state.peek()
        t = x.shape[1]
        # an own copy: a slice would keep the whole chunk alive while it sits in the cache
        last = b.concat([b.slice(x, 1, t - 1, t)], axis=1)
        if prev is not None:
            x = b.conv3d(b.concat([prev, x], axis=1), self.time_conv.weight, self.time_conv.bias,
                         stride=(2, 1, 1))
        state.put(last)
        return x


class Encoder3d(Module):
    """WanEncoder3d (Wan 2.1, no attention scales): conv_in, a flat list of down blocks (resnets and
    downsamplers), mid block, RMS norm + SiLU, conv_out to 2 * z_dim channels (mean, log-variance).
    Called on one frame without a cache, or once per chunk with the encode's FeatureCache."""

    def __init__(self, dim: int, z_dim: int, dim_mult, num_res_blocks: int, temperal_downsample,
                 in_channels: int = 3):
        super().__init__()
        dims = [dim * u for u in [1, *dim_mult]]
        self.conv_in = self.add("conv_in", CausalConv3d(in_channels, dims[0], 3, padding=1))
        self.down_blocks = [self.add(f"down_blocks.{i}", block) for i, block in
                            enumerate(self.make_down_blocks(dims, num_res_blocks, temperal_downsample))]
        self.mid_block = self.add("mid_block", MidBlock(dims[-1]))
        self.norm_out = self.add("norm_out", ChannelRMSNorm(dims[-1], images=False))
        self.conv_out = self.add("conv_out", CausalConv3d(dims[-1], 2 * z_dim, 3, padding=1))

    @staticmethod
    def make_down_blocks(dims, num_res_blocks: int, temperal_downsample) -> list:
        """Wan 2.1's flat list: each level's resnets, then its downsampler (none after the last)."""
        blocks: list = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(num_res_blocks):
                blocks.append(ResidualBlock(cin, cout))
                cin = cout
            if i != len(dims) - 2:
                blocks.append(Downsample(cout, "downsample3d" if temperal_downsample[i] else "downsample2d"))
        return blocks

    def __call__(self, x, state: FeatureCache | None = None):
        # one flat loop, as the decoder's: every intermediate dies as soon as the next one exists
        if state is not None:
            state.start_chunk()
        x = self.conv_in.cached(x, state)
        for step in self.down_blocks + self.mid_block.steps():
            x = step(x, state)
        if state is None:
            return self.conv_out(self.norm_out(x, "silu"))
        x, lo = self.conv_out.with_cache(x, state, self.norm_out)
        return self.conv_out.padded(x, lo)


class EncoderTree(Module):
    """The checkpoint's encoder side: the encoder (`encoder_class`: Wan 2.1's, or Wan 2.2's residual
    one) and quant_conv (1x1x1)."""

    prepared_at_load = False  # transformed on the first encode (models/nn/module.py)

    def __init__(self, base_dim: int, z_dim: int, dim_mult, num_res_blocks: int, temperal_downsample,
                 in_channels: int = 3, encoder_class: type[Encoder3d] = Encoder3d):
        super().__init__()
        self.encoder = self.add("encoder", encoder_class(base_dim, z_dim, dim_mult, num_res_blocks,
                                                         temperal_downsample, in_channels))
        self.quant_conv = self.add("quant_conv", CausalConv3d(2 * z_dim, 2 * z_dim, 1))

    def __call__(self, x, state: FeatureCache | None = None):
        """Frames N,T,H,W,C in [-1, 1] (one frame, or a chunk with `state`) -> N,t,h,w,2z (the
        posterior's mean, then its log-variance)."""
        return self.quant_conv(self.encoder(x, state))
