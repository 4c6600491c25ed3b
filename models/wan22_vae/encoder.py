"""The Wan 2.2 VAE encoder's own blocks (diffusers `WanEncoder3d` with `is_residual=True`): patchify
of the input, the parameter-free AvgDown3D shortcut, the residual down block built on it, and the
encoder made of those blocks. Everything else (causal convs with their FeatureCache, RMS norms,
resnets, the mid block, the downsamplers and their time convs, quant_conv) is the Wan 2.1
encoder's, models/wan_vae/encoder.py.

Activations are channels-last (N, T, H, W, C); patchify and the shortcuts are a reshape, one
transpose and (AvgDown3D) a mean on the backend, no per-element loops.
"""
from __future__ import annotations

from ..nn.module import Module
from ..wan_vae.encoder import Downsample, Encoder3d
from ..wan_vae.layers import FeatureCache, ResidualBlock


def patchify(backend, x, patch: int):
    """diffusers' patchify, channels-last: (N, T, H, W, C) -> (N, T, H/p, W/p, C*p*p). Pixel (row
    H*p + b, column W*p + a) lands on channel c*p*p + a*p + b: the column offset is the first patch
    index, as diffusers' permute (0, 1, 6, 4, 2, 3, 5) has it (wan22_vae_layers.unpatchify's inverse)."""
    if patch == 1:
        return x
    b = backend
    n, t, h, w, c = x.shape
    x = b.reshape(x, (n, t, h // patch, patch, w // patch, patch, c))
    x = b.transpose(x, (0, 1, 2, 4, 6, 5, 3))
    return b.reshape(x, (n, t, h // patch, w // patch, c * patch * patch))


def avg_down(backend, x, out_channels: int, factor_t: int, factor_s: int):
    """AvgDown3D: (N, T, H, W, Cin) -> (N, ceil(T/ft), H/fs, W/fs, Cout). The input's frames are
    first padded at the front with zero frames to a multiple of ft (so a lone first frame is
    averaged with a zero one, as diffusers does); then each input channel c, read with its
    (ft, fs, fs) block of offsets, becomes channels c*factor .. c*factor + factor - 1, and each
    output channel is the mean of `group` consecutive ones of those."""
    b = backend
    factor = factor_t * factor_s * factor_s
    n, t, h, w, cin = x.shape
    if (cin * factor) % out_channels:
        raise ValueError(f"AvgDown3D: {cin} channels x {factor} is not a multiple of {out_channels}")
    if h % factor_s or w % factor_s:
        raise ValueError(f"AvgDown3D: {h}x{w} is not a multiple of the {factor_s}x{factor_s} step")
    pad_t = -t % factor_t
    if pad_t:
        x = b.pad(x, ((pad_t, 0), (0, 0), (0, 0)))
        t += pad_t
    x = b.reshape(x, (n, t // factor_t, factor_t, h // factor_s, factor_s, w // factor_s, factor_s, cin))
    x = b.transpose(x, (0, 1, 3, 5, 7, 2, 4, 6))
    group = cin * factor // out_channels
    x = b.reshape(x, (n, t // factor_t, h // factor_s, w // factor_s, out_channels, group))
    return b.mean(x, -1) if group > 1 else b.reshape(x, x.shape[:-1])


class ResidualDownBlock(Module):
    """WanResidualDownBlock: num_res_blocks resnets, an optional downsampler (`downsampler`, not Wan
    2.1's flat `down_blocks.k`), plus the AvgDown3D shortcut of the block's input."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, temperal_downsample: bool, down_flag: bool):
        super().__init__()
        self.cout = cout
        self.factor_t = 2 if temperal_downsample else 1
        self.factor_s = 2 if down_flag else 1
        self.resnets = [self.add(f"resnets.{i}", ResidualBlock(cin if i == 0 else cout, cout))
                        for i in range(num_res_blocks)]
        self.downsampler = None
        if down_flag:
            mode = "downsample3d" if temperal_downsample else "downsample2d"
            self.downsampler = self.add("downsampler", Downsample(cout, mode))

    def __call__(self, x, state: FeatureCache | None):
        skip = x
        for resnet in self.resnets:
            x = resnet(x, state)
        if self.downsampler is not None:
            x = self.downsampler(x, state)
        short = avg_down(self.backend, skip, self.cout, self.factor_t, self.factor_s)
        del skip
        return self.backend.add(x, short)


class ResidualEncoder3d(Encoder3d):
    """WanEncoder3d with is_residual=True (Wan 2.2): Wan 2.1's encoder with one residual down block
    per level (no attention scales: diffusers' residual path has none). Its input is the patchified
    video (3 * patch^2 channels)."""

    @staticmethod
    def make_down_blocks(dims, num_res_blocks: int, temperal_downsample) -> list:
        last = len(dims) - 2
        return [ResidualDownBlock(cin, cout, num_res_blocks, bool(temperal_downsample[i]) if i != last else False,
                                  down_flag=i != last)
                for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:]))]
