"""Independent references for the op tests: torch.nn.functional on NCHW tensors, with our
channels-last layouts converted at the boundary. Shared by every backend's op tests."""
from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional


def fresh_rng() -> tuple[np.random.Generator, int]:
    """A new seed every run (printed in failures) so the grid explores fresh inputs."""
    seed = int.from_bytes(os.urandom(4), "little")
    return np.random.default_rng(seed), seed


def rel_l2(ours, ref) -> float:
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(ours - ref) / (denom if denom > 0 else 1.0))


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


# Transposed-conv grid shared by every backend's op tests.
# (nd, N, spatial, C_in, C_out, kernel, stride, padding, output_padding, dilation, groups)
CONV_T_CASES = [
    # k4 s2 p1 (the sub-pixel paths): odd channels, non-square, batch 2
    (2, 2, (7, 10), 13, 11, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 1),
    (2, 2, (7, 9), 5, 3, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1),
    (2, 1, (6, 5), 4, 6, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 2),
    (2, 2, (5, 7), 6, 9, (3, 2), (3, 1), (0, 1), (2, 0), (1, 2), 3),
    (2, 1, (9, 11), 3, 3, (3, 3), (1, 1), (1, 1), (0, 0), (2, 2), 1),
    (3, 1, (3, 5, 4), 4, 5, (3, 3, 3), (1, 2, 2), (1, 1, 1), (0, 1, 1), (1, 1, 1), 1),
    (3, 2, (2, 4, 3), 6, 4, (2, 3, 3), (2, 1, 2), (0, 1, 0), (1, 0, 0), (1, 1, 1), 2),
]
