"""Convolution algorithms on mlx.core arrays (channels-last, weights O,*k,I/groups) and the
facts about the installed MLX that their guards and cost rules read.

Each function computes the bare conv (no bias/epilogue); the backend adds the epilogue."""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

import mlx.core as mx

from ...spec import ConvKey, ConvSpec, prod
from ...unfold import conv_unfold_gemm

# Upstream releases that made our workaround paths unnecessary (guards compare mx.__version__).
DEPTHWISE_TAIL_FIXED = (0, 32, 0)   # PR 3446: tail-aware Metal depthwise kernel
SMALL_KD_FIXED = (0, 32, 1)         # PR 3785: small kernel-depth conv3d as accumulated 2D convs
TILED_UNFOLD_FIXED = (0, 32, 1)     # PR 3084: tiled unfold for conv_transpose under maxBufferLength


def parse_version(text: str) -> tuple[int, int, int]:
    """'0.32.4' -> (0, 32, 4); '0.30.5.dev2026+abc' -> (0, 30, 5); missing parts are 0."""
    parts = [int(p) for p in re.findall(r"\d+", text.split("+")[0])[:3]]
    return tuple(parts + [0] * (3 - len(parts)))  # type: ignore[return-value]


@dataclass(frozen=True)
class MlxEnv:
    """What the path guards may depend on. Tests build one to pose as an older MLX."""

    version: tuple[int, int, int]
    metal: bool

    @classmethod
    def detect(cls) -> "MlxEnv":
        return cls(parse_version(mx.__version__), bool(mx.metal.is_available()))

    @property
    def depthwise_gate(self) -> bool:
        """The installed Metal depthwise kernel still refuses outputs not a multiple of 8."""
        return self.metal and self.version < DEPTHWISE_TAIL_FIXED

    @property
    def slow_conv3d(self) -> bool:
        """conv3d still runs the generic 3D implicit gemm (no per-frame 2D decomposition)."""
        return self.metal and self.version < SMALL_KD_FIXED

    @property
    def untiled_unfold(self) -> bool:
        """MLX's explicit-gemm unfold is one buffer, which fails above maxBufferLength."""
        return self.metal and self.version < TILED_UNFOLD_FIXED


# ---- geometry helpers -------------------------------------------------------------------------

def forward_padding(key: ConvKey) -> tuple[list[int], list[int]]:
    """(lo, hi) lists for conv_general, for a forward conv or a transposed conv run as the
    forward conv of its stride-dilated input with a flipped kernel."""
    s = key.spec
    if not s.transpose:
        return [p[0] for p in s.padding], [p[1] for p in s.padding]
    lo, hi = [], []
    for i, k in enumerate(key.kernel):
        reach = s.dilation[i] * (k - 1)
        lo.append(reach - s.padding[i][0])
        hi.append(reach - s.padding[i][1] + s.output_padding[i])
    return lo, hi


def native_conv(x, w, key: ConvKey, groups: int | None = None):
    """mx.conv_general as MLX dispatches it; transposed convs as flip + input dilation, which
    is what MLX's own conv_transpose*d lower to (and it accepts asymmetric padding)."""
    s = key.spec
    lo, hi = forward_padding(key)
    if s.transpose:
        return mx.conv_general(x, w, stride=1, padding=(lo, hi), kernel_dilation=list(s.dilation),
                               input_dilation=list(s.stride), groups=groups or s.groups, flip=True)
    return mx.conv_general(x, w, stride=list(s.stride), padding=(lo, hi), kernel_dilation=list(s.dilation),
                           groups=groups or s.groups)


def group_split_conv(x, w, key: ConvKey):
    """Grouped conv as one ungrouped conv per group (MLX has no grouped conv3d)."""
    g = key.spec.groups
    cg, og = key.w_shape[-1], key.out_channels // g
    outs = [native_conv(x[..., i * cg:(i + 1) * cg], w[i * og:(i + 1) * og], key, groups=1) for i in range(g)]
    return mx.concatenate(outs, axis=-1)


def subpixel_conv(x, w, key: ConvKey):
    """An `is_subpixel_upsample` transposed conv as its four 2x2 phase convs, each written into
    its interleaved positions of the output (no zero-stuffed input, 4x fewer multiplies than
    native_conv's input dilation, no concatenation)."""
    n, h, wd, _ = x.shape
    out = mx.zeros((n, h, 2, wd, 2, key.out_channels), dtype=x.dtype)
    for a, b in itertools.product((0, 1), (0, 1)):
        # phase (a, b) reads input i - 1 + a + t through kernel tap 3 - a - 2t (t = 0, 1)
        out[:, :, a, :, b, :] = mx.conv_general(x, w[:, 3 - a::-2, 3 - b::-2], padding=([1 - a, 1 - b], [a, b]))
    return out.reshape(key.out_shape)


# ---- depthwise_tail ---------------------------------------------------------------------------

def depthwise_fast_shape(key: ConvKey) -> bool:
    """The constraints of MLX's Metal depthwise kernel apart from its output-size gate."""
    s = key.spec
    return (key.is_depthwise and not s.transpose and s.nd == 2 and all(k <= 7 for k in key.kernel)
            and all(v <= 2 for v in s.stride) and all(d == 1 for d in s.dilation) and key.in_channels % 16 == 0)


