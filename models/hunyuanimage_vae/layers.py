"""The HunyuanImage 2.1 VAE's own blocks, on models/nn layers (channels-last activations).

Its resamplers move channels to space (and back) with a parameter-free shortcut beside the conv:
- Upsample: conv(x) to 4 * out channels and x repeated channel by channel (repeat_interleave) to
  as many, both shuffled to 2x the size with the block of 4 outside the channels (channel
  r * out + c lands at offset r = 2 * dy + dx). The shortcut is a 0/1 selection of x's channels
  (row-local), added in the conv's epilogue, and the conv's output channels are reordered at
  load to torch's pixel_shuffle order (c * 4 + r): one shard-aware conv, then
  backend.pixel_shuffle, which is row-local too (a band's rows double with it).
- The decoder's conv_in adds x repeated to its width the same way.
- Downsample (encoder only): conv to out / 4 channels, space-to-depth with the same order, plus the
  space-to-depth of x averaged over groups of channels. Both are one 4x4 stride-2 conv, padding 1:
  output (r, c) at y reads input rows 2y + dy - 1 .. 2y + dy + 1 (kernel rows dy .. dy + 2).
The attention is SpatialAttention with 1x1 convs for projections and diffusers' names
(`norm`, `to_q`, `to_k`, `to_v`, `proj`).
"""
from __future__ import annotations

import numpy as np

from ..nn import interrupt
from ..nn.layers import Conv2d, GroupNorm, Linear, ResnetBlock2D, SpatialAttention
from ..nn.module import Module
from ..nn.weights import conv_weight_to_channels_last
from .config import GROUPS, NORM_EPS


def _shuffle_order(channels: int) -> np.ndarray:
    """Ours (torch pixel_shuffle order, c * 4 + r) -> diffusers' (r * channels + c)."""
    return np.arange(4 * channels).reshape(4, channels).T.reshape(-1)


