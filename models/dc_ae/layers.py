"""AutoencoderDC's blocks on models/nn layers (channels-last activations), under diffusers' names.

- ResBlock: conv3x3 + act, conv3x3 (no bias), RMSNorm over channels (weight and bias), + input.
- EfficientViTBlock: `attn` (SanaMultiscaleLinearAttention: q, k, v projections, per kernel size a
  depthwise kxk conv and a grouped 1x1 conv of them, ReLU linear attention over the concatenation in
  groups of 3 x head_dim channels, `to_out`, RMSNorm, + input) then `conv_out` (GLUMBConv: 1x1 +
  SiLU, depthwise 3x3, half times SiLU(other half), 1x1, RMSNorm, + input).
- Upsample (DCUpBlock2d): nearest 2x then a 3x3 conv ("interpolate") or a 3x3 conv then a
  channel-to-space shuffle ("pixel_shuffle"), plus the input's channels duplicated
  (repeat_interleave) and shuffled to 2x: a row-local shortcut added in the conv's epilogue.
- Downsample (DCDownBlock2d, encoder only): a stride-2 3x3 conv ("Conv") or a 3x3 conv then a
  space-to-channel shuffle ("pixel_unshuffle"), plus the input's space-to-channel shuffle averaged
  in groups of channels; folded at load into one stride-2 conv (3x3, or 4x4 with the shuffle).
On a row shard the 3x3 and depthwise convs take halo rows, the linear attention all-reduces its
sums (models/nn/linear_attention.py); the norms, 1x1 convs and shortcuts are row-local.
"""
from __future__ import annotations

import numpy as np

from convkernels.sharded_ops import halo_upsample_conv2d

from ..hunyuanimage_vae.layers import ShortcutConv
from ..nn import interrupt, row_shard
from ..nn.layers import Conv2d
from ..nn.linear_attention import relu_linear_attention
from ..nn.module import Module
from ..nn.weights import conv_weight_to_channels_last
from .config import ACTIVATIONS, ATTENTION_EPS, NORM_EPS


class RMSNorm(Module):
    """diffusers RMSNorm(channels, 1e-5, elementwise_affine=True, bias=True) over the channels;
    `residual` is added after the bias."""

    def __init__(self, channels: int):
        super().__init__()
        self.channels = channels
        self.weight = self.bias = None

    def param_shapes(self):
        return {"weight": (self.channels,), "bias": (self.channels,)}

    def __call__(self, x, residual=None):
        b = self.backend
        fused = b.rms_norm_affine(x, self.weight, self.bias, residual, NORM_EPS)  # one pass where offered
        if fused is not None:
            return fused
        y = b.add(b.rms_norm(x, self.weight, NORM_EPS), self.bias)
        return y if residual is None else b.add(y, residual)


