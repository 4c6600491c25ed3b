"""The NumPy backend's normalisations: GroupNorm (with its activation) and LayerNorm in one compiled
pass each where the C extension runs on float32 (norms.c), NumPy's passes otherwise; RMSNorm."""
from __future__ import annotations

import numpy as np

from ... import _cpu
from . import fused
from .activations import apply_activation, c_ready


def as_compute(x):
    """Half inputs upcast to float32 (the compute dtype); float32 and float64 left as they are."""
    x = np.asarray(x)
    if x.dtype in (np.float32, np.float64):
        return x
    return x.astype(np.float32)


def group_norm(x, num_groups, weight, bias, eps, activation):
    x = as_compute(x)
    if c_ready(x) and activation in fused.ACT_CODES:
        n, c = x.shape[0], x.shape[-1]
        out = np.empty_like(x)
        w, b = (np.ascontiguousarray(as_compute(p), np.float32) if p is not None else np.zeros(1, np.float32)
                for p in (weight, bias))
        _cpu._kernels.group_norm(x, w, b, out, weight is not None, bias is not None, n, x.size // (n * c), c,
                                 num_groups, eps, fused.ACT_CODES[activation])
        return out
    n, c = x.shape[0], x.shape[-1]
    xr = x.reshape(n, -1, num_groups, c // num_groups)
    # A group spans every position: float32 sums over tens of thousands of values are off by
    # more than the tolerance of a float32 norm (NumPy's order over two axes is not pairwise), so
    # both moments accumulate in float64, a few buffered chunks at a time (no float64 copy).
    mean = xr.mean(axis=(1, 3), keepdims=True, dtype=np.float64).astype(x.dtype)
    centered = xr - mean
    var = np.square(centered).mean(axis=(1, 3), keepdims=True, dtype=np.float64).astype(x.dtype)
    out = (centered * (1.0 / np.sqrt(var + eps)).astype(x.dtype)).reshape(x.shape)
    if weight is not None:
        out *= as_compute(weight).astype(out.dtype, copy=False)
    if bias is not None:
        out += as_compute(bias).astype(out.dtype, copy=False)
    return apply_activation(out, activation, owned=True)


def layer_norm(x, weight, bias, eps, activation):
    x = as_compute(x)
    if c_ready(x):
        c = x.shape[-1]
        x = np.ascontiguousarray(x)
        out = np.empty_like(x)
        w, b = (np.ascontiguousarray(as_compute(p), np.float32) if p is not None else np.zeros(1, np.float32)
                for p in (weight, bias))
        _cpu._kernels.layer_norm(x, w, b, out, weight is not None, bias is not None, x.size // c, c, eps)
        return apply_activation(out, activation, owned=True)
    mean = x.mean(axis=-1, keepdims=True)
    centered = x - mean
    var = np.square(centered).mean(axis=-1, keepdims=True)
    out = centered * (1.0 / np.sqrt(var + eps)).astype(x.dtype)
    if weight is not None:
        out *= as_compute(weight).astype(out.dtype, copy=False)
    if bias is not None:
        out += as_compute(bias).astype(out.dtype, copy=False)
    return apply_activation(out, activation, owned=True)


def rms_norm(x, weight, eps, activation):
    # direct: one pass for the sum of squares (einsum, no x*x temporary), one to scale;
    # the base class's layer_norm route does about three times the work
    x = as_compute(x)
    if c_ready(x) and activation in fused.ACT_CODES:  # one compiled pass (norms.c)
        return _compiled_rms(x, weight, None, None, eps, activation)
    ms = np.einsum("...c,...c->...", x, x)[..., None] * np.asarray(1.0 / x.shape[-1], x.dtype)
    out = x * (1.0 / np.sqrt(ms + np.asarray(eps, x.dtype)))
    if weight is not None:
        out *= as_compute(weight).astype(out.dtype, copy=False)
    return apply_activation(out, activation, owned=True)


def rms_norm_affine(x, weight, bias, residual, eps):
    """The backend's rms_norm_affine: rms_norm(x, weight) + bias + residual in the compiled pass
    (DC-AE's norms; their two adds were 6 % of a 256^2 decode on two cores); None where it does
    not run (the caller adds)."""
    x = as_compute(x)
    if not c_ready(x) or (residual is not None and (residual.shape != x.shape or not c_ready(residual))):
        return None
    return _compiled_rms(x, weight, bias, residual, eps, None)


def _compiled_rms(x, weight, bias, residual, eps, activation):
    none = np.zeros(1, np.float32)
    w, b = (none if v is None else np.ascontiguousarray(as_compute(v), np.float32) for v in (weight, bias))
    out = np.empty_like(x)
    c = x.shape[-1]
    _cpu._kernels.rms_norm(x, w, b, none if residual is None else residual, out, weight is not None, bias is not None,
                           residual is not None, x.size // c, c, eps, fused.ACT_CODES[activation])
    return out
