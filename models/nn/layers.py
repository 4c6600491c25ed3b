"""Model building blocks on the backend interface: Conv (any rank), Conv2d, GroupNorm, LayerNorm,
Linear, and the image VAE's ResnetBlock2D, SpatialAttention (its mid-block attention),
Upsample2D, Downsample2D. Parameters are named as in PyTorch / diffusers checkpoints (module.py);
every layer runs on `self.backend`, the backend its parameters were loaded to.

On a row shard (row_shard.py: a decode split by latent rows over devices) the layers that need
other shards' rows ask for them through the shard's communicator (convkernels.sharded_ops): a
conv taller than one row its halo, GroupNorm the whole image's statistics, the attention every
shard's keys and values, the upsampler one halo row. Unsharded they run the ops they always ran.
"""
from __future__ import annotations

from convkernels.sharded_ops import exact_group_norm, halo_conv2d, halo_upsample_conv2d

from . import row_shard
from .module import Module
from .weights import conv_weight_to_channels_last


class Conv(Module):
    """A conv's PyTorch-named `weight` (O, I/groups, *k), stored channels-last, and `bias`."""

    def __init__(self, cin: int, cout: int, kernel: tuple[int, ...], bias: bool = True, groups: int = 1):
        super().__init__()
        self.cin, self.cout, self.kernel, self.groups = cin, cout, tuple(kernel), groups
        self.has_bias = bias
        self.weight = self.bias = None

    def param_shapes(self):
        shapes = {"weight": (self.cout, self.cin // self.groups, *self.kernel)}
        if self.has_bias:
            shapes["bias"] = (self.cout,)
        return shapes

    def convert(self, name, host):
        return conv_weight_to_channels_last(host) if name == "weight" else host

    def prepare(self) -> None:
        """A 3-D conv's weight as a later chunk's call reads it (4 frames of 64 x 64; stride 1, the
        video families' causal convs, whose wrappers pad): Conv2d and Wan's conv say their own."""
        if len(self.kernel) == 3:
            self.backend.prepare_conv(self.weight, groups=self.groups, size=(4, 64, 64))


class Conv2d(Conv):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, padding=0, bias: bool = True,
                 groups: int = 1):
        super().__init__(cin, cout, (kernel, kernel), bias, groups)
        self.stride, self.padding = stride, padding

    def __call__(self, x, residual=None, activation=None):
        shard = row_shard.current()
        if shard is not None and self.kernel[0] > 1:
            self._check_same_conv()
            return halo_conv2d(self.backend, shard.comm, x, self.weight, self.bias, residual=residual,
                               activation=activation, groups=self.groups,
                               counts=shard.token_counts(x.shape[1], 1) if self.kernel[0] > 3 else None)
        return self.backend.conv2d(x, self.weight, self.bias, stride=self.stride, padding=self.padding,
                                   groups=self.groups, residual=residual, activation=activation)

    def prepare(self) -> None:
        self.backend.prepare_conv(self.weight, stride=self.stride, padding=self.padding, groups=self.groups)

    def _check_same_conv(self) -> None:
        """Only a stride-1 'same' conv runs on a band of rows (halo_conv2d, grouped or not); a
        stride-2 conv, or one padded otherwise, would need rows no halo gives."""
        same = tuple((k - 1) // 2 for k in self.kernel)
        pads = (self.padding,) * 2 if isinstance(self.padding, int) else tuple(self.padding)
        if self.stride != 1 or any(p not in (s, (s, s)) for p, s in zip(pads, same)):
            raise ValueError(f"a {self.kernel} conv of stride {self.stride}, padding {self.padding}, "
                             f"groups {self.groups} cannot run on a row shard")


class _Affine(Module):
    """Per-channel weight and bias (the norms)."""

    def __init__(self, channels: int, eps: float):
        super().__init__()
        self.channels, self.eps = channels, eps
        self.weight = self.bias = None

    def param_shapes(self):
        return {"weight": (self.channels,), "bias": (self.channels,)}


class GroupNorm(_Affine):
    def __init__(self, groups: int, channels: int, eps: float):
        super().__init__(channels, eps)
        self.groups = groups

    def __call__(self, x, activation=None):
        shard = row_shard.current()
        if shard is not None:  # the whole image's statistics: one all-reduce of the shards' sums
            return exact_group_norm(self.backend, shard.comm, x, self.groups, self.weight, self.bias, self.eps,
                                    activation, rows=shard.rows)
        return self.backend.group_norm(x, self.groups, self.weight, self.bias, self.eps, activation=activation)


class LayerNorm(_Affine):
    """Over the last (channel) axis."""

    def __call__(self, x):
        return self.backend.layer_norm(x, self.weight, self.bias, self.eps)


class Linear(Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.cin, self.cout = cin, cout
        self.weight = self.bias = None

    def param_shapes(self):
        return {"weight": (self.cout, self.cin), "bias": (self.cout,)}

    def __call__(self, x, residual=None, activation=None):
        return self.backend.linear(x, self.weight, self.bias, residual=residual, activation=activation)

    def prepare(self) -> None:
        self.backend.prepare_linear(self.weight)


class ResnetBlock2D(Module):
    """diffusers ResnetBlock2D without time embedding: norm-SiLU-conv twice, skip added in the
    second conv's epilogue (through a 1x1 conv_shortcut when the channel count changes)."""

    def __init__(self, cin: int, cout: int, groups: int, eps: float):
        super().__init__()
        self.norm1 = self.add("norm1", GroupNorm(groups, cin, eps))
        self.conv1 = self.add("conv1", Conv2d(cin, cout, 3, padding=1))
        self.norm2 = self.add("norm2", GroupNorm(groups, cout, eps))
        self.conv2 = self.add("conv2", Conv2d(cout, cout, 3, padding=1))
        self.conv_shortcut = self.add("conv_shortcut", Conv2d(cin, cout, 1)) if cin != cout else None

    def __call__(self, x):
        h = self.norm1(x, activation="silu")
        h = self.conv1(h)
        h = self.norm2(h, activation="silu")
        skip = self.conv_shortcut(x) if self.conv_shortcut is not None else x
        return self.conv2(h, residual=skip)


class SpatialAttention(Module):
    """The VAE mid-block attention: GroupNorm, single-head self-attention over the H*W tokens,
    output projection with the input added back (diffusers Attention with
    residual_connection=True, rescale_output_factor=1, heads=1)."""

    def __init__(self, channels: int, groups: int, eps: float):
        super().__init__()
        self.channels = channels
        self.group_norm = self.add("group_norm", GroupNorm(groups, channels, eps))
        self.to_q = self.add("to_q", Linear(channels, channels))
        self.to_k = self.add("to_k", Linear(channels, channels))
        self.to_v = self.add("to_v", Linear(channels, channels))
        self.proj = self.add("to_out.0", Linear(channels, channels))

    def __call__(self, x):
        backend = self.backend
        n, h, w, c = x.shape
        tokens = backend.reshape(self.group_norm(x), (n, h * w, c))
        q = self.to_q(tokens)
        shard = row_shard.current()
        if shard is None:
            k = self.to_k(tokens)
            v = self.to_v(tokens)
        else:
            # this shard's tokens are the queries; every shard's the keys and values, which travel
            # as one all-gathered array (channels concatenated) in rank order = row order = token order
            kv = backend.concat([self.to_k(tokens), self.to_v(tokens)], axis=-1)
            every = backend.concat(shard.comm.allgather(kv, shard.token_counts(h, w)), axis=1)
            k, v = backend.slice(every, -1, 0, c), backend.slice(every, -1, c, 2 * c)
        attended = backend.attention(q, k, v)
        out = self.proj(attended, residual=backend.reshape(x, (n, h * w, c)))
        return backend.reshape(out, (n, h, w, c))


class Upsample2D(Module):
    """diffusers Upsample2D (use_conv=True): nearest 2x upsample then a 3x3 conv, padding 1.

    mode "subpixel" (default) hands both steps to the backend as one op (upsample_conv2d), which
    computes them its fastest way (CUDA: a stride-2 transposed conv writing the four output
    phases interleaved, 16 instead of 36 multiply-adds per low-res pixel and channel pair);
    mode "nearest" runs them as two ops."""

    def __init__(self, channels: int, mode: str = "subpixel"):
        super().__init__()
        if mode not in ("subpixel", "nearest"):
            raise ValueError(f"Upsample2D mode must be 'subpixel' or 'nearest', got {mode!r}")
        self.mode = mode
        self.conv = self.add("conv", Conv2d(channels, channels, 3, padding=1))

    def __call__(self, x):
        if self.mode == "nearest":  # nearest 2x is row-local; the conv takes its halo
            return self.conv(self.backend.upsample_nearest(x, 2))
        shard = row_shard.current()
        if shard is not None:  # one input row of each neighbour
            return halo_upsample_conv2d(self.backend, shard.comm, x, self.conv.weight, self.conv.bias)
        return self.backend.upsample_conv2d(x, self.conv.weight, self.conv.bias)


class Downsample2D(Module):
    """3x3 stride-2 conv with diffusers' asymmetric (0, 1, 0, 1) zero padding (padding=0 case)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = self.add("conv", Conv2d(channels, channels, 3, stride=2, padding=((0, 1), (0, 1))))

    def __call__(self, x):
        return self.conv(x)