def has_tail(key: ConvKey, multiple: int = 8) -> bool:
    return any(o % multiple for o in key.out_shape[1:-1])


def pad_to_multiple_conv(x, w, key: ConvKey, multiple: int = 8):
    """Extend the bottom/right padding by (round_up(out, 8) - out) * stride so the conv's output
    is a multiple of 8 (the sizes the gated kernel accepts), then slice the extra rows away.
    The first `out` rows see exactly the same inputs, so the result is unchanged."""
    s = key.spec
    out_sp = key.out_shape[1:-1]
    extra = [(-o) % multiple * st for o, st in zip(out_sp, s.stride)]
    lo = [p[0] for p in s.padding]
    hi = [p[1] + e for p, e in zip(s.padding, extra)]
    big = mx.conv_general(x, w, stride=list(s.stride), padding=(lo, hi), kernel_dilation=list(s.dilation),
                          groups=s.groups)
    return big[(slice(None), *(slice(0, o) for o in out_sp))]


# ---- small_kd_2d ------------------------------------------------------------------------------

SMALL_KD_MAX = 7


def small_kd_ok(key: ConvKey) -> bool:
    s = key.spec
    return (s.nd == 3 and not s.transpose and s.groups == 1 and key.kernel[0] <= SMALL_KD_MAX
            and s.stride[0] == 1 and s.dilation[0] == 1 and s.padding[0] == (0, 0)
            and key.in_channels % 16 == 0 and key.out_channels % 16 == 0)


def small_kd_conv(x, w, key: ConvKey):
    """3D conv with small kernel depth kD as kD accumulated per-frame 2D convs: tap d convolves
    input frames d .. d+OD-1 (batch folded into frames) with the weight slice w[:, d]."""
    s = key.spec
    n, t = x.shape[0], x.shape[1]
    kd = key.kernel[0]
    od = t - kd + 1
    lo, hi = [p[0] for p in s.padding[1:]], [p[1] for p in s.padding[1:]]
    acc = None
    for d in range(kd):
        frames = x[:, d:d + od].reshape(n * od, *x.shape[2:])
        y = mx.conv_general(frames, w[:, d], stride=list(s.stride[1:]), padding=(lo, hi),
                            kernel_dilation=list(s.dilation[1:]))
        acc = y if acc is None else acc + y
    return acc.reshape(n, od, *acc.shape[1:])


# ---- tiled_unfold ---------------------------------------------------------------------------------

def native_unfold_bytes(key: ConvKey, itemsize: int) -> int:
    """Bytes of MLX's own explicit-gemm unfold buffer, one buffer for all channels (im2col of the
    forward conv; for a transposed conv, of its forward form over the stride-dilated input, as
    MLX's naive_unfold_transpose): what must stay under Metal's maxBufferLength."""
    return prod(key.out_shape[:-1]) * prod(key.kernel) * key.in_channels * itemsize


def _stride_dilate(x, stride):
    """Insert stride-1 zeros between input samples on every spatial axis."""
    for axis, st in enumerate(stride, start=1):
        if st == 1:
            continue
        length = x.shape[axis]
        z = mx.zeros(x.shape, x.dtype)
        x = mx.stack([x] + [z] * (st - 1), axis=axis + 1)
        x = x.reshape(*x.shape[:axis], length * st, *x.shape[axis + 2:])
        x = x[(slice(None),) * axis + (slice(0, (length - 1) * st + 1),)]
    return x


class MlxArrays:
    """mlx.core as the array namespace of convkernels/unfold.py. MLX arrays are row-major to
    their user (as_strided reads its input flattened), so strides are counted on the shape, and
    there is no layout to make contiguous: MLX's matmul reads a transposed view itself.
    `evaluate` runs the lazy graph built so far, one tile at a time, so the bound holds."""

    @staticmethod
    def pad(x, pad_width):
        return mx.pad(x, [tuple(p) for p in pad_width])

    @staticmethod
    def zeros(shape, dtype):
        return mx.zeros(shape, dtype=dtype)

    empty = zeros  # every element of the output is written

    @staticmethod
    def ascontiguousarray(x):
        return x

    matmul_weights = ascontiguousarray

    @staticmethod
    def as_strided(x, shape, strides):
        return mx.as_strided(x, shape, strides)

    @staticmethod
    def strides(x) -> tuple[int, ...]:
        return tuple(prod(x.shape[a + 1:]) for a in range(x.ndim))

    @staticmethod
    def evaluate(x) -> None:
        mx.eval(x)


MLX_ARRAYS = MlxArrays()


def tiled_unfold_conv(x, w, key: ConvKey, limit_bytes: int):
    """Explicit gemm whose unfold buffer is built one tile of output positions at a time, each
    under `limit_bytes` (convkernels/unfold.py). A transposed conv runs as MLX lowers it: the
    forward conv of its stride-dilated input with the flipped kernel."""
    s = key.spec
    if s.transpose:
        lo, hi = forward_padding(key)
        x = _stride_dilate(x, s.stride)
        w = w[(slice(None), *(slice(None, None, -1),) * s.nd)]
        s = ConvSpec((1,) * s.nd, tuple(zip(lo, hi)), s.dilation, s.groups)
    out, _ = conv_unfold_gemm(MLX_ARRAYS, x, w, s, key.out_shape, limit_bytes)
    return out
