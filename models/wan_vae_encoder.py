"""The Wan 2.1 VAE encoder on one frame (an image): diffusers' WanEncoder3d + quant_conv as its first
chunk runs them, which is all an image VAE built on it (Qwen-Image) needs.

On a lone first frame every causal conv sees only zero padding before it (CausalConv3d's lone-frame
path) and the temporal downsamplers' time convs do not run (diffusers only caches that frame for the
next chunk), so `downsample3d` is `downsample2d` here: ZeroPad2d (0, 1, 0, 1) + a 3x3 stride-2 conv per
frame. The time convs' weights are still loaded, so a checkpoint is checked whole. Channels-last as the
decoder: activations N,T,H,W,C with T == 1.
"""
from __future__ import annotations

from .layers import Conv2d
from .module import Module
from .wan_vae_layers import CausalConv3d, ChannelRMSNorm, MidBlock, ResidualBlock


class Downsample(Module):
    """WanResample in an encoder mode ('downsample2d' / 'downsample3d') on the first chunk."""

    def __init__(self, dim: int, mode: str):
        super().__init__()
        if mode not in ("downsample2d", "downsample3d"):
            raise ValueError(f"Downsample: encoder modes are downsample2d/downsample3d, got {mode!r}")
        self.dim = dim
        self.conv = self.add("resample.1", Conv2d(dim, dim, 3, stride=2, padding=((0, 1), (0, 1))))
        # (3, 1, 1) with stride 2 in time: from the second chunk on only, never for an image
        self.time_conv = self.add("time_conv", CausalConv3d(dim, dim, (3, 1, 1))) if mode == "downsample3d" else None

    def __call__(self, x, state=None):
        b = self.backend
        n, t, h, w, c = x.shape
        frames = self.conv(b.reshape(x, (n * t, h, w, c)))
        return b.reshape(frames, (n, t, *frames.shape[1:3], c))


class Encoder3d(Module):
    """WanEncoder3d (Wan 2.1, no attention scales): conv_in, a flat list of down blocks (resnets and
    downsamplers), mid block, RMS norm + SiLU, conv_out to 2 * z_dim channels (mean, log-variance)."""

    def __init__(self, dim: int, z_dim: int, dim_mult, num_res_blocks: int, temperal_downsample,
                 in_channels: int = 3):
        super().__init__()
        dims = [dim * u for u in [1, *dim_mult]]
        self.conv_in = self.add("conv_in", CausalConv3d(in_channels, dims[0], 3, padding=1))
        self.down_blocks: list = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            for _ in range(num_res_blocks):
                self.down_blocks.append(self.add(f"down_blocks.{len(self.down_blocks)}", ResidualBlock(cin, cout)))
                cin = cout
            if i != len(dim_mult) - 1:
                mode = "downsample3d" if temperal_downsample[i] else "downsample2d"
                self.down_blocks.append(self.add(f"down_blocks.{len(self.down_blocks)}", Downsample(cout, mode)))
        self.mid_block = self.add("mid_block", MidBlock(dims[-1]))
        self.norm_out = self.add("norm_out", ChannelRMSNorm(dims[-1], images=False))
        self.conv_out = self.add("conv_out", CausalConv3d(dims[-1], 2 * z_dim, 3, padding=1))

    def __call__(self, x):
        x = self.conv_in(x)
        for step in self.down_blocks + self.mid_block.steps():
            x = step(x, None)
        return self.conv_out(self.norm_out(x, "silu"))


class EncoderTree(Module):
    """The checkpoint's encoder side: the encoder and quant_conv (1x1x1)."""

    def __init__(self, base_dim: int, z_dim: int, dim_mult, num_res_blocks: int, temperal_downsample,
                 in_channels: int = 3):
        super().__init__()
        self.encoder = self.add("encoder", Encoder3d(base_dim, z_dim, dim_mult, num_res_blocks, temperal_downsample,
                                                     in_channels))
        self.quant_conv = self.add("quant_conv", CausalConv3d(2 * z_dim, 2 * z_dim, 1))

    def __call__(self, x):
        """Images N,1,H,W,C in [-1, 1] -> N,1,h,w,2z (the posterior's mean, then its log-variance)."""
        return self.quant_conv(self.encoder(x))
