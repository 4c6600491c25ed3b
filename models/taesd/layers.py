"""The blocks of diffusers' AutoencoderTiny (TAESD): plain 3x3 convs and ReLUs, no norms.

Both halves are one flat `layers` sequence in the checkpoint, so parameters are named
`layers.{index}` by their position in it; the parameter-free entries (ReLU, nearest upsample)
still take an index, which is why the builders below count them.
"""
from __future__ import annotations

from typing import Sequence

from convkernels.sharded_ops import halo_upsample_conv2d

from ..nn import interrupt, row_shard
from ..nn.layers import Conv2d
from ..nn.module import Module


class TinyBlock(Module):
    """AutoencoderTinyBlock: relu(conv(relu(conv(relu(conv(x))))) + x). Widths never change inside
    AutoencoderTiny (each block maps a stage's width to itself), so the skip is the identity."""

    def __init__(self, channels: int):
        super().__init__()
        self.convs = [self.add(f"conv.{i}", Conv2d(channels, channels, 3, padding=1)) for i in (0, 2, 4)]

    def __call__(self, x):
        h = self.convs[0](x, activation="relu")
        h = self.convs[1](h, activation="relu")
        # the conv epilogue adds the residual after its activation; the ReLU here comes after the sum
        return self.backend.relu(self.convs[2](h, residual=x))


class UpsampleConv(Conv2d):
    """nn.Upsample(2, nearest) followed by a bias-free 3x3 conv, as one backend op (each backend
    computes the pair its fastest way)."""

    def __init__(self, channels: int):
        super().__init__(channels, channels, 3, padding=1, bias=False)

    def __call__(self, x):
        shard = row_shard.current()
        if shard is not None:  # one input row of each neighbour (models/nn/row_shard.py)
            return halo_upsample_conv2d(self.backend, shard.comm, x, self.weight, None)
        return self.backend.upsample_conv2d(x, self.weight, None)


class TinyDecoder(Module):
    """DecoderTiny's layers: conv_in + ReLU, then per stage its blocks, a 2x upsample (all but the
    last stage) and a 3x3 conv (bias-free, except the last, which writes the image)."""

    def __init__(self, latent_channels: int, out_channels: int, widths: Sequence[int], blocks: Sequence[int]):
        super().__init__()
        self.conv_in = self.add("layers.0", Conv2d(latent_channels, widths[0], 3, padding=1))
        index = 2  # after conv_in and its ReLU
        self.stages = []
        for stage, (width, count) in enumerate(zip(widths, blocks)):
            last = stage == len(widths) - 1
            stage_blocks = [self.add(f"layers.{index + k}", TinyBlock(width)) for k in range(count)]
            index += count
            if last:
                conv = self.add(f"layers.{index}", Conv2d(width, out_channels, 3, padding=1))
            else:
                index += 1  # the upsample
                conv = self.add(f"layers.{index}", UpsampleConv(width))
            index += 1
            self.stages.append((stage_blocks, conv))

    def __call__(self, z):
        x = self.conv_in(z, activation="relu")
        for stage_blocks, conv in self.stages:
            interrupt.check()  # an untiled decode nobody waits for stops between stages
            for block in stage_blocks:
                x = block(x)
            x = conv(x)
        return x


class TinyEncoder(Module):
    """EncoderTiny's layers: a 3x3 conv (stage 0) or a bias-free 3x3 stride-2 conv (later stages),
    that stage's blocks, and a final 3x3 conv to the latent channels."""

    prepared_at_load = False  # transformed on the first encode (models/nn/module.py)

    def __init__(self, in_channels: int, latent_channels: int, widths: Sequence[int], blocks: Sequence[int]):
        super().__init__()
        index = 0
        self.stages = []
        for stage, (width, count) in enumerate(zip(widths, blocks)):
            if stage == 0:
                entry = Conv2d(in_channels, width, 3, padding=1)
            else:
                entry = Conv2d(width, width, 3, stride=2, padding=1, bias=False)
            entry = self.add(f"layers.{index}", entry)
            stage_blocks = [self.add(f"layers.{index + 1 + k}", TinyBlock(width)) for k in range(count)]
            index += 1 + count
            self.stages.append((entry, stage_blocks))
        self.conv_out = self.add(f"layers.{index}", Conv2d(widths[-1], latent_channels, 3, padding=1))

    def __call__(self, x):
        for entry, stage_blocks in self.stages:
            interrupt.check()
            x = entry(x)
            for block in stage_blocks:
                x = block(x)
        return self.conv_out(x)
