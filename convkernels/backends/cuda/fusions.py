"""Fused ops of the CUDA backend, each behind a CudaOptions switch for A/B runs
(benchmarks/gpu/convnext_fusion_ab.py; the defaults are the measured best). ConvNeXt's block is
depthwise conv -> LayerNorm -> linear + GELU -> linear + residual:

- `depthwise_conv_layer_norm` (the contract's optional capability): LayerNorm(depthwise conv +
  bias) with the conv's bias added by the norm as it reads the conv output (dw_bias_in_ln), or
  conv and norm as one kernel (dw_ln).
- `linear`: act(x @ W^T + bias) + residual as one cuBLASLt call, its epilogue in the gemm
  (lt_epilogues; lt_gelu_approx: cuBLASLt's tanh GELU for erf-GELU layers in float16).
- `rms_norm_affine` (the contract's optional capability, no switch): RMS norm * weight + bias +
  residual in one pass of the RMS kernels, where DC-AE's blocks ran the norm and two adds.

Each returns None where it does not apply; the backend then runs the unfused ops.
"""
from __future__ import annotations

import logging

import numpy as np

from .arrays import STORAGE, dtype_name
from .blas_lt import CublasLt, CublasLtError, lt_epilogue
from .graphs import CaptureMissed
from .kernels import ACT_CODES, BLOCK, dw_ln_applies, grid_blocks

log = logging.getLogger("convkernels.cuda")