class Weight(Module):
    """A bias-free nn.Linear's weight (O, I)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.cin, self.cout, self.weight = cin, cout, None

    def param_shapes(self):
        return {"weight": (self.cout, self.cin)}


class ResBlock(Module):
    def __init__(self, channels: int, act: str):
        super().__init__()
        self.act = ACTIVATIONS[act]
        self.conv1 = self.add("conv1", Conv2d(channels, channels, 3, padding=1))
        self.conv2 = self.add("conv2", Conv2d(channels, channels, 3, padding=1, bias=False))
        self.norm = self.add("norm", RMSNorm(channels))

    def __call__(self, x):
        return self.norm(self.conv2(self.conv1(x, activation=self.act)), residual=x)


class MultiscaleProjection(Module):
    """SanaMultiscaleAttentionProjection: depthwise kxk conv, then a 1x1 conv in groups of one head."""

    def __init__(self, channels: int, heads: int, kernel: int):
        super().__init__()
        self.proj_in = self.add("proj_in", Conv2d(channels, channels, kernel, padding=kernel // 2, bias=False,
                                                  groups=channels))
        self.proj_out = self.add("proj_out", Conv2d(channels, channels, 1, bias=False, groups=3 * heads))

    def __call__(self, x):
        return self.proj_out(self.proj_in(x))


class LinearAttention(Module):
    """SanaMultiscaleLinearAttention(residual_connection=True, norm rms_norm), mult 1."""

    def __init__(self, channels: int, head_dim: int, kernels: tuple[int, ...]):
        super().__init__()
        heads = channels // head_dim
        inner = heads * head_dim
        self.head_dim = head_dim
        self.to_q = self.add("to_q", Weight(channels, inner))
        self.to_k = self.add("to_k", Weight(channels, inner))
        self.to_v = self.add("to_v", Weight(channels, inner))
        self.scales = [self.add(f"to_qkv_multiscale.{i}", MultiscaleProjection(3 * inner, heads, k))
                       for i, k in enumerate(kernels)]
        self.to_out = self.add("to_out", Weight(inner * (1 + len(kernels)), channels))
        self.norm_out = self.add("norm_out", RMSNorm(channels))
        self.qkv = None

    def derive(self, tensors, prefix) -> None:
        # one projection to [q | k | v], the layout diffusers concatenates them in
        self.qkv = self.backend.concat([self.to_q.weight, self.to_k.weight, self.to_v.weight], axis=0)

    def __call__(self, x):
        b = self.backend
        qkv = b.linear(x, self.qkv)
        # the projections and their multiscale ones, concatenated on channels only where the
        # backend's passes cannot read them where they lie
        attended = relu_linear_attention(b, [qkv] + [s(qkv) for s in self.scales], self.head_dim, ATTENTION_EPS)
        return self.norm_out(b.linear(attended, self.to_out.weight), residual=x)


class GLUMBConv(Module):
    """GLUMBConv(expand_ratio 4, rms_norm, residual)."""

    def __init__(self, channels: int):
        super().__init__()
        hidden = 4 * channels
        self.hidden = hidden
        self.conv_inverted = self.add("conv_inverted", Conv2d(channels, 2 * hidden, 1))
        self.conv_depth = self.add("conv_depth", Conv2d(2 * hidden, 2 * hidden, 3, padding=1, groups=2 * hidden))
        self.conv_point = self.add("conv_point", Conv2d(hidden, channels, 1, bias=False))
        self.norm = self.add("norm", RMSNorm(channels))

    def __call__(self, x):
        b, h = self.backend, self.hidden
        y = self.conv_depth(self.conv_inverted(x, activation="silu"))
        gated = b.gated(y, "silu")  # the halves read in place where the backend can
        if gated is None:
            gated = b.mul(b.slice(y, -1, 0, h), b.silu(b.slice(y, -1, h, 2 * h)))
        return self.norm(self.conv_point(gated), residual=x)


class EfficientViTBlock(Module):
    def __init__(self, channels: int, head_dim: int, kernels: tuple[int, ...]):
        super().__init__()
        self.attn = self.add("attn", LinearAttention(channels, head_dim, kernels))
        self.conv_out = self.add("conv_out", GLUMBConv(channels))

    def __call__(self, x):
        return self.conv_out(self.attn(x))


def block(kind: str, channels: int, act: str, head_dim: int, kernels: tuple[int, ...]) -> Module:
    return ResBlock(channels, act) if kind == "ResBlock" else EfficientViTBlock(channels, head_dim, kernels)


class Upsample(Module):
    """DCUpBlock2d(cin, cout, shortcut=True): (N, H, W, cin) -> (N, 2H, 2W, cout)."""

    def __init__(self, cin: int, cout: int, interpolate: bool):
        super().__init__()
        self.interpolate, self.repeats = interpolate, 4 * cout // cin
        if interpolate:
            self.conv = self.add("conv", Conv2d(cin, cout, 3, padding=1))
        else:  # conv to 4 * cout in torch's pixel_shuffle order, the duplicated input added in its epilogue
            self.conv = self.add("conv", ShortcutConv(cin, 4 * cout, self.repeats))

    def _shortcut(self, x, above: bool = False, below: bool = False):
        """x's channels duplicated and shuffled to 2x; on a row shard two rows more where a halo
        row came (the op computes them and drops them, so they only have to exist: zeros)."""
        b = self.backend
        short = b.pixel_shuffle(x, (2, 2), self.repeats)
        return b.pad(short, ((2 if above else 0, 2 if below else 0), (0, 0))) if above or below else short

    def __call__(self, x):
        b = self.backend
        if not self.interpolate:
            return b.pixel_shuffle(self.conv(x), (2, 2))
        shard = row_shard.current()
        if shard is not None:
            return halo_upsample_conv2d(b, shard.comm, x, self.conv.weight, self.conv.bias,
                                        residual_for=lambda above, below: self._shortcut(x, above, below))
        return b.upsample_conv2d(x, self.conv.weight, self.conv.bias, residual=self._shortcut(x))


class DownsampleConv(Conv2d):
    """DCDownBlock2d(cin, cout, shortcut=True)'s `conv` with its shuffle and averaged shortcut as one
    stride-2 conv, padding 1: 3x3 ("Conv": output y reads input rows 2y - 1 .. 2y + 1) or 4x4 with
    the 3x3 conv's four phases ("pixel_unshuffle": output channel c * 4 + r, r = 2 * dy + dx, reads
    rows 2y + dy - 1 .. 2y + dy + 1, kernel rows dy .. dy + 2). The shortcut's output k averages
    the space-to-channel channels k * group .. (group of them), channel ci * 4 + r being input
    channel ci at offset r: kernel tap (1 + dy, 1 + dx) in both forms."""

    def __init__(self, cin: int, cout: int, unshuffle: bool):
        super().__init__(cin, cout // 4 if unshuffle else cout, 3, padding=1)
        self.out, self.unshuffle, self.group = cout, unshuffle, 4 * cin // cout

    def convert(self, name, host):
        host = np.asarray(host, np.float32)
        if name == "bias":
            return np.repeat(host, 4) if self.unshuffle else host
        if self.unshuffle:
            w = np.zeros((self.out, self.cin, 4, 4), np.float32)
            for r in range(4):
                dy, dx = divmod(r, 2)
                w[r::4, :, dy:dy + 3, dx:dx + 3] = host
        else:
            w = host.copy()
        for k in range(self.out):
            for idx in range(k * self.group, (k + 1) * self.group):
                ci, r = divmod(idx, 4)
                w[k, ci, 1 + r // 2, 1 + r % 2] += np.float32(1.0 / self.group)
        return conv_weight_to_channels_last(w)

    def __call__(self, x):
        return self.backend.conv2d(x, self.weight, self.bias, stride=2, padding=1)


class Decoder(Module):
    """diffusers' AutoencoderDC Decoder; conv_out's output is x / 2 + 0.5 once the model folds it in."""

    def __init__(self, cfg):
        super().__init__()
        levels, z = cfg.levels("decoder"), cfg.latent_channels
        acts, widest = cfg.decoder_acts(), levels[-1][0]
        self.conv_in = self.add("conv_in", ShortcutConv(z, widest, widest // z) if cfg.decoder_in_shortcut
                                else Conv2d(z, widest, 3, padding=1))
        self.blocks = []
        for i in reversed(range(len(levels))):
            width, kind, count, kernels = levels[i]
            j = 0
            if i < len(levels) - 1:
                self.blocks.append(self.add(f"up_blocks.{i}.0", Upsample(levels[i + 1][0], width,
                                                                         cfg.upsample_block_type == "interpolate")))
                j = 1
            for k in range(count):
                self.blocks.append(self.add(f"up_blocks.{i}.{j + k}",
                                            block(kind, width, acts[i], cfg.attention_head_dim, kernels)))
        self.norm_out = self.add("norm_out", RMSNorm(levels[0][0]))
        self.act = ACTIVATIONS[cfg.decoder_conv_act_fn]
        self.conv_out = self.add("conv_out", Conv2d(levels[0][0], cfg.in_channels, 3, padding=1))

    def __call__(self, z):
        x = self.conv_in(z)
        for blk in self.blocks:
            interrupt.check()  # an untiled decode nobody waits for stops between blocks
            x = blk(x)
        x = getattr(self.backend, self.act)(self.norm_out(x))  # relu, silu or gelu
        return self.conv_out(x)


class Encoder(Module):
    """diffusers' AutoencoderDC Encoder (its output is the latent itself: no distribution)."""

    prepared_at_load = False  # transformed on the first encode (models/nn/module.py)

    def __init__(self, cfg):
        super().__init__()
        levels, z = cfg.levels("encoder"), cfg.latent_channels
        self.latents, self.group = z, levels[-1][0] // z
        self.out_shortcut = cfg.encoder_out_shortcut
        self.conv_in = self.add("conv_in", Conv2d(cfg.in_channels, levels[0][0], 3, padding=1))
        self.blocks = []
        unshuffle = cfg.downsample_block_type == "pixel_unshuffle"
        for i, (width, kind, count, kernels) in enumerate(levels):
            for k in range(count):
                self.blocks.append(self.add(f"down_blocks.{i}.{k}",
                                            block(kind, width, "silu", cfg.attention_head_dim, kernels)))
            if i < len(levels) - 1:
                self.blocks.append(self.add(f"down_blocks.{i}.{count}",
                                            _Down(width, levels[i + 1][0], unshuffle)))
        self.conv_out = self.add("conv_out", Conv2d(levels[-1][0], z, 3, padding=1))

    def __call__(self, x):
        b = self.backend
        x = self.conv_in(x)
        for blk in self.blocks:
            x = blk(x)
        shortcut = None
        if self.out_shortcut:  # the widest level's channels averaged in groups, one per latent
            n, h, w, c = x.shape
            shortcut = b.mean(b.reshape(x, (n, h, w, self.latents, self.group)), -1)
        return self.conv_out(x, residual=shortcut)


class _Down(Module):
    def __init__(self, cin: int, cout: int, unshuffle: bool):
        super().__init__()
        self.conv = self.add("conv", DownsampleConv(cin, cout, unshuffle))

    def __call__(self, x):
        return self.conv(x)
