"""Device arrays of the CUDA backend: its storage dtypes and the casts between them, the
widening of arrays on their way to the host, and weights derived once per weight buffer.

Storage: float16 and float32 are CuPy dtypes; bfloat16 has no CuPy dtype, so bfloat16 tensors
are uint16 arrays of bf16 bit patterns (dtype_name reports 'bfloat16'). Casts from and to
bfloat16, and the widening for the host, run in our kernels (kernels.py).
"""
from __future__ import annotations

from collections import OrderedDict

import numpy as np

from .kernels import BLOCK, STORAGE, Kernels, shuffle_grid
from .transfer import ParallelUpload, PinnedStaging

DTYPE_NAMES = {np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
               np.dtype(np.float64): "float64"}


def dtype_name(x) -> str:
    """numpy-style dtype name of a device array, 'bfloat16' for the uint16 bit patterns."""
    name = DTYPE_NAMES.get(x.dtype)
    return name if name is not None else str(x.dtype)


def storage_dtype(dt: str):
    """The CuPy dtype that stores `dt` (bfloat16: uint16)."""
    return np.uint16 if dt == "bfloat16" else np.dtype(dt)


class CudaArrays:
    """Casts and copies on CuPy arrays in the backend's storage dtypes."""

    def __init__(self, cp):
        self.cp = cp
        self.staging = PinnedStaging(cp)  # host batches stacked in pinned memory (host_batch)
        self.large = ParallelUpload(cp)  # large pageable arrays, copied to pinned memory by several threads

    @staticmethod
    def kernels(dt: str) -> Kernels:
        return Kernels.for_dtype(dt)

    def contiguous(self, x):
        return self.cp.ascontiguousarray(x)

    def cast(self, x, dt: str):
        """x in storage dtype `dt` (contiguous); None stays None."""
        if x is None:
            return None
        if x.dtype == STORAGE[dt] and x.flags.c_contiguous:
            return x
        x = self.contiguous(x)
        src = dtype_name(x)
        if src == dt:
            return x
        if src == "bfloat16":
            x = self.kernels(src).to_f32(x)
        if dt == "bfloat16":
            return self.kernels(dt).from_f32(self.contiguous(x.astype(np.float32, copy=False)), np.uint16)
        return x.astype(dt)

    def f32(self, x):
        return self.cast(x, "float32")

    def from_host(self, host: np.ndarray, dt: str):
        """A floating or uint8 host array -> device array in `dt`. The host array crosses as it is
        (float16, float32, or uint8 8-bit pixels, widened exactly on the device) and is cast on
        the device: NumPy's host-side casts would cost more than the copy."""
        if host.dtype not in (np.float16, np.float32, np.uint8):  # float64, ml_dtypes bfloat16
            host = host.astype(np.float32)
        staged = self.staging.upload(host)  # stacked in a host_batch buffer: one DMA, no host copy
        if staged is None:
            host = np.ascontiguousarray(host)
            staged = self.large.upload(host) if self.large.takes(host) else self.cp.asarray(host)
        return self.cast(staged, dt)

    def widened(self, x, fresh: bool, clip=None):
        """x as contiguous float32 for the host, clipped to clip = (lo, hi) when given; fresh:
        never x itself (its buffer may be reused while an async copy still reads the result).
        Widening on the device: NumPy's float16 -> float32 cast has no SIMD path and cost 4 ms of
        a 9 ms SD-VAE 512 decode on the H100's host; the copy of twice the bytes costs less."""
        if x.dtype == np.float32 and clip is None and not fresh:
            return self.contiguous(x)
        if x.dtype not in STORAGE.values():  # float64 and the like: CuPy's own cast and clip
            y = x.astype(np.float32)
            return y if clip is None else self.cp.clip(y, clip[0], clip[1], out=y)
        return self.kernels(dtype_name(x)).to_f32(self.contiguous(x), clip)

    def as_uint8(self, x):
        """x as a new contiguous uint8 array of 8-bit pixels: pixels_to_uint8 of the float32
        values `widened` would give, in one kernel (float64 and the like: CuPy's cast first)."""
        if x.dtype not in STORAGE.values():
            return self.kernels("float32").to_u8(self.contiguous(x.astype(np.float32)))
        return self.kernels(dtype_name(x)).to_u8(self.contiguous(x))

    def binary(self, a, b, fn):
        """a (op) b with NumPy broadcasting; either side may be a Python scalar. bfloat16 (no
        CuPy dtype) computes in float32 and is stored back as bfloat16: in one elementwise kernel
        (bf16_binary) where both sides are bfloat16 arrays or one is a scalar, else through float32
        copies of both sides. The copies were 28 of a DC-AE 1024^2 bf16 decode's 57 ms of device
        time (one H200, 2026-11-29): its norms' bias and residual adds, its gates' products."""
        bf16 = [getattr(v, "dtype", None) == np.uint16 for v in (a, b)]
        if any(bf16):
            kinds = tuple("bf16" if is_bf16 else "scalar" if not hasattr(v, "dtype") else None
                          for v, is_bf16 in zip((a, b), bf16))
            op = BF16_OPS.get(getattr(fn, "name", None) or getattr(fn, "__name__", ""))
            if op is not None and None not in kinds:
                args = (v if k == "bf16" else np.float32(v) for v, k in zip((a, b), kinds))
                return bf16_binary(self.cp, op, kinds)(*args)
            a, b = (self.f32(v) if hasattr(v, "dtype") else v for v in (a, b))
            return self.cast(fn(a, b), "bfloat16")
        return fn(a, b)

    def pad3(self, x, pads, modes):
        """TensorOps.pad of x (N, *spatial, C), 1 to 3 spatial axes, each with its own mode, in one
        copy (shuffle.cu pad3; seen as N, T, H, W, C). Zero bits are 0.0 in every storage dtype."""
        lead = 3 - len(pads)
        x = self.contiguous(x)
        x5 = x.reshape(x.shape[0], *(1,) * lead, *x.shape[1:])
        pads, modes = ((0, 0),) * lead + tuple(pads), ("zeros",) * lead + tuple(modes)
        n, t, h, w, c = x5.shape
        to, ho, wo = (s + lo + hi for s, (lo, hi) in zip((t, h, w), pads))
        if wo * c >= 2 ** 31:
            raise ValueError(f"pad: a row of {wo} x {c} is beyond the kernel's int32 indices")
        y = self.cp.empty((n, to, ho, wo, c), dtype=x.dtype)
        if y.size:
            kern = self.kernels(dtype_name(x))
            vec = 16 // x.dtype.itemsize
            whole = c % vec == 0 and x.data.ptr % 16 == 0
            rows, units = n * to * ho, wo * c // vec if whole else wo * c
            i32 = np.int32
            code = {"zeros": 0, "replicate": 1, "reflect": 2}
            kern.fn("pad3_vec" if whole else "pad3")(shuffle_grid(rows, units, kern.sm_count), (BLOCK,), (
                x5, y, np.int64(rows), i32(t), i32(h), i32(w), i32(c), i32(to), i32(ho), i32(wo),
                *(i32(lo) for lo, _ in pads), *(i32(code[m]) for m in modes)))
        return y.reshape(y.shape[0], *y.shape[1 + lead:])