class ShortcutConv(Conv2d):
    """A 3x3 'same' conv plus x with each channel repeated `repeats` times (repeat_interleave);
    `shuffle`: output channels reordered for backend.pixel_shuffle. The shortcut is a 0/1 channel
    selection (a Linear, row-local) added in the conv's epilogue: exact in any dtype, where
    folding it into the centre tap would round 1 + w to a half-precision weight."""

    def __init__(self, cin: int, cout: int, repeats: int, shuffle: bool = False):
        super().__init__(cin, cout, 3, padding=1)
        self.repeats, self.shuffle = repeats, shuffle
        self.select = None

    def _order(self) -> np.ndarray:
        return _shuffle_order(self.cout // 4) if self.shuffle else np.arange(self.cout)

    def convert(self, name, host):
        return super().convert(name, np.asarray(host, np.float32)[self._order()])

    def derive(self, tensors, prefix) -> None:
        select = np.zeros((self.cout, self.cin), np.float32)
        select[np.arange(self.cout), self._order() // self.repeats] = 1.0
        self.select = self.backend.asarray(select)

    def __call__(self, x, residual=None, activation=None):
        return super().__call__(x, residual=self.backend.linear(x, self.select))


class Upsample(Module):
    """HunyuanImageUpsample: (N, H, W, cin) -> (N, 2H, 2W, cout)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = self.add("conv", ShortcutConv(cin, 4 * cout, 4 * cout // cin, shuffle=True))

    def __call__(self, x):
        return self.backend.pixel_shuffle(self.conv(x), (2, 2))


class DownsampleConv(Conv2d):
    """HunyuanImageDownsample's `conv` (checkpoint: 3x3, cin -> cout / 4) with the space-to-depth
    and the averaged shortcut, run as one 4x4 stride-2 conv (the module docstring says how)."""

    def __init__(self, cin: int, cout: int):
        super().__init__(cin, cout // 4, 3, padding=1)
        self.out, self.group = cout, 4 * cin // cout

    def convert(self, name, host):
        host = np.asarray(host, np.float32)
        c = self.cout
        if name == "bias":
            return np.tile(host, 4)
        w = np.zeros((self.out, self.cin, 4, 4), np.float32)
        for r in range(4):
            dy, dx = divmod(r, 2)
            w[r * c:(r + 1) * c, :, dy:dy + 3, dx:dx + 3] = host
        for k in range(self.out):  # output k averages space-to-depth channels k * group ..
            for idx in range(k * self.group, (k + 1) * self.group):
                r, ci = divmod(idx, self.cin)
                w[k, ci, 1 + r // 2, 1 + r % 2] += np.float32(1.0 / self.group)
        return conv_weight_to_channels_last(w)

    def __call__(self, x):
        return self.backend.conv2d(x, self.weight, self.bias, stride=2, padding=1)


class Downsample(Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.conv = self.add("conv", DownsampleConv(cin, cout))

    def __call__(self, x):
        return self.conv(x)


class Conv1x1(Linear):
    """A 1x1 Conv2d's checkpoint weight (O, I, 1, 1) run as a Linear over the channels."""

    def param_shapes(self):
        return {"weight": (self.cout, self.cin, 1, 1), "bias": (self.cout,)}

    def convert(self, name, host):
        return host.reshape(host.shape[:2]) if name == "weight" else host


class Attention(SpatialAttention):
    """HunyuanImageAttentionBlock: single-head self-attention, residual added (SpatialAttention's
    forward, shard-aware), under diffusers' names for this class."""

    def __init__(self, channels: int):
        Module.__init__(self)
        self.channels = channels
        self.group_norm = self.add("norm", GroupNorm(GROUPS, channels, NORM_EPS))
        self.to_q = self.add("to_q", Conv1x1(channels, channels))
        self.to_k = self.add("to_k", Conv1x1(channels, channels))
        self.to_v = self.add("to_v", Conv1x1(channels, channels))
        self.proj = self.add("proj", Conv1x1(channels, channels))


def resnet(channels: int) -> ResnetBlock2D:
    """HunyuanImageResnetBlock of one width (the config refuses the width-changing one)."""
    return ResnetBlock2D(channels, channels, GROUPS, NORM_EPS)


class MidBlock(Module):
    """HunyuanImageMidBlock(num_layers=1): resnet, attention, resnet."""

    def __init__(self, channels: int):
        super().__init__()
        self.resnets = [self.add(f"resnets.{i}", resnet(channels)) for i in range(2)]
        self.attention = self.add("attentions.0", Attention(channels))

    def __call__(self, x):
        return self.resnets[1](self.attention(self.resnets[0](x)))


class Decoder(Module):
    """HunyuanImageDecoder2D; conv_out's output is x / 2 + 0.5 once the model folds it in."""

    def __init__(self, cfg):
        super().__init__()
        levels = cfg.decoder_levels()
        width = levels[0][1]
        self.conv_in = self.add("conv_in", ShortcutConv(cfg.latent_channels, width, width // cfg.latent_channels))
        self.mid_block = self.add("mid_block", MidBlock(width))
        self.blocks, i = [], 0
        for _, ch, up in levels:
            for _ in range(cfg.layers_per_block + 1):
                self.blocks.append(self.add(f"up_blocks.{i}", resnet(ch)))
                i += 1
            if up is not None:
                self.blocks.append(self.add(f"up_blocks.{i}", Upsample(ch, up)))
                i += 1
        self.norm_out = self.add("norm_out", GroupNorm(GROUPS, levels[-1][1], NORM_EPS))
        self.conv_out = self.add("conv_out", Conv2d(levels[-1][1], cfg.out_channels, 3, padding=1))

    def __call__(self, z):
        x = self.mid_block(self.conv_in(z))
        for block in self.blocks:
            interrupt.check()  # an untiled decode nobody waits for stops between blocks
            x = block(x)
        return self.conv_out(self.norm_out(x, activation="silu"))


class Encoder(Module):
    """HunyuanImageEncoder2D up to the posterior mean: conv_out's first latent_channels outputs plus
    the head's shortcut (the input's channels averaged in groups), first latent_channels of it."""

    prepared_at_load = False  # transformed on the first encode (models/nn/module.py)

    def __init__(self, cfg):
        super().__init__()
        levels, z = cfg.encoder_levels(), cfg.latent_channels
        width = levels[-1][1]
        self.latents, self.group = z, width // (2 * z)
        self.conv_in = self.add("conv_in", Conv2d(cfg.in_channels, levels[0][1], 3, padding=1))
        self.blocks, i = [], 0
        for _, ch, down in levels:
            for _ in range(cfg.layers_per_block):
                self.blocks.append(self.add(f"down_blocks.{i}", resnet(ch)))
                i += 1
            if down is not None:
                self.blocks.append(self.add(f"down_blocks.{i}", Downsample(ch, down)))
                i += 1
        self.mid_block = self.add("mid_block", MidBlock(width))
        self.norm_out = self.add("norm_out", GroupNorm(GROUPS, width, NORM_EPS))
        self.conv_out = self.add("conv_out", _MeanHalfConv(width, 2 * z))

    def __call__(self, x):
        b = self.backend
        x = self.conv_in(x)
        for block in self.blocks:
            x = block(x)
        x = self.mid_block(x)
        n, h, w, c = x.shape
        shortcut = b.mean(b.reshape(x, (n, h, w, c // self.group, self.group)), -1)
        shortcut = b.slice(shortcut, -1, 0, self.latents)
        return self.conv_out(self.norm_out(x, activation="silu"), residual=shortcut)


class _MeanHalfConv(Conv2d):
    """conv_out (3x3, width -> 2 * latents moments) keeping the mean half of its outputs."""

    def __init__(self, cin: int, moments: int):
        super().__init__(cin, moments, 3, padding=1)

    def convert(self, name, host):
        return super().convert(name, np.asarray(host)[:self.cout // 2])
