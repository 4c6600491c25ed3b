"""Convolution geometry: the `ConvSpec`, argument normalisation, shape rules and the conv key.

Layouts are channels-last: activations ``N, *spatial, C``; weights ``O, *kernel, I/groups``
for both forward and transposed convs (``O`` is always the op's output channel count).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Sequence

ACTIVATIONS = (None, "silu", "gelu", "gelu_tanh", "relu")

PaddingArg = int | Sequence[int] | Sequence[Sequence[int]]


def _tuple(value: int | Sequence[int], nd: int, what: str) -> tuple[int, ...]:
    if isinstance(value, int):
        out = (value,) * nd
    else:
        out = tuple(int(v) for v in value)
        if len(out) != nd:
            raise ValueError(f"{what} needs {nd} values for a {nd}-d conv, got {len(out)}: {value!r}")
    return out


def normalize_padding(padding: PaddingArg, nd: int) -> tuple[tuple[int, int], ...]:
    """int -> same on every side; (p0, p1..) -> symmetric per axis; ((lo, hi), ...) -> as given."""
    if isinstance(padding, int):
        pads = ((padding, padding),) * nd
    else:
        items = list(padding)
        if len(items) != nd:
            raise ValueError(f"padding needs {nd} entries for a {nd}-d conv, got {len(items)}: {padding!r}")
        pads = tuple((int(p), int(p)) if isinstance(p, int) else tuple(int(v) for v in p) for p in items)
        for p in pads:
            if len(p) != 2:
                raise ValueError(f"padding entries are an int or a (lo, hi) pair, got {padding!r}")
    if any(lo < 0 or hi < 0 for lo, hi in pads):
        raise ValueError(f"padding must be >= 0, got {padding!r}")
    return pads


@dataclass(frozen=True)
class ConvSpec:
    """Geometry of one convolution (forward or transposed), independent of shapes and dtype."""

    stride: tuple[int, ...]
    padding: tuple[tuple[int, int], ...]
    dilation: tuple[int, ...]
    groups: int = 1
    transpose: bool = False
    output_padding: tuple[int, ...] = field(default=())

    @classmethod
    def make(cls, nd: int, stride=1, padding: PaddingArg = 0, dilation=1, groups: int = 1,
             transpose: bool = False, output_padding=0) -> "ConvSpec":
        stride_t = _tuple(stride, nd, "stride")
        dil_t = _tuple(dilation, nd, "dilation")
        op_t = _tuple(output_padding, nd, "output_padding")
        if any(s < 1 for s in stride_t):
            raise ValueError(f"stride must be >= 1, got {stride!r}")
        if any(d < 1 for d in dil_t):
            raise ValueError(f"dilation must be >= 1, got {dilation!r}")
        if not isinstance(groups, int) or groups < 1:
            raise ValueError(f"groups must be a positive int, got {groups!r}")
        if not transpose and any(op_t):
            raise ValueError("output_padding only applies to transposed convs")
        if any(o < 0 or (o >= s and o >= d) for o, s, d in zip(op_t, stride_t, dil_t)):
            raise ValueError(f"output_padding must be smaller than stride or dilation, got {output_padding!r}")
        return cls(stride_t, normalize_padding(padding, nd), dil_t, groups, transpose, op_t)

    @property
    def nd(self) -> int:
        return len(self.stride)

    def output_spatial(self, in_spatial: Sequence[int], kernel: Sequence[int]) -> tuple[int, ...]:
        out = []
        for i, (n, k) in enumerate(zip(in_spatial, kernel)):
            lo, hi = self.padding[i]
            s, d = self.stride[i], self.dilation[i]
            if self.transpose:
                o = (n - 1) * s - lo - hi + d * (k - 1) + self.output_padding[i] + 1
            else:
                o = (n + lo + hi - d * (k - 1) - 1) // s + 1
            out.append(o)
        return tuple(out)


@dataclass(frozen=True)
class ConvKey:
    """Everything a path choice may depend on: the memo key of every backend."""

    op: str
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    dtype: str
    spec: ConvSpec
    epilogue: tuple[bool, bool, str | None]  # (bias, residual, activation)

    @property
    def kernel(self) -> tuple[int, ...]:
        return self.w_shape[1:-1]

    @property
    def in_channels(self) -> int:
        return self.x_shape[-1]

    @property
    def out_channels(self) -> int:
        return self.w_shape[0]

    @property
    def out_shape(self) -> tuple[int, ...]:
        sp = self.spec.output_spatial(self.x_shape[1:-1], self.kernel)
        return (self.x_shape[0], *sp, self.out_channels)

    @property
    def is_depthwise(self) -> bool:
        g = self.spec.groups
        return g > 1 and g == self.in_channels == self.out_channels

    def macs(self) -> int:
        """Multiply-accumulates of the conv (for cost rules and benchmark FLOP counts)."""
        k = 1
        for v in self.kernel:
            k *= v
        per_out = k * self.w_shape[-1]
        if self.spec.transpose:
            n_in = 1
            for v in self.x_shape[:-1]:
                n_in *= v
            return n_in * self.in_channels * k * (self.out_channels // self.spec.groups)
        n_out = 1
        for v in self.out_shape[:-1]:
            n_out *= v
        return n_out * self.out_channels * per_out

    def describe(self) -> dict:
        s = self.spec
        return {
            "op": self.op, "input_shape": list(self.x_shape), "weight_shape": list(self.w_shape),
            "dtype": self.dtype, "stride": list(s.stride), "padding": [list(p) for p in s.padding],
            "dilation": list(s.dilation), "groups": s.groups, "transpose": s.transpose,
            "output_padding": list(s.output_padding),
            "epilogue": {"bias": self.epilogue[0], "residual": self.epilogue[1], "activation": self.epilogue[2]},
            "macs": self.macs(),
        }


def validate_conv(op: str, x_shape: tuple[int, ...], w_shape: tuple[int, ...], spec: ConvSpec,
                  bias_shape: tuple[int, ...] | None, residual_shape: tuple[int, ...] | None,
                  activation: str | None) -> tuple[int, ...]:
    """Raise a ValueError that says what is wrong; return the output shape."""
    nd = spec.nd
    if len(x_shape) != nd + 2:
        raise ValueError(f"{op}: input must be N,{'spatial,' * nd}C ({nd + 2}-d, channels-last), got shape {x_shape}")
    if len(w_shape) != nd + 2:
        raise ValueError(f"{op}: weight must be O,{'k,' * nd}I/groups ({nd + 2}-d), got shape {w_shape}")
    if any(v <= 0 for v in x_shape):
        raise ValueError(f"{op}: input has an empty dimension: {x_shape}")
    if any(v <= 0 for v in w_shape):
        raise ValueError(f"{op}: weight has an empty dimension: {w_shape}")
    c_in, c_out, g = x_shape[-1], w_shape[0], spec.groups
    if c_in % g or c_out % g:
        raise ValueError(f"{op}: groups={g} must divide input channels ({c_in}) and output channels ({c_out})")
    if w_shape[-1] * g != c_in:
        raise ValueError(f"{op}: weight expects {w_shape[-1]} x groups {g} = {w_shape[-1] * g} input channels, "
                         f"input has {c_in}")
    out_sp = spec.output_spatial(x_shape[1:-1], w_shape[1:-1])
    if any(o <= 0 for o in out_sp):
        raise ValueError(f"{op}: output would be empty ({out_sp}) for input {x_shape}, kernel {w_shape[1:-1]}, "
                         f"{spec}")
    if spec.transpose:
        for i, (lo, hi) in enumerate(spec.padding):
            if max(lo, hi) > spec.dilation[i] * (w_shape[1 + i] - 1):
                raise ValueError(f"{op}: padding {spec.padding[i]} exceeds dilation*(kernel-1) on axis {i}")
    out_shape = (x_shape[0], *out_sp, c_out)
    if bias_shape is not None and tuple(bias_shape) != (c_out,):
        raise ValueError(f"{op}: bias must have shape ({c_out},), got {tuple(bias_shape)}")
    if residual_shape is not None and tuple(residual_shape) != out_shape:
        raise ValueError(f"{op}: residual must have the output shape {out_shape}, got {tuple(residual_shape)}")
    if activation not in ACTIVATIONS:
        raise ValueError(f"{op}: activation must be one of {ACTIVATIONS}, got {activation!r}")
    return out_shape


def is_subpixel_upsample(key: ConvKey) -> bool:
    """A 2-d transposed conv with kernel 4, stride 2, padding 1 (the form of nearest-2x upsample +
    3x3 conv, see upsample_conv_as_transpose). Each of its four output
    phases (rows 2i + a, columns 2j + b) is a 2x2 conv of the input: along an axis, phase a reads
    input i - 1 + a + t (t = 0, 1) through kernel tap 3 - a - 2t."""
    s = key.spec
    return (s.transpose and s.nd == 2 and key.kernel == (4, 4) and s.stride == (2, 2)
            and s.padding == ((1, 1), (1, 1)) and s.dilation == (1, 1) and s.groups == 1
            and s.output_padding == (0, 0))


def upsample_conv_as_transpose(xp, w):
    """Channels-last weight (O, 3, 3, I) of "nearest 2x upsample, then a 3x3 conv with padding 1"
    -> the (O, 4, 4, I) weight of the conv_transpose2d(stride=2, padding=1) computing the same
    function (an `is_subpixel_upsample` conv): 4 instead of 9 multiply-adds per output and input
    channel, no upsampled tensor. Along one axis, output 2i + a reads input i - 1 + a + t through
    tap 3 - a - 2t, and once upsampled that input covers conv taps {0} / {1, 2} (a = 0) or
    {0, 1} / {2} (a = 1): transposed taps 0..3 are w2, w1 + w2, w0 + w1, w0. Elementwise adds
    only (no gemm). `xp`: the array module of `w` (numpy, cupy)."""
    def taps(v, axis):
        t = [xp.take(v, i, axis=axis) for i in range(3)]
        return xp.stack([t[2], t[1] + t[2], t[0] + t[1], t[0]], axis=axis)
    return taps(taps(w, 1), 2)


def upsample_conv_as_phases(xp, w):
    """Channels-last weight (O, 3, 3, I) of "nearest 2x upsample, then a 3x3 conv with padding 1"
    -> the (4 O, 2, 2, I) weight of one forward 2x2 conv with padding 1 whose (N, H+1, W+1, 4 O)
    output holds the four output phases as channel blocks: output pixel (2i + a, 2j + b) is that
    conv's pixel (i + a, j + b), channels [(2a + b) O, (2a + b + 1) O). Along one axis, output
    2i + a reads upsampled rows 2i + a - 1 .. 2i + a + 1, which are input rows i - 1 + a and i + a:
    taps (w0, w1 + w2) for a = 0, (w0 + w1, w2) for a = 1. As the transposed form, 4 instead of 9
    multiply-adds per output and input channel, but as a forward conv (the copy putting the
    phases in place is the backend's). `xp`: the array module of `w` (numpy, cupy)."""
    def phase(v, axis, a):
        t = [xp.take(v, i, axis=axis) for i in range(3)]
        return xp.stack([t[0], t[1] + t[2]] if a == 0 else [t[0] + t[1], t[2]], axis=axis)
    return xp.concatenate([phase(phase(w, 1, a), 2, b) for a in (0, 1) for b in (0, 1)], axis=0)


def prod(values: Iterable[int]) -> int:
    out = 1
    for v in values:
        out *= int(v)
    return out


def upsample_shapes(shape: tuple[int, ...], scale: tuple[int, ...]) -> tuple[list[int], list[int], tuple[int, ...]]:
    """Nearest upsample of (N, *spatial, C) as a broadcast: the shape to reshape to (a unit axis
    after each spatial axis), the shape to broadcast that to, and the final shape."""
    nd = len(scale)
    expanded, target = [shape[0]], [shape[0]]
    for i in range(nd):
        expanded += [shape[1 + i], 1]
        target += [shape[1 + i], scale[i]]
    expanded.append(shape[-1])
    target.append(shape[-1])
    return expanded, target, (shape[0], *(shape[1 + i] * scale[i] for i in range(nd)), shape[-1])


#: TensorOps.pad's modes, and NumPy's (and CuPy's, MLX's) name of each
PAD_MODES = ("zeros", "replicate", "reflect")
NUMPY_PAD_MODES = {"zeros": "constant", "replicate": "edge", "reflect": "reflect"}


def pad_each_axis(x, pads, modes, pad_fn):
    """x (N, *spatial, C) padded as TensorOps.pad asks, through pad_fn(x, width, NumPy's mode name)
    with NumPy's pad widths: in one call where every axis has the same mode, else one per axis."""
    if len(set(modes)) == 1:
        return pad_fn(x, ((0, 0), *pads, (0, 0)), NUMPY_PAD_MODES[modes[0]])
    for axis, (width, mode) in enumerate(zip(pads, modes), start=1):
        if width != (0, 0):
            widths = [(0, 0)] * x.ndim
            widths[axis] = width
            x = pad_fn(x, tuple(widths), NUMPY_PAD_MODES[mode])
    return x
