"""The LTX-2 video VAE encoder (diffusers `LTX2VideoEncoder3d`) on the decoder's blocks
(models/ltx2_vae/layers.py: CausalConv, Resnet), channels-last N,T,H,W,C.

- patchify: diffusers' reshape + permute (0, 1, 3, 7, 5, 2, 4, 6): pixel (row H*p + a, column W*p + b)
  of frame T*pt + t lands on channel c*pt*p*p + t*p*p + b*p + a (the column offset before the row's).
- Downsampler (LTX2VideoDownsampler3d): the clip gets stride_t - 1 copies of its first frame in
  front; a conv to out / prod(stride) channels, then space-to-depth (channel c*S + t*sh*sw + h*sw + w),
  plus the padded input's own space-to-depth averaged over `group` consecutive channels.
- conv_out gives the posterior's mean and one log-variance channel; only the mean (the first
  latent_channels, what the pipelines' retrieve_latents(..., "argmax") takes) is computed: its
  weight rows are sliced at load.
Everything is a reshape, a transpose, a mean or a conv on the backend; no numpy in the forward.
"""
from __future__ import annotations

import numpy as np

from ..nn import interrupt
from ..nn.module import Module
from .config import LTX2VAEConfig
from .layers import CausalConv, Resnet, _Norm


def space_to_depth(b, x, stride: tuple[int, int, int]):
    """(N, T, H, W, C) -> (N, T/st, H/sh, W/sw, C*st*sh*sw), channel c*S + t*sh*sw + h*sw + w, as
    diffusers' unflatten / permute (0, 1, 3, 5, 7, 2, 4, 6) / flatten."""
    st, sh, sw = stride
    n, t, h, w, c = x.shape
    x = b.reshape(x, (n, t // st, st, h // sh, sh, w // sw, sw, c))
    x = b.transpose(x, (0, 1, 3, 5, 7, 2, 4, 6))
    return b.reshape(x, (n, t // st, h // sh, w // sw, c * st * sh * sw))


def patchify(b, x, p: int, pt: int):
    """Frames (N, F, H, W, C) -> (N, F/pt, H/p, W/p, C*pt*p*p) in the encoder's channel order (the
    module docstring)."""
    n, f, h, w, c = x.shape
    x = b.reshape(x, (n, f // pt, pt, h // p, p, w // p, p, c))
    x = b.transpose(x, (0, 1, 3, 5, 7, 2, 6, 4))
    return b.reshape(x, (n, f // pt, h // p, w // p, c * pt * p * p))


class Downsampler(Module):
    """LTX2VideoDownsampler3d (see the module docstring)."""

    def __init__(self, cin: int, cout: int, stride: tuple[int, int, int], reflect: bool):
        super().__init__()
        self.stride, self.cout = stride, cout
        self.group = cin * int(np.prod(stride)) // cout
        self.conv = self.add("conv", CausalConv(cin, cout // int(np.prod(stride)), reflect))

    def __call__(self, x, causal: bool):
        b, st = self.backend, self.stride[0]
        if st > 1:
            x = b.concat([b.slice(x, 1, 0, st - 1), x], axis=1)
        skip = space_to_depth(b, x, self.stride)
        n, t, h, w, _ = skip.shape
        skip = b.reshape(skip, (n, t, h, w, self.cout, self.group))
        skip = b.mean(skip, -1) if self.group > 1 else b.reshape(skip, (n, t, h, w, self.cout))
        return b.add(space_to_depth(b, self.conv(x, causal), self.stride), skip)


class DownBlock(Module):
    """LTX2VideoDownBlock3D: resnets at the block's input width, then its downsampler (if any)."""

    def __init__(self, cin: int, cout: int, layers: int, stride, reflect: bool):
        super().__init__()
        self.resnets = [self.add(f"resnets.{i}", Resnet(cin, reflect, False)) for i in range(layers)]
        self.downsampler = self.add("downsamplers.0", Downsampler(cin, cout, stride, reflect)) \
            if stride is not None else None

    def steps(self) -> list:
        return [*self.resnets, *([self.downsampler] if self.downsampler is not None else [])]


class Encoder(Module):
    """LTX2VideoEncoder3d up to the posterior mean: patchify, conv_in, down blocks, mid block,
    pixel norm + SiLU, conv_out (mean rows only). Frames in [-1, 1] -> N,T,h,w,latent_channels."""

    prepared_at_load = False  # transformed on the first encode (models/nn/module.py)

    def __init__(self, cfg: LTX2VAEConfig):
        super().__init__()
        reflect = cfg.encoder_spatial_padding_mode == "reflect"
        self.causal, self.patch, self.patch_t = bool(cfg.encoder_causal), cfg.patch_size, cfg.patch_size_t
        width = cfg.latent_channels
        self.conv_in = self.add("conv_in", CausalConv(cfg.in_channels * cfg.patch_size ** 2, width, reflect))
        self.down_blocks = []
        for i, (out, layers, stride) in enumerate(cfg.encoder_levels()):
            self.down_blocks.append(self.add(f"down_blocks.{i}", DownBlock(width, out, layers, stride, reflect)))
            width = out
        self.mid_resnets = [self.add(f"mid_block.resnets.{i}", Resnet(width, reflect, False))
                            for i in range(cfg.layers_per_block[-1])]
        self.norm_out = _Norm()
        # diffusers' conv_out gives latent_channels + 1 (the mean, one log-variance): keep the mean's rows
        self.conv_out = self.add("conv_out", CausalConv(width, cfg.latent_channels + 1, reflect,
                                                        np.arange(cfg.latent_channels)))

    def __call__(self, x):
        b = self.backend
        x = self.conv_in(patchify(b, x, self.patch, self.patch_t), self.causal)
        for step in [s for blk in self.down_blocks for s in blk.steps()] + self.mid_resnets:
            interrupt.check()  # an encode nobody waits for stops between blocks
            x = step(x, self.causal)
        return self.conv_out(self.norm_out(b, x), self.causal)
