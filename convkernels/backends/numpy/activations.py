"""Activations of the NumPy backend: exact-erf GELU (the compiled kernel, else a float32 rational
fit of erf over L2-sized chunks, float64 through math.erf), SiLU in place on owned results,
tanh GELU and ReLU."""
from __future__ import annotations

import math

import numpy as np

from ... import _cpu


# erf(z) ~ z * P(z^2) / Q(z^2) on [-4, 4]: the float32 rational fit of Eigen / XLA (no exp).
# The same coefficients are in _cpu/kernels.c; this is the fallback without a compiler.
_ERF_P = (-2.72614225801306e-10, 2.77068142495902e-08, -2.10102402082508e-06, -5.69250639462346e-05,
          -7.34990630326855e-04, -2.95459980854025e-03, -1.60960333262415e-02)
_ERF_Q = (-1.45660718464996e-05, -2.13374055278905e-04, -1.68282697438203e-03, -7.37332916720468e-03,
          -1.42647390514189e-02)
_CHUNK = 1 << 15  # elements per sweep: the temporaries stay in L2


def _gelu_numpy(v: np.ndarray) -> np.ndarray:
    """Exact-erf GELU in float32 over L2-sized chunks, in place on a fresh copy."""
    out = np.array(v, dtype=v.dtype, copy=True).reshape(-1)
    inv_sqrt2 = v.dtype.type(1.0 / math.sqrt(2.0))
    for s in range(0, out.size, _CHUNK):
        x = out[s:s + _CHUNK]
        z = np.clip(x * inv_sqrt2, -4.0, 4.0)
        z2 = z * z
        p = np.full_like(z, _ERF_P[0])
        for coef in _ERF_P[1:]:
            p *= z2
            p += coef
        q = np.full_like(z, _ERF_Q[0])
        for coef in _ERF_Q[1:]:
            q *= z2
            q += coef
        p *= z
        p /= q
        p += 1.0
        p *= 0.5
        x *= p
    return out.reshape(v.shape)


def c_ready(x: np.ndarray) -> bool:
    """Whether the compiled kernels take x as it is (float32, C-contiguous)."""
    return _cpu.AVAILABLE and x.dtype == np.float32 and x.flags.c_contiguous and x.ndim >= 1


def gelu(x: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """GELU(x + bias), exact (erf) form."""
    if c_ready(x) and (bias is None or bias.dtype == np.float32):
        c = x.shape[-1] if x.ndim else 1
        out = np.empty_like(x)
        b = np.ascontiguousarray(bias) if bias is not None else np.zeros(1, np.float32)
        _cpu._kernels.bias_gelu(x, b, out, bias is not None, x.size // max(c, 1), c)
        return out
    if bias is not None:
        x = x + bias
    if x.dtype == np.float64:  # the float32 fit is not good to float64 precision
        return 0.5 * x * (1.0 + np.vectorize(math.erf, otypes=[np.float64])(x / math.sqrt(2.0)))
    return _gelu_numpy(x)


def apply_activation(x: np.ndarray, activation: str | None, owned: bool = False) -> np.ndarray:
    """owned: x is the caller's fresh result, free to overwrite. SiLU then works in place with one
    temporary instead of three (Wan's RMS norm + SiLU held ~3x its output at the memory peak)."""
    if activation is None:
        return x
    with np.errstate(over="ignore"):
        if activation == "silu":
            if not owned:
                return x / (1.0 + np.exp(-x))
            t = np.negative(x)
            np.exp(t, out=t)
            t += 1.0
            return np.divide(x, t, out=x)
        if activation == "gelu":
            return gelu(x)
        if activation == "gelu_tanh":
            c = np.asarray(math.sqrt(2.0 / math.pi), x.dtype)
            return 0.5 * x * (1.0 + np.tanh(c * (x + np.asarray(0.044715, x.dtype) * x * x * x)))
        if activation == "relu":
            return np.maximum(x, 0)
    raise ValueError(f"unknown activation {activation!r}")
