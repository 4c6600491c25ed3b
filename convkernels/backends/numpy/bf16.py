"""The NumPy backend's opt-in bfloat16 (`get_backend("numpy", dtype="bfloat16")`), on CPUs with
AVX-512 BF16 (convkernels/_cpu/gemm_bf16.c).

What it changes: the GEMM-shaped products only, the linears (ConvNeXt's MLPs) and the unfolded and
pointwise convs' products, take bfloat16 operands (the weights rounded once when packed, the
activations as each product reads them, both round-to-nearest-even as PyTorch casts) and sum them
in float32. Activations and outputs stay float32 in memory, and every other op (depthwise convs,
norms, attention, and the Winograd paths, whose transforms would amplify bfloat16's rounding: in
float32 F(4x4)'s error is already ~7x F(2x2)'s) computes exactly as in float32. So its error is that of a
bfloat16 matmul with float32 accumulation, about 2^-9 relative per product (tests/test_numpy_bf16.py
states the bounds), well beyond the float32 tests' 1e-5: it is never chosen unless asked for.

Where the CPU lacks the instructions the backend refuses to start, in one line: computing in
float32 instead would silently give the user other numbers (and other speed) than asked for."""
from __future__ import annotations

import numpy as np

from ... import _cpu
from . import fused
from .backend import NumpyBackend
from .path_store import PathStore

#: columns of gemm_bf16.c's panels
NR = 32


def available() -> bool:
    """Whether this CPU (and this build of the compiled kernels) runs the bfloat16 tiles."""
    k = _cpu._kernels
    return bool(_cpu.AVAILABLE and hasattr(k, "gemm_bf16_available") and k.gemm_bf16_available())


def bf16_round(x: np.ndarray) -> np.ndarray:
    """finite float32 -> the nearest bfloat16 (ties to even), returned as float32: what the tiles multiply"""
    u = np.ascontiguousarray(x, np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16 << 16).astype(np.uint32)
    return u.view(np.float32).reshape(np.shape(x))


def pack_panels(weight: np.ndarray) -> np.ndarray:
    """A linear's (O, I) float32 weight as gemm_bf16.c's panels: per 32 columns and pair of inputs,
    the pair's two bfloat16 side by side (vdpbf16ps's operand), zeros past O and an odd I"""
    n, k = weight.shape
    size = -(-n // NR) * ((k + 1) // 2) * 2 * NR
    buf = np.empty(size + 32, np.uint16)  # from a 64-byte line, as fused.aligned_empty does for float32
    out = buf[(-buf.ctypes.data % 64) >> 1:][:size]
    _cpu._kernels.pack_weight_bf16(np.ascontiguousarray(weight, np.float32), out, n, k)
    return out


def linear(x2: np.ndarray, weight: np.ndarray, bias, residual, activation: str | None, packed, out=None):
    """act(x2 @ weight.T + bias) + residual with bfloat16 operands and float32 sums; None where
    the tiles do not take it (another dtype, a broadcast residual, an unknown activation): the
    float32 path then runs it. `out`: a C-contiguous float32 (rows, O) to write, else a new array
    (fused.linear's contract, so fused.mlp's row blocks can take this product)."""
    if activation not in fused.ACT_CODES or not fused._f32(x2) or weight.dtype != np.float32 or weight.ndim != 2:
        return None
    rows, o = x2.shape[0], weight.shape[0]
    if residual is not None:
        if not fused._f32(residual) or residual.size != rows * o or residual.shape[-1] != o:
            return None
        residual = residual.reshape(rows, o)
    if not fused._vector(bias, o) or x2.shape[1] != weight.shape[1] or rows == 0:
        return None
    none = np.zeros(1, np.float32)
    out = fused.aligned_empty((rows, o)) if out is None else out
    _cpu._kernels.gemm_bf16(x2, packed(weight), none if bias is None else bias,
                            none if residual is None else residual, out, rows, x2.shape[1], o,
                            bias is not None, residual is not None, fused.ACT_CODES[activation])
    return out


class NumpyBf16Backend(NumpyBackend):
    """The NumPy backend with its GEMM-shaped products in bfloat16 (see the module's docstring);
    get_backend("numpy", dtype="bfloat16") builds it."""

    supported_dtypes = ("bfloat16",)

    def __init__(self, dtype: str = "bfloat16", **options):
        if dtype == "bfloat16" and not available():
            raise ValueError("numpy backend: dtype bfloat16 needs a CPU with AVX-512 BF16 (vdpbf16ps) and the "
                             "compiled kernels; this one has none (use float32)")
        super().__init__(dtype, **options)

    def measure_paths(self):
        # a conv's stored choice is keyed by its input's dtype, float32 here too: bfloat16's choices
        # go to a file of their own, so neither dtype reads the other's timings
        if self.path_store is not None:
            self.path_store = PathStore(self.path_store.dir, {**self.path_store.fingerprint, "dtype": "bfloat16"})
        return super().measure_paths()

    def _compute_dtype(self, dt) -> np.dtype:
        # activations stay float32 in memory (NumPy has no bfloat16 of its own)
        return super()._compute_dtype("float32" if str(dt) == "bfloat16" else dt)

    def _pack_bf16(self, w: np.ndarray) -> np.ndarray:
        """a linear's (O, I) weight as bfloat16 panels, packed once per weight buffer"""
        return self._wino_cache(w, pack_panels)

    def prepare_linear(self, weight) -> None:
        """at load, the bfloat16 panels each call would pack (the float32 ones are never used here)"""
        self._pack_bf16(self._f(weight))

    def _prepare_gemm(self, w, key):
        """at load, a pointwise or unfolded conv's (O, k C) weight as _tiles_matmul packs it"""
        if key.spec.groups == 1 and not key.spec.transpose:
            self._pack_bf16(self._f(w).reshape(w.shape[0], -1))

    def _block_products(self) -> tuple:
        """ConvNeXt's stage calls and row-blocked MLPs multiply in bfloat16, as its linears do"""
        return self._pack_bf16, True, linear

    def _linear_run(self, x, weight, bias, residual, activation):
        xs, w = self._operands(x, weight)
        x2 = xs.reshape(-1, xs.shape[-1])
        b = None if bias is None else self._f(bias).astype(x2.dtype, copy=False)
        out = linear(x2, w, b, None if residual is None else self._f(residual), activation, self._pack_bf16)
        if out is None:
            return super()._linear_run(x, weight, bias, residual, activation)
        return out.reshape(*xs.shape[:-1], w.shape[0])

    def _tiles_matmul(self, a: np.ndarray, wt: np.ndarray) -> np.ndarray:
        """a @ wt for the pointwise and unfolded convs (wt a weight's transposed view)"""
        out = linear(a, wt.T, None, None, None, self._pack_bf16) if a.ndim == 2 else None
        return super()._tiles_matmul(a, wt) if out is None else out