#: CuPy's binary ufuncs (by name) that bf16_binary computes, and their C operators
BF16_OPS = {"cupy_add": "+", "cupy_multiply": "*", "cupy_true_divide": "/"}
#: bfloat16 bit patterns to float and back, rounded to nearest even (common.cu's ld / st)
BF16_PREAMBLE = r"""
__device__ __forceinline__ float bf16_ld(unsigned short v) { return __uint_as_float(((unsigned int)v) << 16); }
__device__ __forceinline__ unsigned short bf16_st(float f) {
#if __CUDA_ARCH__ >= 800
    unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h;
#else
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (unsigned short)0x7fc0;
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
#endif
}
"""
_BF16_KERNELS: dict = {}


def bf16_binary(cp, op: str, kinds: tuple):
    """A CuPy ElementwiseKernel computing y = a (op) b on bfloat16 bit patterns in float32 (kinds:
    'bf16' for a uint16 array, 'scalar' for a float32 scalar), broadcasting as NumPy does; one
    rounding to bfloat16, as the float32 route's cast."""
    key = (op, kinds)
    kern = _BF16_KERNELS.get(key)
    if kern is None:
        params = ", ".join(f"{'uint16' if k == 'bf16' else 'float32'} {n}" for k, n in zip(kinds, "ab"))
        a, b = (f"bf16_ld({n})" if k == "bf16" else n for k, n in zip(kinds, "ab"))
        kern = _BF16_KERNELS[key] = cp.ElementwiseKernel(params, "uint16 y", f"y = bf16_st({a} {op} {b});",
                                                         f"bf16_{'xx'.join(kinds)}_{ord(op)}",
                                                         preamble=BF16_PREAMBLE)
    return kern


class DerivedWeights:
    """derive(w), cached per (kind, weight buffer), LRU: a model's weights never change, and
    re-laying them out (depthwise taps, cuDNN's dgrad filter, the upsample conv as a transposed
    one) cost a copy per call. An entry keeps its weight array alive, so the pointer cannot be
    reused by another array while cached. Filled by a model's first (eager) forward, so a CUDA
    graph captured later only reads it; under capture nothing is cached (the derived array lives
    in the graph's pool, and an entry would outlive an evicted graph)."""

    def __init__(self, capture, capacity: int = 512):
        self.capture = capture
        self.capacity = capacity
        self._cache: OrderedDict = OrderedDict()

    def get(self, kind, w, derive):
        k = (kind, w.data.ptr, w.shape, w.dtype.str)
        hit = self._cache.get(k)
        if hit is not None:
            self._cache.move_to_end(k)
            return hit[1]
        wt = derive(w)
        if self.capture.active:
            return wt
        self._cache[k] = (w, wt)
        if len(self._cache) > self.capacity:
            self._cache.popitem(last=False)
        return wt
