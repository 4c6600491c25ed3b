"""The HunyuanVideo 1.5 VAE encoder (diffusers HunyuanVideo15Encoder3D), on backend ops, channels-last
(activations N,T,H,W,C). It mirrors the decoder (layers.py): the same replicate-padded causal convs with
their chunk cache, RMS norms, resnets and frame-causal mid-block attention; what it adds is here.

Downsample (HunyuanVideo15Downsample): a conv to cout / factor channels whose output moves its
(time,) rows and columns into channels, plus a shortcut that moves x the same way and averages
groups of consecutive channels down to cout. diffusers packs a block of offsets as channel
offset * C + c (offset = (t * 2 + row) * 2 + column), which here is one reshape and one transpose;
the group mean is a reshape and a mean. A temporal downsampler treats the clip's first frame apart:
the conv's first frame is packed over space only (cout / 2 channels) and taken twice, and the
shortcut averages groups half as large. The encode runs in chunks (the first frame alone, then
temporal_factor frames), so a chunk's frames after the first always pair up at every temporal level,
and the first chunk is the only one whose conv cache slot is empty.
The encoder's output adds the mid block's output averaged over groups of channels (block_out_channels[-1]
/ 2 latent_channels) to conv_out's, in conv_out's epilogue.
"""
from __future__ import annotations

from ..nn.module import Module
from ..wan_vae.layers import ChannelRMSNorm, FeatureCache
from .layers import CausalConv3d, MidBlock, ResnetBlock


def packed(backend, x, r1: int):
    """diffusers' _dcae_downsample_rearrange, channels-last: (N, T, H, W, C) -> (N, T/r1, H/2, W/2,
    r1*2*2*C), the offset (time, row, column) major, the channel minor."""
    b = backend
    n, t, h, w, c = x.shape
    x = b.reshape(x, (n, t // r1, r1, h // 2, 2, w // 2, 2, c))
    x = b.transpose(x, (0, 1, 3, 5, 2, 4, 6, 7))
    return b.reshape(x, (n, t // r1, h // 2, w // 2, r1 * 4 * c))


def group_mean(backend, x, channels: int):
    """(..., channels * g) -> (..., channels): the mean of each run of g consecutive channels
    (diffusers' view(B, channels, g, ...).mean(dim=2))."""
    b = backend
    group = x.shape[-1] // channels
    if group == 1:
        return x
    return b.mean(b.reshape(x, (*x.shape[:-1], channels, group)), -1)


class Downsample(Module):
    """HunyuanVideo15Downsample: (N, t, H, W, cin) -> (N, t/2, H/2, W/2, cout) (temporal; the clip's
    first frame gives one) or (N, t, H/2, W/2, cout)."""

    def __init__(self, cin: int, cout: int, temporal: bool):
        super().__init__()
        self.cout, self.temporal = cout, temporal
        self.conv = self.add("conv", CausalConv3d(cin, cout // (8 if temporal else 4)))

    def __call__(self, x, state: FeatureCache):
        b = self.backend
        first = self.temporal and state.peek() is None  # the clip's first frame (a chunk of its own)
        h = self.conv(x, state)
        if first:
            h = packed(b, h, 1)
            return b.add(b.concat([h, h], axis=-1), group_mean(b, packed(b, x, 1), self.cout))
        r1 = 2 if self.temporal else 1
        return b.add(packed(b, h, r1), group_mean(b, packed(b, x, r1), self.cout))


class Encoder(Module):
    """HunyuanVideo15Encoder3D, called once per chunk of frames (the first frame alone, then
    temporal_factor frames) with the encode's FeatureCache; gives 2 * latent_channels channels
    (the posterior's mean, then its log-variance)."""

    prepared_at_load = False  # transformed on the first encode (models/nn/module.py)

    def __init__(self, cfg):
        super().__init__()
        widths = list(cfg.block_out_channels)
        self.conv_in = self.add("conv_in", CausalConv3d(cfg.in_channels, widths[0]))
        self.blocks = []
        for i, (cin, ch, down, temporal) in enumerate(cfg.encoder_levels()):
            for j in range(cfg.layers_per_block):
                self.blocks.append(self.add(f"down_blocks.{i}.resnets.{j}", ResnetBlock(cin if j == 0 else ch, ch)))
            if down is not None:
                self.blocks.append(self.add(f"down_blocks.{i}.downsamplers.0", Downsample(ch, down, temporal)))
        self.mid_block = self.add("mid_block", MidBlock(widths[-1]))
        self.norm_out = self.add("norm_out", ChannelRMSNorm(widths[-1], images=False))
        self.out_channels = 2 * cfg.latent_channels
        self.conv_out = self.add("conv_out", CausalConv3d(widths[-1], self.out_channels))

    def __call__(self, x, state: FeatureCache):
        state.start_chunk()
        x = self.conv_in(x, state)
        for step in self.blocks + self.mid_block.steps():
            x = step(x, state)
        short = group_mean(self.backend, x, self.out_channels)
        return self.conv_out(self.norm_out(x, "silu"), state, residual=short)
