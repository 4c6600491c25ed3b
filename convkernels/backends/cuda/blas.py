"""Matmul for the CUDA backend through cuBLAS's C API (ctypes), so that it can be captured into a
CUDA graph: CuPy 14 refuses every cuBLAS call while a stream captures (`cp.matmul` and its
low-level `cublas.gemmEx` alike, found by probing captures), which left every model forward uncapturable.

Own handle per backend (one backend per device), its stream set before each call when it
changed, and a workspace of our own (cublasSetStream resets the workspace to cuBLAS's default
pool, which would allocate while a capture runs): a captured graph keeps that workspace alive
the way it keeps the cuDNN workspace. Compute is CUBLAS_COMPUTE_32F for float16, bfloat16 and
float32 storage (float32 accumulate; float32 inputs stay out of TF32 unless allowed).

cuBLAS is column-major; our arrays are row-major. A row-major (M, K) @ (K, N) = (M, N) product is
the column-major (N, K) x (K, M) = (N, M) product of the same buffers, so the operands swap and no
data moves. `plan_matmul` is the pure function that turns row-major shapes and strides (elements)
into the cuBLAS arguments; a transposed view becomes op T, a strided batch one batch stride. The
CPU tests execute its plans with NumPy exactly as cuBLAS reads them
(tests/gpu/test_cuda_blas_logic.py).
"""
from __future__ import annotations

import ctypes
import glob
import os
import threading
from dataclasses import dataclass

import numpy as np

from ...spec import prod

OP_N, OP_T = 0, 1
CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF = 0, 2, 14
COMPUTE_32F, COMPUTE_32F_FAST_TF32 = 68, 77
GEMM_DEFAULT = -1
#: cuBLAS asks for 32 MiB on Hopper (its docs, "cublasSetWorkspace"); 4 MiB suffices before
WORKSPACE_BYTES = 32 << 20

_INT_MAX = 2 ** 31 - 1


@dataclass(frozen=True)
class MatrixLayout:
    """How one operand's matrix (rows, cols) lies in memory, in cuBLAS terms: op N when rows
    are `ld` elements apart and columns adjacent (row-major), op T when columns are `ld` apart
    and rows adjacent (a transposed view); `batch_stride` elements between batch items."""
    op: int
    ld: int
    batch_stride: int


@dataclass(frozen=True)
class GemmPlan:
    """Arguments of one cublasGemmStridedBatchedEx call computing C = A @ B (row-major, C
    contiguous (batch, M, N)) as column-major C^T = B^T A^T: cuBLAS's first operand is our B."""
    m: int          # cuBLAS m = N (columns of C)
    n: int          # cuBLAS n = M (rows of C)
    k: int
    op_first: int   # op of B
    ld_first: int
    stride_first: int
    op_second: int  # op of A
    ld_second: int
    stride_second: int
    ldc: int
    stride_c: int
    batch: int
    batch_shape: tuple


class NeedsCopy(Exception):
    """An operand's layout has no cuBLAS description (negative or irregular strides, a batch
    mixing broadcast and real axes): the caller copies it to a contiguous array and plans again."""

    def __init__(self, operand: str):
        super().__init__(operand)
        self.operand = operand


def matrix_layout(rows: int, cols: int, s_row: int, s_col: int) -> tuple[int, int] | None:
    """(op, ld) of a (rows, cols) matrix with element strides (s_row, s_col), or None. A stride
    along an axis of length 1 is never followed, so it is free."""
    if (cols == 1 or s_col == 1) and (rows == 1 or s_row >= max(1, cols)):
        return OP_N, (s_row if rows > 1 else max(1, cols))
    if (rows == 1 or s_row == 1) and (cols == 1 or s_col >= max(1, rows)):
        return OP_T, (s_col if cols > 1 else max(1, rows))
    return None


def batch_stride(shape, strides) -> int | None:
    """One stride stepping through the flattened batch axes (C order), or None. All-broadcast
    batches (every stride 0) are stride 0."""
    dims = [(d, s) for d, s in zip(shape, strides) if d != 1]
    if not dims:
        return 0
    if all(s == 0 for _, s in dims):
        return 0
    for (d0, s0), (d1, s1) in zip(dims, dims[1:]):
        if s0 != s1 * d1:
            return None
    last = dims[-1][1]
    return last if last > 0 else None


def _operand(name, shape, strides, lead) -> MatrixLayout:
    rows, cols = shape[-2], shape[-1]
    ml = matrix_layout(rows, cols, strides[-2], strides[-1])
    pad = len(lead) - (len(shape) - 2)
    bshape = (1,) * pad + tuple(shape[:-2])
    bstrides = (0,) * pad + tuple(strides[:-2])
    # an axis broadcast to the batch does not advance
    bstrides = tuple(0 if (d == 1 and n != 1) else s for d, n, s in zip(bshape, lead, bstrides))
    bs = batch_stride(lead, bstrides)
    if ml is None or bs is None:
        raise NeedsCopy(name)
    return MatrixLayout(ml[0], ml[1], bs)


