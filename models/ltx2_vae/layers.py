"""The LTX-2 video VAE decoder's blocks on models/nn layers (channels-last: N,T,H,W,C).

- CausalConv: LTX2VideoCausalConv3d, a 3x3x3 conv whose time axis is padded by repeating the first
  frame (causal: kT-1 copies in front) or the first and last frames (non-causal: (kT-1)/2 each
  side, the LTX-2 decoder's default), and whose rows and columns are padded by reflection (the
  decoder's `reflect`) or zeros; a lone row or column (1-row latents, a tiled decode's last tile,
  which torch's reflect padding refuses) is repeated instead. On a row shard (rows are axis 2) it takes one halo row from each
  neighbour and reflects only at the image's own top and bottom: the reflected row is the joined
  band's second (or second to last) row, which is the image's own whatever the band's height.
- Resnet: pixel (RMS over channels, eps 1e-8) norm, SiLU, conv, twice, plus the input; with
  timestep conditioning the norms are followed by x * (1 + scale) + shift, per channel.
- Upsampler: the conv to prod(stride) / upsample_factor times the channels, depth-to-space
  (backend.pixel_shuffle, torch's order) dropping the first stride_t - 1 frames; its residual
  (the input's own depth-to-space, channels tiled `repeats` times) is, before the shuffle, x's
  channels tiled `repeats` times: added in the conv's epilogue.
- Time embeddings: the timestep is fixed per model (the family's options), so every scale and
  shift is a per-channel constant computed once at load (Decoder.derive, float64 on the host).
RMS norms, the shortcuts and the shuffles are row-local; only the convs exchange rows.
"""
from __future__ import annotations

import math

import numpy as np

from convkernels.sharded_ops import halo_rows

from ..nn import interrupt, row_shard
from ..nn.layers import Conv, Linear
from ..nn.module import Module
from .config import RMS_EPS, TIME_PROJ, LTX2VAEConfig


class _Conv3d(Conv):
    """The nn.Conv3d inside LTX2VideoCausalConv3d (checkpoint name `conv`); `order`, if given,
    reorders its output channels at load."""

    def __init__(self, cin: int, cout: int, order: np.ndarray | None = None):
        super().__init__(cin, cout, (3, 3, 3))
        self.order = order

    def convert(self, name, host):
        if self.order is not None:
            host = np.asarray(host, np.float32)[self.order]
        return super().convert(name, host)


class CausalConv(Module):
    """LTX2VideoCausalConv3d (kernel 3, stride 1) with the module docstring's padding."""

    def __init__(self, cin: int, cout: int, reflect: bool, order: np.ndarray | None = None):
        super().__init__()
        self.reflect = reflect
        self.conv = self.add("conv", _Conv3d(cin, cout, order))

    def __call__(self, x, causal: bool, residual=None):
        b = self.backend
        above = below = None
        shard = row_shard.current()
        if shard is not None:
            (above, below), _ = halo_rows(b, shard.comm, x, 1, axis=2)
            if above is not None or below is not None:
                x = b.concat([r for r in (above, x, below) if r is not None], axis=2)
        t = ((2, 0) if causal else (1, 1))
        rows = (int(above is None), int(below is None))  # a neighbour's halo row stands in on its side
        if self.reflect:
            # frames, rows and columns in one pad, one copy (three were 43 % of a 720p decode's device
            # time on an H200): the reflected line is the joined band's second (or second to last), the
            # image's own; a lone line (torch's reflect refuses it) stands for itself
            modes = ("replicate", *("reflect" if x.shape[axis] > 1 else "replicate" for axis in (2, 3)))
            x = b.pad(x, (t, rows, (1, 1)), mode=modes)
            space = ((0, 0), (0, 0))
        else:
            x = b.pad(x, (t, (0, 0), (0, 0)), mode="replicate")  # repeated first (and last) frames
            space = (rows, (1, 1))
        return b.conv3d(x, self.conv.weight, self.conv.bias, padding=((0, 0), *space), residual=residual)