class CudaFusions:
    """`conv2d` is the backend's own (its conv preamble and path choice); `count_conv(op, path)`
    counts a conv in the metrics (or lists it, under a CUDA graph capture)."""

    def __init__(self, cp, arrays, capture, options, depthwise_weights, conv2d, count_conv):
        self.cp, self.arrays, self.capture, self.options = cp, arrays, capture, options
        self.depthwise_weights, self.conv2d, self.count_conv = depthwise_weights, conv2d, count_conv
        #: the cuBLASLt handle once made (None: not yet, switched off or unavailable)
        self.lt = None
        self._lt_made = False

    def depthwise_conv_layer_norm(self, x, w, bias, norm_w, norm_b, eps: float):
        """LayerNorm(depthwise 'same' stride-1 conv2d(x, w) + bias) over channels (ConvNeXt's
        block), or None where this does not apply (the caller runs conv2d then layer_norm):
        - dw_ln=True: one kernel (dw_ln; the conv output never goes to memory). Off by
          default: our depthwise kernel against cuDNN's is a measured choice
          (benchmarks/gpu/convnext_fusion_ab.py).
        - else: cuDNN's conv without the bias, which the LayerNorm kernel adds as it reads the
          conv output. A depthwise conv + bias graph may build only unfused (then the bias costs a
          pass of its own) or on a slower fusion engine; the bare depthwise conv is the one
          measured equal to PyTorch's. dw_bias_in_ln=False turns it off."""
        cast = self.arrays.cast
        dt = dtype_name(x)
        if dt not in STORAGE or x.ndim != 4 or w.ndim != 4 or norm_w is None or norm_b is None:
            return None
        c = int(x.shape[-1])
        kernel = (int(w.shape[1]), int(w.shape[2]))
        if tuple(w.shape) != (c, *kernel, 1) or kernel[0] % 2 == 0 or kernel[1] % 2 == 0:
            return None
        x, w = cast(x, dt), cast(w, dt)
        nw, nb, b = cast(norm_w, dt), cast(norm_b, dt), cast(bias, dt)
        if nw.shape != (c,) or nb.shape != (c,) or (b is not None and b.shape != (c,)):
            return None
        pad = (kernel[0] // 2, kernel[1] // 2)
        if self.options.dw_ln:
            ptrs = [v.data.ptr for v in (x, w, nw, nb, b) if v is not None]
            wt = self.depthwise_weights(w) if dw_ln_applies(c, x.itemsize, kernel, tuple(w.shape), ptrs) else None
            if wt is not None and wt.data.ptr % 16 == 0:
                self.count_conv("conv2d", "depthwise_layer_norm")
                return self.arrays.kernels(dt).depthwise_layer_norm(x, wt, b, nw, nb, float(eps), pad)
        if b is None or not self.options.dw_bias_in_ln:
            return None
        h = self.conv2d(x, w, None, padding=pad, groups=c)
        return self.arrays.kernels(dt).layer_norm(self.arrays.contiguous(h), nw, nb, float(eps), None, input_bias=b,
                                                  vectorised=self.options.ln_vec)

    def lt_handle(self):
        """The cuBLASLt fused-linear handle, made on first use outside a capture (its workspace
        must not come from a graph's pool); None where fused linears are off or unavailable.
        lt_epilogues=False turns them off (A/B against gemm + epilogue kernel)."""
        if not self._lt_made:
            self.capture.require_eager("cuBLASLt handle not made yet")
            if self.options.lt_epilogues:
                try:
                    self.lt = CublasLt(self.cp, allow_tf32=self.options.allow_tf32)
                except (OSError, AttributeError, CublasLtError) as exc:  # no library, an old one
                    log.warning("cuBLASLt unavailable (%s): linear layers run gemm + epilogue kernel", exc)
            self._lt_made = True
        return self.lt

    def held_buffers(self) -> list:
        """What a captured graph must hold of these fusions: the cuBLASLt workspace, once made."""
        return [] if self.lt is None else [self.lt.workspace]

    def linear(self, x, weight, bias, residual, activation, dt: str):
        """act(x @ W^T + bias) + residual as one cuBLASLt call, or None (no such epilogue, mixed
        dtypes, cuBLASLt off or without an algorithm): the caller runs gemm + epilogue kernel."""
        if bias is None and residual is None and activation is None:
            return None  # a plain matmul: cuBLAS already does it in one call
        if dt not in STORAGE:
            return None
        lt = self.lt_handle()
        if lt is None:
            return None
        if dt == "float32" and activation in ("gelu", "gelu_tanh"):
            return None  # float32 answers to 1e-5: cuBLASLt's GELU is not promised that close
        # the tanh GELU for erf-GELU layers in float16 (blas_lt.py says why);
        # lt_gelu_approx=False keeps those layers on the exact erf epilogue kernel
        approx = self.options.lt_gelu_approx and dt == "float16"
        epilogue = lt_epilogue(bias is not None, activation, residual is not None, approx)
        if epilogue is None:
            return None
        cast, contiguous = self.arrays.cast, self.arrays.contiguous
        x2 = contiguous(cast(x, dt).reshape(-1, x.shape[-1]))
        w = contiguous(cast(weight, dt))
        b = None if bias is None else contiguous(cast(bias, dt))
        r = None if residual is None else contiguous(cast(residual, dt)).reshape(x2.shape[0], w.shape[0])
        try:
            return lt.linear(x2, w, b, r, epilogue, allow_new=not self.capture.active)
        except LookupError as exc:
            raise CaptureMissed(str(exc)) from exc


def rms_norm_affine(self, x, weight, bias, residual, eps: float):
    """CudaBackend.rms_norm_affine (bound there: self is the backend): one pass of the RMS kernels
    (src/norms.cu); None for a residual of another shape than x (broadcasting is the adds' business)."""
    dt = self.dtype_of(x)
    if dt not in STORAGE or (residual is not None and tuple(residual.shape) != tuple(x.shape)):
        return None
    arrays, cast = self.arrays, self.arrays.cast
    return arrays.kernels(dt).rms_norm(arrays.contiguous(x), cast(weight, dt), eps, None, bias=cast(bias, dt),
                                       residual=cast(residual, dt))


def gated(self, x, activation):
    """CudaBackend.gated (bound there): x[..., :h] * act(x[..., h:]) in one pass of the `gated`
    kernel (src/elementwise.cu), rounded once; None for an odd channel count or an activation
    the kernels lack."""
    dt = self.dtype_of(x)
    if dt not in STORAGE or x.shape[-1] % 2 or activation not in ACT_CODES:
        return None
    x = self.arrays.contiguous(x)
    kern = self.arrays.kernels(dt)
    h = x.shape[-1] // 2
    y = self.cp.empty((*x.shape[:-1], h), dtype=x.dtype)
    n = y.size
    kern.fn("gated")((grid_blocks(n, kern.sm_count),), (BLOCK,),
                     (x, y, np.int64(n), np.int32(h), np.int32(ACT_CODES[activation])))
    return y