def plan_matmul(a_shape, a_strides, b_shape, b_strides) -> GemmPlan:
    """Plan C = A @ B for row-major A (..., M, K), B (..., K, N), strides in elements, batch
    axes broadcast as in np.matmul. Raises NeedsCopy naming an operand cuBLAS cannot read
    in place."""
    if len(a_shape) < 2 or len(b_shape) < 2 or a_shape[-1] != b_shape[-2]:
        raise ValueError(f"matmul: shapes {tuple(a_shape)} and {tuple(b_shape)} do not chain")
    lead = tuple(np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))
    m, k = a_shape[-2], a_shape[-1]
    n = b_shape[-1]
    la = _operand("a", a_shape, a_strides, lead)
    lb = _operand("b", b_shape, b_strides, lead)
    if max(m, n, k, la.ld, lb.ld) > _INT_MAX:
        raise ValueError(f"matmul {tuple(a_shape)} @ {tuple(b_shape)}: a dimension exceeds cuBLAS's int32")
    return GemmPlan(m=n, n=m, k=k, op_first=lb.op, ld_first=lb.ld, stride_first=lb.batch_stride,
                    op_second=la.op, ld_second=la.ld, stride_second=la.batch_stride,
                    ldc=max(1, n), stride_c=m * n, batch=prod(lead), batch_shape=lead)


# ---- the device side --------------------------------------------------------------------------
_CUDA_TYPES = {np.dtype(np.float16): CUDA_R_16F, np.dtype(np.uint16): CUDA_R_16BF, np.dtype(np.float32): CUDA_R_32F}


def load_libcublas(cuda_major: int):
    """libcublas as CuPy loaded it (same soname, so the same library in the process), else any
    libcublas of this CUDA major the usual places hold."""
    try:  # CuPy loads libcublas when this module is imported; dlopen then finds it by soname
        import cupy_backends.cuda.libs.cublas  # noqa: F401
    except Exception:
        pass
    return load_cuda_library("cublas", cuda_major, _declare)


def load_cuda_library(stem: str, cuda_major: int, declare):
    """declare(lib) for lib{stem}.so.{cuda_major}: the one already in the process (dlopen finds
    it by soname), else the NVIDIA wheel's, else the toolkit's."""
    names = [f"lib{stem}.so.{cuda_major}"]
    try:
        from cuda.pathfinder import load_nvidia_dynamic_lib
        names.append(load_nvidia_dynamic_lib(stem).abs_path)
    except Exception:
        pass
    # CUDA_PATH: the toolkit's own convention for where it lives (library discovery, not a
    # convserve setting; docs/interfaces.md lists it as such)
    for root in filter(None, (os.environ.get("CUDA_PATH"), "/usr/local/cuda")):
        names += sorted(glob.glob(os.path.join(root, "lib64", f"lib{stem}.so.{cuda_major}*")))
    errors = []
    for name in names:
        try:
            return declare(ctypes.CDLL(name))
        except OSError as exc:
            errors.append(f"{name}: {exc}")
    raise OSError(f"lib{stem} not found: " + "; ".join(errors))


def _declare(lib):
    vp, i32, i64 = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
    lib.cublasCreate_v2.argtypes = [ctypes.POINTER(vp)]
    lib.cublasDestroy_v2.argtypes = [vp]
    lib.cublasSetStream_v2.argtypes = [vp, vp]
    lib.cublasSetWorkspace_v2.argtypes = [vp, vp, ctypes.c_size_t]
    lib.cublasGemmEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, vp, i32, i32, vp, vp, i32, i32,
                                 i32, i32]
    lib.cublasGemmStridedBatchedEx.argtypes = [vp, i32, i32, i32, i32, i32, vp, vp, i32, i32, i64, vp, i32, i32,
                                               i64, vp, vp, i32, i32, i64, i32, i32, i32]
    for fn in (lib.cublasCreate_v2, lib.cublasDestroy_v2, lib.cublasSetStream_v2, lib.cublasSetWorkspace_v2,
               lib.cublasGemmEx, lib.cublasGemmStridedBatchedEx):
        fn.restype = ctypes.c_int
    return lib


class CublasError(RuntimeError):
    pass