class TimeEmbedder(Module):
    """PixArtAlphaCombinedTimestepSizeEmbeddings(dim, 0): sinusoids of the timestep (256, cos
    first), Linear, SiLU, Linear; evaluated on the host at load (embed)."""

    def __init__(self, dim: int):
        super().__init__()
        self.linear_1 = self.add("timestep_embedder.linear_1", Linear(TIME_PROJ, dim))
        self.linear_2 = self.add("timestep_embedder.linear_2", Linear(dim, dim))

    @staticmethod
    def embed(tensors, prefix: str, t: float) -> np.ndarray:
        half = TIME_PROJ // 2
        freqs = np.exp(-math.log(10000) * np.arange(half, dtype=np.float64) / half)
        arg = np.float64(np.float32(t)) * freqs
        x = np.concatenate([np.cos(arg), np.sin(arg)])
        w1, b1 = (np.asarray(tensors[f"{prefix}timestep_embedder.linear_1.{k}"], np.float64) for k in ("weight", "bias"))
        w2, b2 = (np.asarray(tensors[f"{prefix}timestep_embedder.linear_2.{k}"], np.float64) for k in ("weight", "bias"))
        h = w1 @ x + b1
        h = h / (1.0 + np.exp(-h))
        return w2 @ h + b2


class _Norm:
    """A pixel norm + SiLU, with the timestep's per-channel (1 + scale, shift) when given."""

    def __init__(self):
        self.scale = self.shift = None

    def __call__(self, b, x):
        if self.scale is None:
            return b.rms_norm(x, None, RMS_EPS, "silu")
        return b.silu(b.add(b.rms_norm(x, self.scale, RMS_EPS), self.shift))

    def set(self, b, scale: np.ndarray, shift: np.ndarray, dtype):
        self.scale = b.asarray(np.asarray(1.0 + scale, np.float32), dtype=dtype)
        self.shift = b.asarray(np.asarray(shift, np.float32), dtype=dtype)


class Resnet(Module):
    """LTX2VideoResnetBlock3d of one width (the config refuses the width-changing one)."""

    def __init__(self, channels: int, reflect: bool, timestep: bool):
        super().__init__()
        self.channels, self.timestep = channels, timestep
        self.conv1 = self.add("conv1", CausalConv(channels, channels, reflect))
        self.conv2 = self.add("conv2", CausalConv(channels, channels, reflect))
        self.norm1, self.norm2 = _Norm(), _Norm()
        self.scale_shift_table = None

    def param_shapes(self):
        return {"scale_shift_table": (4, self.channels)} if self.timestep else {}

    def modulate(self, tensors, prefix: str, temb: np.ndarray) -> None:
        """temb (4C,), the block's embedding: shift_1, scale_1, shift_2, scale_2 with the table added."""
        m = temb.reshape(4, self.channels) + np.asarray(tensors[f"{prefix}scale_shift_table"], np.float64)
        b = self.backend
        dtype = b.dtype_of(self.conv1.conv.weight)
        self.norm1.set(b, m[1], m[0], dtype)
        self.norm2.set(b, m[3], m[2], dtype)

    def __call__(self, x, causal: bool):
        b = self.backend
        h = self.conv1(self.norm1(b, x), causal)
        return self.conv2(self.norm2(b, h), causal, residual=x)


class Upsampler(Module):
    """LTX2VideoUpsampler3d (see the module docstring)."""

    def __init__(self, channels: int, stride: tuple[int, int, int], residual: bool, factor: int, reflect: bool):
        super().__init__()
        self.stride, self.residual = stride, residual
        self.repeats = int(np.prod(stride)) // factor
        self.conv = self.add("conv", CausalConv(channels, channels * self.repeats, reflect))

    def __call__(self, x, causal: bool):
        b = self.backend
        skip = b.concat([x] * self.repeats, axis=-1) if self.residual else None
        return b.pixel_shuffle(self.conv(x, causal, residual=skip), self.stride, start=self.stride[0] - 1)


