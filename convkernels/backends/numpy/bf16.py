"""The NumPy backend's dtype="bfloat16": linear layers (ConvNeXt's MLPs, most of its time) as
bfloat16 products with float32 accumulation on CPUs with AVX512-BF16 (convkernels/_cpu/gemm_bf16.c);
everything else, and every activation between layers, stays float32.

Why only on request: the operands lose their mantissa below 8 bits, so a layer's result moves by
about 2e-3 relative to float32 (gemm_bf16.c's own check: 2.4e-3 on N(0,1) operands), far above
the float32 paths' ~1e-6. A CPU without AVX512-BF16 runs the same layers in float32 (the backend
says so once, in its log, and in describe()).

A weight is packed once into the kernel's bfloat16 pairs and kept while the weight array lives
(keyed by identity: a model's weights are loaded once and never written in place)."""
from __future__ import annotations

import logging
import weakref

import numpy as np

from ... import _cpu
from .fused import ACT_CODES, _f32, _vector

log = logging.getLogger("convkernels")

PANEL = 32  # gemm_bf16.c's GEMM_NR


def available() -> bool:
    """This CPU runs the bfloat16 products (the compiled kernels are there, and AVX512-BF16)."""
    return bool(_cpu.AVAILABLE and getattr(_cpu._kernels, "has_bf16_gemm", lambda: False)())


class Bf16Linear:
    """linear layers as bfloat16 products; `__call__` returns None where it does not apply (the
    backend then runs its float32 linear)."""

    def __init__(self):
        self._packed: dict[int, tuple[weakref.ref, np.ndarray]] = {}

    def packed(self, weight: np.ndarray) -> np.ndarray:
        hit = self._packed.get(id(weight))
        if hit is not None and hit[0]() is weight:
            return hit[1]
        n, k = weight.shape
        out = np.empty(((n + PANEL - 1) // PANEL) * ((k + 1) // 2) * PANEL * 2, np.uint16)
        _cpu._kernels.pack_bf16(np.ascontiguousarray(weight, np.float32), out, n, k)
        self._packed = {key: v for key, v in self._packed.items() if v[0]() is not None}  # forget the dead
        self._packed[id(weight)] = (weakref.ref(weight), out)
        return out

    def __call__(self, x2: np.ndarray, weight: np.ndarray, bias, residual, activation):
        """act(x2 @ weight.T + bias) + residual, x2 (rows, I) float32; None where it does not apply."""
        if activation not in ACT_CODES or not _f32(x2) or not isinstance(weight, np.ndarray) or weight.ndim != 2:
            return None
        rows, (o, i) = x2.shape[0], weight.shape
        if residual is not None:
            if not _f32(residual) or residual.size != rows * o or residual.shape[-1] != o:
                return None
            residual = residual.reshape(rows, o)
        if not _vector(bias, o) or x2.shape[1] != i:
            return None
        out = np.empty((rows, o), np.float32)
        kernels = _cpu._kernels
        kernels.gemm_bf16(x2, self.packed(weight), out, rows, i, o)
        if bias is not None or residual is not None or activation is not None:
            none = np.zeros(1, np.float32)
            kernels.epilogue(out, none if bias is None else bias, none if residual is None else residual, out,
                             bias is not None, residual is not None, rows, o, ACT_CODES[activation])
        return out


def for_dtype(dtype: str) -> Bf16Linear | None:
    """The backend's bfloat16 linear for `dtype`, or None (float32 products)."""
    if dtype != "bfloat16":
        return None
    if not available():
        log.warning("numpy backend: dtype=bfloat16 asked for, but this CPU has no AVX512-BF16 (or the compiled "
                    "kernels are missing): its linear layers run in float32")
        return None
    return Bf16Linear()