class Cublas:
    """One cuBLAS handle with its own workspace, for one device. Calls are serialised (a handle
    is not safe to share between threads that switch its stream)."""

    def __init__(self, cp, allow_tf32: bool = False):
        self.cp = cp
        self.lib = load_libcublas(cp.cuda.runtime.runtimeGetVersion() // 1000)
        self.allow_tf32 = bool(allow_tf32)
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasCreate_v2(ctypes.byref(self.handle)), "cublasCreate")
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        self._stream = None
        self._lock = threading.Lock()
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise CublasError(f"{what} failed with cublasStatus {rc}")

    def bind(self, stream_ptr: int) -> None:
        """Point the handle at a stream (before a capture begins on it, say)."""
        with self._lock:
            self._bind(stream_ptr)

    def _bind(self, stream_ptr: int) -> None:
        if self._stream == stream_ptr:
            return
        self._check(self.lib.cublasSetStream_v2(self.handle, ctypes.c_void_p(stream_ptr)), "cublasSetStream")
        # setting the stream resets the workspace to cuBLAS's own pool, which allocates on use
        self._check(self.lib.cublasSetWorkspace_v2(self.handle, ctypes.c_void_p(self.workspace.data.ptr),
                                                   ctypes.c_size_t(self.workspace.nbytes)), "cublasSetWorkspace")
        self._stream = stream_ptr

    def matmul(self, a, b, out_dtype=None):
        """a (..., M, K) @ b (..., K, N) in the operands' common storage dtype (float16, bfloat16
        as uint16, float32) -> a new contiguous array, of that dtype or float32 (out_dtype: the
        float32 accumulator kept, not rounded to the operands' dtype)."""
        cp = self.cp
        if a.dtype != b.dtype or a.dtype not in _CUDA_TYPES:
            raise TypeError(f"cuBLAS matmul takes two float16, bfloat16 or float32 operands, got {a.dtype}, {b.dtype}")
        out_dtype = a.dtype if out_dtype is None else np.dtype(out_dtype)
        if out_dtype not in (a.dtype, np.dtype(np.float32)):
            raise TypeError(f"cuBLAS matmul of {a.dtype} operands gives {a.dtype} or float32, not {out_dtype}")
        lead = tuple(np.broadcast_shapes(tuple(a.shape[:-2]), tuple(b.shape[:-2])))
        plan = None
        for _ in range(5):  # at most: copy a, then broadcast it; the same for b; then plan
            try:
                plan = plan_matmul(a.shape, _elements(a), b.shape, _elements(b))
                break
            except NeedsCopy as need:
                if need.operand == "a":
                    a = _copied(cp, a, lead)
                else:
                    b = _copied(cp, b, lead)
        if plan is None:
            raise CublasError(f"no cuBLAS layout for {a.shape} @ {b.shape}")
        out = cp.empty((*plan.batch_shape, plan.n, plan.m), dtype=out_dtype)
        if out.size == 0:
            return out
        if plan.k == 0:
            out.fill(0)
            return out
        self.gemm(plan, b.data.ptr, a.data.ptr, out.data.ptr, _CUDA_TYPES[a.dtype], _CUDA_TYPES[out_dtype])
        return out

    def gemm(self, plan: GemmPlan, first_ptr: int, second_ptr: int, out_ptr: int, dtype: int,
             out_type: int | None = None) -> None:
        """One cuBLAS call of `plan`; operands of `dtype`, the result of `out_type` (the same, or
        CUDA_R_32F for 16-bit operands: a combination cublasGemmEx lists for COMPUTE_32F)."""
        out_type = dtype if out_type is None else out_type
        compute = COMPUTE_32F_FAST_TF32 if (dtype == CUDA_R_32F and self.allow_tf32) else COMPUTE_32F
        one, zero = ctypes.byref(self._one), ctypes.byref(self._zero)
        vp = ctypes.c_void_p
        with self._lock:
            self._bind(self.cp.cuda.get_current_stream().ptr)
            if plan.batch == 1:
                rc = self.lib.cublasGemmEx(self.handle, plan.op_first, plan.op_second, plan.m, plan.n, plan.k, one,
                                           vp(first_ptr), dtype, plan.ld_first, vp(second_ptr), dtype, plan.ld_second,
                                           zero, vp(out_ptr), out_type, plan.ldc, compute, GEMM_DEFAULT)
            else:
                rc = self.lib.cublasGemmStridedBatchedEx(
                    self.handle, plan.op_first, plan.op_second, plan.m, plan.n, plan.k, one,
                    vp(first_ptr), dtype, plan.ld_first, plan.stride_first,
                    vp(second_ptr), dtype, plan.ld_second, plan.stride_second,
                    zero, vp(out_ptr), out_type, plan.ldc, plan.stride_c, plan.batch, compute, GEMM_DEFAULT)
        self._check(rc, "cublasGemmEx")

    def close(self) -> None:
        if self.handle:
            self.lib.cublasDestroy_v2(self.handle)
            self.handle = ctypes.c_void_p()


def _elements(x) -> tuple:
    isz = x.itemsize
    return tuple(s // isz for s in x.strides)


def _copied(xp, x, lead):
    """x contiguous; if it already was, with the matmul's batch broadcast made real (a batch
    mixing broadcast and real axes has no single batch stride)."""
    if not x.flags.c_contiguous:
        return xp.ascontiguousarray(x)
    return xp.ascontiguousarray(xp.broadcast_to(x, (*lead, *x.shape[-2:])))