class Block(Module):
    """The mid block (resnets) or an up block (upsampler, then resnets), with its time embedder."""

    def __init__(self, width: int, layers: int, reflect: bool, timestep: bool, upsampler: Upsampler | None = None,
                 embed_width: int | None = None):
        super().__init__()
        self.upsampler = self.add("upsamplers.0", upsampler) if upsampler is not None else None
        self.resnets = [self.add(f"resnets.{i}", Resnet(width, reflect, timestep)) for i in range(layers)]
        self.time_embedder = self.add("time_embedder", TimeEmbedder(4 * (embed_width or width))) if timestep else None

    def modulate(self, tensors, prefix: str, t: float) -> None:
        if self.time_embedder is not None:
            temb = TimeEmbedder.embed(tensors, f"{prefix}time_embedder.", t)
            for i, r in enumerate(self.resnets):
                r.modulate(tensors, f"{prefix}resnets.{i}.", temb)

    def steps(self) -> list:
        return [*([self.upsampler] if self.upsampler is not None else []), *self.resnets]


def unpatchify_order(channels: int, pt: int, p: int) -> np.ndarray:
    """conv_out's output channels reordered from diffusers' unpatchify (c, t, w-offset, h-offset)
    to backend.pixel_shuffle's (c, t, h-offset, w-offset)."""
    idx = np.arange(channels * pt * p * p).reshape(channels, pt, p, p)  # diffusers: [c, t, w, h]
    return idx.transpose(0, 1, 3, 2).reshape(-1)


class Decoder(Module):
    """LTX2VideoDecoder3d: conv_in, mid block, up blocks, pixel norm (+ timestep) and SiLU,
    conv_out (x / 2 + 0.5 folded in by the model), unpatchify. One call decodes the whole clip
    (the decoder is not causal in time by default: every frame sees the next)."""

    def __init__(self, cfg: LTX2VAEConfig, timestep: float):
        super().__init__()
        reflect = cfg.decoder_spatial_padding_mode == "reflect"
        ts = bool(cfg.timestep_conditioning)
        self.causal, self.timestep, self.ts = bool(cfg.decoder_causal), float(timestep), ts
        self.patch = (cfg.patch_size_t, cfg.patch_size, cfg.patch_size)
        width = cfg.mid_width
        self.conv_in = self.add("conv_in", CausalConv(cfg.latent_channels, width, reflect))
        self.mid_block = self.add("mid_block", Block(width, cfg.mid_layers, reflect, ts))
        self.up_blocks = []
        for i, (out, stride, factor, residual, layers) in enumerate(cfg.decoder_levels()):
            up = Upsampler(width, stride, residual, factor, reflect) if stride is not None else None
            # diffusers sizes an up block's time embedder by its nominal input width (= out here)
            self.up_blocks.append(self.add(f"up_blocks.{i}", Block(out, layers, reflect, ts, up)))
            width = out
        self.width = width
        per_pixel = cfg.out_channels * int(np.prod(self.patch))
        self.conv_out = self.add("conv_out", CausalConv(width, per_pixel, reflect,
                                                        unpatchify_order(cfg.out_channels, *self.patch[:2])))
        self.norm_out = _Norm()
        if ts:
            self.time_embedder = self.add("time_embedder", TimeEmbedder(2 * width))
        self.multiplier = self.scale_shift_table = None

    def param_shapes(self):
        return {"timestep_scale_multiplier": (), "scale_shift_table": (2, self.width)} if self.ts else {}

    def derive(self, tensors, prefix) -> None:
        """The timestep's scales and shifts of every block (a timestep-conditioned decoder)."""
        if not self.ts:
            return
        t = self.timestep * float(np.asarray(tensors[f"{prefix}timestep_scale_multiplier"], np.float32))
        self.mid_block.modulate(tensors, f"{prefix}mid_block.", t)
        for i, block in enumerate(self.up_blocks):
            block.modulate(tensors, f"{prefix}up_blocks.{i}.", t)
        m = TimeEmbedder.embed(tensors, f"{prefix}time_embedder.", t).reshape(2, self.width)
        m = m + np.asarray(tensors[f"{prefix}scale_shift_table"], np.float64)
        self.norm_out.set(self.backend, m[1], m[0], self.backend.dtype_of(self.conv_out.conv.weight))

    def __call__(self, z):
        b = self.backend
        x = self.conv_in(z, self.causal)
        for step in self.mid_block.steps() + [s for up in self.up_blocks for s in up.steps()]:
            interrupt.check()  # a decode nobody waits for stops between blocks
            x = step(x, self.causal)
        x = self.conv_out(self.norm_out(b, x), self.causal)
        return b.pixel_shuffle(x, self.patch)
