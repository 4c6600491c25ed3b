"""Independent references for the op tests: torch.nn.functional on NCHW tensors, with our
channels-last layouts converted at the boundary, and the conv grids. Shared by every backend's
op and path tests."""
from __future__ import annotations

import numpy as np
import pytest

from reference_checks import assert_informative, assert_latents_informative, fresh_seed, rel_l2  # noqa: F401 (the parity tests import them from here)

torch = pytest.importorskip("torch")
F = torch.nn.functional


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A new seed every run (printed in failures) so the grid explores fresh inputs."""
    seed = fresh_seed()
    return np.random.default_rng(seed), seed


def to_t(x: np.ndarray):
    """channels-last numpy -> channels-first float64 torch."""
    x = torch.from_numpy(np.asarray(x, dtype=np.float64))
    return x.movedim(-1, 1).contiguous()


def from_t(x) -> np.ndarray:
    return x.movedim(1, -1).contiguous().numpy()


def ref_conv(x, w, bias, stride, padding, dilation, groups, residual=None, activation=None):
    """x: N,*sp,C; w: O,*k,I/g; padding: per-axis (lo, hi)."""
    nd = x.ndim - 2
    xt = to_t(x)
    flat = []
    for lo, hi in reversed(padding):
        flat += [lo, hi]
    xt = F.pad(xt, flat)
    wt = torch.from_numpy(np.asarray(w, np.float64)).movedim(-1, 1).contiguous()
    bt = None if bias is None else torch.from_numpy(np.asarray(bias, np.float64))
    fn = {1: F.conv1d, 2: F.conv2d, 3: F.conv3d}[nd]
    out = fn(xt, wt, bt, stride=stride, dilation=dilation, groups=groups)
    out = ref_activation(out, activation)
    out = from_t(out)
    if residual is not None:
        out = out + residual
    return out


def ref_conv_transpose(x, w, bias, stride, padding, output_padding, dilation, groups):
    """w: ours O,*k,I/g -> torch I,O/g,*k; symmetric padding per axis."""
    nd = x.ndim - 2
    o = w.shape[0]
    cg = w.shape[-1]
    og = o // groups
    wt = np.asarray(w, np.float64).reshape(groups, og, *w.shape[1:-1], cg)
    wt = np.moveaxis(wt, -1, 1)  # g, I/g, O/g, *k
    wt = torch.from_numpy(np.ascontiguousarray(wt.reshape(groups * cg, og, *w.shape[1:-1])))
    bt = None if bias is None else torch.from_numpy(np.asarray(bias, np.float64))
    fn = {2: F.conv_transpose2d, 3: F.conv_transpose3d}[nd]
    return from_t(fn(to_t(x), wt, bt, stride=stride, padding=padding, output_padding=output_padding,
                     groups=groups, dilation=dilation))


def ref_activation(t, activation):
    if activation is None:
        return t
    return {"silu": F.silu, "relu": F.relu, "gelu": F.gelu,
            "gelu_tanh": lambda v: F.gelu(v, approximate="tanh")}[activation](t)


# The conv grids of the op tests (test_ops.py runs them on every backend; the path tests of each
# backend reuse them). Odd sizes and channels, strides, dilations, groups, depthwise, 1-3 spatial dims.
# (nd, N, spatial, C_in, C_out, kernel, stride, padding (lo,hi) per axis, dilation, groups)
CONV_CASES = [
    (1, 2, (37,), 5, 7, (3,), (1,), ((1, 1),), (1,), 1),
    (1, 1, (29,), 6, 9, (5,), (2,), ((2, 0),), (2,), 3),
    (2, 2, (13, 11), 3, 5, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),
    (2, 1, (10, 13), 33, 17, (3, 3), (1, 1), ((1, 1), (1, 1)), (2, 1), 1),  # shift_gemm, dilation
    (2, 2, (9, 14), 37, 33, (3, 3), (1, 1), ((1, 1), (0, 2)), (1, 1), 1),  # winograd, odd tiles
    (2, 1, (16, 7), 32, 45, (3, 3), (1, 1), ((0, 0), (1, 1)), (1, 1), 1),  # winograd, unpadded rows
    (2, 1, (33, 35), 64, 96, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 1),  # tensor-core sized
    (3, 1, (4, 6, 5), 35, 9, (3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (0, 2)), (1, 1, 1), 1),
    # Winograd in space, direct in time (Wan's CausalConv3d): causal time pad, odd tiles, tails
    (3, 2, (3, 9, 7), 33, 35, (3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (0, 2)), (1, 1, 1), 1),
    (3, 1, (1, 11, 6), 40, 32, (1, 3, 3), (1, 1, 1), ((0, 0), (1, 1), (1, 1)), (1, 1, 1), 1),  # first frame
    (3, 1, (4, 6, 10), 32, 48, (2, 3, 3), (1, 1, 1), ((0, 1), (0, 0), (1, 1)), (1, 1, 1), 1),
    (3, 1, (7, 12, 10), 32, 48, (3, 3, 3), (1, 1, 1), ((0, 0), (1, 1), (1, 1)), (1, 1, 1), 1),
    (2, 1, (15, 17), 6, 10, (3, 3), (2, 2), ((0, 1), (0, 1)), (1, 1), 2),  # diffusers' downsample padding
    (2, 2, (19, 9), 8, 8, (3, 5), (1, 2), ((2, 1), (0, 3)), (2, 1), 4),
    (2, 1, (30, 30), 12, 12, (7, 7), (1, 1), ((3, 3), (3, 3)), (1, 1), 12),  # depthwise, not mult of 8
    (2, 2, (15, 15), 9, 9, (3, 3), (2, 2), ((1, 1), (1, 1)), (2, 2), 9),  # depthwise stride 2 dilation 2
    # depthwise with >= 16 channels: the C kernel's register-blocked interior columns, its bounds-
    # checked border columns and its scalar channel tail (40 = 2 vectors + 8)
    (2, 2, (17, 23), 40, 40, (7, 7), (1, 1), ((3, 3), (3, 3)), (1, 1), 40),
    (2, 1, (19, 29), 32, 32, (3, 3), (2, 2), ((1, 0), (2, 1)), (2, 1), 32),
    (2, 1, (11, 37), 48, 48, (5, 5), (1, 1), ((2, 2), (4, 4)), (1, 2), 48),
    (2, 2, (9, 21), 24, 24, (3, 3), (1, 1), ((1, 1), (1, 1)), (1, 1), 24),  # stride-1 kernels: kw 3
    (2, 1, (13, 18), 33, 33, (5, 5), (1, 1), ((4, 0), (2, 2)), (2, 1), 33),  # kw 5, H dilation, tail
    (2, 1, (21, 23), 5, 11, (1, 1), (1, 1), ((0, 0), (0, 0)), (1, 1), 1),  # pointwise
    (2, 2, (12, 13), 3, 7, (4, 4), (4, 4), ((0, 0), (0, 0)), (1, 1), 1),  # patchify stem
    (3, 2, (5, 9, 7), 3, 5, (3, 3, 3), (1, 1, 1), ((2, 0), (1, 1), (1, 1)), (1, 1, 1), 1),  # causal time pad
    (3, 2, (5, 9, 7), 3, 5, (3, 3, 3), (1, 2, 1), ((2, 0), (1, 1), (1, 1)), (1, 1, 2), 1),  # strided, dilated
    (3, 1, (6, 7, 11), 4, 6, (3, 1, 1), (2, 1, 1), ((1, 1), (0, 0), (0, 0)), (1, 1, 1), 2),  # grouped 3D
    (3, 1, (4, 10, 9), 6, 6, (2, 3, 3), (1, 2, 2), ((0, 1), (1, 0), (2, 2)), (1, 2, 1), 6),
]

# (nd, N, spatial, C_in, C_out, kernel, stride, padding, output_padding, dilation, groups)
CONV_T_CASES = [
    # k4 s2 p1 (the sub-pixel paths; what upsample_conv2d runs on mlx and cuda): odd channels,
    # non-square, batch 2
    (2, 2, (7, 10), 13, 11, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1),
    (2, 1, (16, 17), 32, 24, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1),
    (2, 2, (7, 9), 5, 3, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1),
    (2, 1, (6, 5), 4, 6, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 2),
    (2, 2, (5, 7), 6, 9, (3, 2), (3, 1), (0, 1), (2, 0), (1, 2), 3),
    (2, 1, (9, 11), 3, 3, (3, 3), (1, 1), (1, 1), (0, 0), (2, 2), 1),
    (3, 1, (3, 5, 4), 4, 5, (3, 3, 3), (1, 2, 2), (1, 1, 1), (0, 1, 1), (1, 1, 1), 1),
    (3, 2, (2, 4, 3), 6, 4, (2, 3, 3), (2, 1, 2), (0, 1, 0), (1, 0, 0), (1, 1, 1), 2),
]


def conv_id(c) -> str:
    return f"{c[0]}d-{'x'.join(map(str, c[2]))}x{c[3]}-{c[4]}-k{'x'.join(map(str, c[5]))}-s{''.join(map(str, c[6]))}" \
           f"-d{''.join(map(str, c[8]))}-g{c[9]}"


def conv_t_id(c) -> str:
    return f"t{c[0]}d-{'x'.join(map(str, c[2]))}x{c[3]}-{c[4]}-k{'x'.join(map(str, c[5]))}-s{''.join(map(str, c[6]))}" \
           f"-g{c[10]}"
