"""Linear layers with their bias, activation and residual fused into the GEMM, through
cuBLASLt's C API (ctypes) in the style of blas.py: a ConvNeXt block's two MLP matmuls were
each followed by a separate `epilogue` kernel that read and wrote the whole activation again.
cuBLASLt applies the bias (CUBLASLT_EPILOGUE_BIAS) or bias + GELU
(CUBLASLT_EPILOGUE_GELU_BIAS) in the GEMM's own epilogue, and adds a residual as C with beta = 1
(D = alpha * A B + beta * C + bias, C and D distinct buffers): fc1 and fc2 are one launch each.

cuBLASLt's GELU is the tanh approximation. Layers that ask for the erf GELU (ConvNeXt's) take it
only where the caller allows the approximation (`gelu_approx`): float16 storage, whose rounding
(2^-11 relative) is of the order of the difference (|gelu_erf - gelu_tanh| < 5e-4 over the
reals). bfloat16 and float32 layers keep the erf GELU on the epilogue kernel: in bfloat16 the
approximation's bias added up through a random-weight ConvNeXt to 1.1-1.25e-2 relative L2 on the
logits (exact GELU 0.77e-2; PyTorch's own bf16 run 0.7e-2; H100, 2026-11-25), past the 1e-2 bound.
float32 answers to 1e-5, and cuBLASLt does not document its GELU's accuracy. Bias and residual
fuse in every dtype.

Capture rules (graphs.py): descriptors, layouts, preferences and the heuristic's algorithm
are host objects, created and cached per key on the first (eager) call; a key first seen under
capture raises CaptureMissed. The bias pointer is set on the cached descriptor right before each
call (host state, read at launch). The workspace is this object's own, allocated once, and a
captured graph keeps it alive (CudaBackend.recording_calls).

The pure parts (epilogue choice, layouts from a blas.py GemmPlan, cache key) are tested on the
CPU; the calls themselves in tests/gpu/test_cuda_convnext_fusions.py.
"""
from __future__ import annotations

import ctypes
import logging
import threading
from dataclasses import dataclass

from .blas import (_CUDA_TYPES, COMPUTE_32F, COMPUTE_32F_FAST_TF32, CUDA_R_32F, OP_N, WORKSPACE_BYTES,
                        GemmPlan, load_cuda_library, plan_matmul)

log = logging.getLogger("convkernels.cuda.blaslt")

# cublasLt.h (CUDA 12 and 13; the values are part of the ABI)
DESC_COMPUTE_TYPE, DESC_SCALE_TYPE, DESC_TRANSA, DESC_TRANSB, DESC_EPILOGUE, DESC_BIAS_POINTER = 0, 1, 3, 4, 7, 8
PREF_MAX_WORKSPACE_BYTES = 1
PREF_MIN_ALIGNMENT = {"a": 5, "b": 6, "c": 7, "d": 8}
EPILOGUE_DEFAULT, EPILOGUE_RELU, EPILOGUE_BIAS, EPILOGUE_RELU_BIAS = 1, 2, 4, 6
EPILOGUE_GELU, EPILOGUE_GELU_BIAS = 32, 36
#: cuBLASLt assumes 256-byte aligned buffers unless told otherwise
MAX_ALIGNMENT = 256


def lt_epilogue(has_bias: bool, activation: str | None, has_residual: bool, gelu_approx: bool) -> int | None:
    """The cuBLASLt epilogue computing act(x + bias) (+ residual, as C), or None where it has none:
    silu; erf GELU unless its tanh approximation is allowed; an activation with a residual
    (cuBLASLt activates after adding C, our contract adds the residual after the activation)."""
    if has_residual and activation is not None:
        return None
    act = {None: EPILOGUE_DEFAULT, "relu": EPILOGUE_RELU, "gelu_tanh": EPILOGUE_GELU}.get(activation)
    if activation == "gelu" and gelu_approx:
        act = EPILOGUE_GELU
    if act is None:
        return None
    if not has_bias:
        return act
    return {EPILOGUE_DEFAULT: EPILOGUE_BIAS, EPILOGUE_RELU: EPILOGUE_RELU_BIAS, EPILOGUE_GELU: EPILOGUE_GELU_BIAS}[act]


def alignment(ptr: int) -> int:
    """The largest power of two up to MAX_ALIGNMENT dividing a device address."""
    if ptr == 0:
        return MAX_ALIGNMENT
    return min(MAX_ALIGNMENT, ptr & -ptr)


@dataclass(frozen=True)
class LtLayouts:
    """(rows, cols, ld) of the stored column-major matrices cuBLASLt reads: A (our weight side),
    B (our activation side) and C = D (the output), for a GemmPlan of one matrix."""
    a: tuple[int, int, int]
    b: tuple[int, int, int]
    c: tuple[int, int, int]


def lt_layouts(plan: GemmPlan) -> LtLayouts:
    if plan.batch != 1:
        raise ValueError("cuBLASLt linear: one matrix, not a batch")
    a = (plan.m, plan.k) if plan.op_first == OP_N else (plan.k, plan.m)
    b = (plan.k, plan.n) if plan.op_second == OP_N else (plan.n, plan.k)
    return LtLayouts((*a, plan.ld_first), (*b, plan.ld_second), (plan.m, plan.n, plan.ldc))


def plan_linear(x_shape, x_strides, w_shape, w_strides) -> GemmPlan:
    """x (M, K) @ w (N, K)^T as a blas.py plan (strides in elements); the weight's transpose is
    a view, read as op T."""
    return plan_matmul(tuple(x_shape), tuple(x_strides), (w_shape[1], w_shape[0]), (w_strides[1], w_strides[0]))


@dataclass(frozen=True)
class LtKey:
    """Everything a cached descriptor set and heuristic answer depend on."""
    dtype: int
    compute: int
    plan: GemmPlan
    epilogue: int
    residual: bool
    align: tuple  # (a, b, c, d, bias) in bytes


def lt_key(dtype: int, compute: int, plan: GemmPlan, epilogue: int, residual: bool, ptrs: dict) -> LtKey:
    align = tuple(alignment(ptrs.get(k, 0)) for k in ("a", "b", "c", "d", "bias"))
    return LtKey(dtype, compute, plan, epilogue, residual, align)


# ---- the device side --------------------------------------------------------------------------
class _HeuristicResult(ctypes.Structure):
    _fields_ = [("algo", ctypes.c_uint64 * 8), ("workspaceSize", ctypes.c_size_t), ("state", ctypes.c_int),
                ("wavesCount", ctypes.c_float), ("reserved", ctypes.c_int * 4)]


def load_libcublaslt(cuda_major: int):
    """libcublasLt of this CUDA major: libcublas, loaded first by the backend, brings it in."""
    return load_cuda_library("cublasLt", cuda_major, _declare)


def _declare(lib):
    vp, i32, u64, i64, sz = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint64, ctypes.c_int64, ctypes.c_size_t
    lib.cublasLtCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtDestroy.argtypes = [vp]
    lib.cublasLtMatmulDescCreate.argtypes = [ctypes.POINTER(vp), i32, i32]
    lib.cublasLtMatmulDescSetAttribute.argtypes = [vp, i32, vp, sz]
    lib.cublasLtMatrixLayoutCreate.argtypes = [ctypes.POINTER(vp), i32, u64, u64, i64]
    lib.cublasLtMatmulPreferenceCreate.argtypes = [ctypes.POINTER(vp)]
    lib.cublasLtMatmulPreferenceSetAttribute.argtypes = [vp, i32, vp, sz]
    lib.cublasLtMatmulAlgoGetHeuristic.argtypes = [vp, vp, vp, vp, vp, vp, vp, i32, ctypes.POINTER(_HeuristicResult),
                                                   ctypes.POINTER(i32)]
    lib.cublasLtMatmulPreferenceDestroy.argtypes = [vp]
    lib.cublasLtMatmulDescDestroy.argtypes = [vp]
    lib.cublasLtMatrixLayoutDestroy.argtypes = [vp]
    lib.cublasLtMatmul.argtypes = [vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, vp, sz, vp]
    for name in ("cublasLtCreate", "cublasLtDestroy", "cublasLtMatmulDescCreate", "cublasLtMatmulDescSetAttribute",
                 "cublasLtMatrixLayoutCreate", "cublasLtMatmulPreferenceCreate",
                 "cublasLtMatmulPreferenceSetAttribute", "cublasLtMatmulAlgoGetHeuristic", "cublasLtMatmul",
                 "cublasLtMatmulPreferenceDestroy", "cublasLtMatmulDescDestroy", "cublasLtMatrixLayoutDestroy"):
        getattr(lib, name).restype = ctypes.c_int
    return lib


class CublasLtError(RuntimeError):
    pass


@dataclass
class _Prepared:
    desc: ctypes.c_void_p
    a: ctypes.c_void_p
    b: ctypes.c_void_p
    c: ctypes.c_void_p
    heuristic: _HeuristicResult
    proven: bool = False  # ran once: a later failure is an error, not a missing capability


class CublasLt:
    """One cuBLASLt handle and workspace for one device; fused linear layers. Calls are
    serialised: the cached descriptor's bias pointer is set right before its matmul."""

    def __init__(self, cp, allow_tf32: bool = False):
        self.cp = cp
        self.lib = load_libcublaslt(cp.cuda.runtime.runtimeGetVersion() // 1000)
        self.allow_tf32 = bool(allow_tf32)
        self.handle = ctypes.c_void_p()
        self._check(self.lib.cublasLtCreate(ctypes.byref(self.handle)), "cublasLtCreate")
        self.workspace = cp.empty(WORKSPACE_BYTES, dtype=cp.uint8)
        self._prepared: dict[LtKey, _Prepared | None] = {}
        self._lock = threading.Lock()
        self._one, self._zero = ctypes.c_float(1.0), ctypes.c_float(0.0)

    @staticmethod
    def _check(rc: int, what: str) -> None:
        if rc != 0:
            raise CublasLtError(f"{what} failed with cublasStatus {rc}")

    def linear(self, x, w, bias, residual, epilogue: int, allow_new: bool = True):
        """act(x @ w.T + bias) + residual for contiguous x (M, K), w (N, K), bias (N,), residual
        (M, N), all of one storage dtype; None where cuBLASLt has no algorithm for it (the caller
        takes the unfused path). allow_new=False (under capture) raises LookupError for a key
        not prepared yet."""
        cp = self.cp
        dtype = _CUDA_TYPES.get(x.dtype)
        if dtype is None or w.dtype != x.dtype:
            return None
        isz = x.itemsize
        plan = plan_linear(x.shape, tuple(s // isz for s in x.strides), w.shape, tuple(s // isz for s in w.strides))
        out = cp.empty((x.shape[0], w.shape[0]), dtype=x.dtype)
        if out.size == 0 or plan.k == 0:
            return None
        compute = COMPUTE_32F_FAST_TF32 if (dtype == CUDA_R_32F and self.allow_tf32) else COMPUTE_32F
        c_arr = residual if residual is not None else out
        ptrs = {"a": w.data.ptr, "b": x.data.ptr, "c": c_arr.data.ptr, "d": out.data.ptr,
                "bias": 0 if bias is None else bias.data.ptr}
        key = lt_key(dtype, compute, plan, epilogue, residual is not None, ptrs)
        with self._lock:
            if key not in self._prepared:
                if not allow_new:
                    raise LookupError(f"no cuBLASLt algorithm prepared for {plan}")
                self._prepared[key] = self._prepare(key, ptrs["bias"])
            prep = self._prepared[key]
            if prep is None:
                return None
            if bias is not None:
                bp = ctypes.c_void_p(ptrs["bias"])
                self._check(self.lib.cublasLtMatmulDescSetAttribute(prep.desc, DESC_BIAS_POINTER, ctypes.byref(bp),
                                                                     ctypes.sizeof(bp)), "set bias pointer")
            vp = ctypes.c_void_p
            beta = self._one if residual is not None else self._zero
            rc = self.lib.cublasLtMatmul(
                self.handle, prep.desc, ctypes.byref(self._one), vp(ptrs["a"]), prep.a, vp(ptrs["b"]), prep.b,
                ctypes.byref(beta), vp(ptrs["c"]), prep.c, vp(ptrs["d"]), prep.c, ctypes.byref(prep.heuristic.algo),
                vp(self.workspace.data.ptr), ctypes.c_size_t(self.workspace.nbytes),
                vp(cp.cuda.get_current_stream().ptr))
            if rc != 0 and not prep.proven:
                # the heuristic does not see that C and D are distinct buffers (a residual), and
                # not every algorithm writes out of place: its first (eager) run says so, and
                # this key takes the unfused path from then on (cuDNN plans are treated alike)
                log.info("cuBLASLt: algorithm for %s failed its first run (status %s); unfused path", key, rc)
                self._prepared[key] = None
                return None
            prep.proven = True
        self._check(rc, "cublasLtMatmul")
        return out

    def _prepare(self, key: LtKey, bias_ptr: int) -> _Prepared | None:
        """Descriptors and the heuristic's first algorithm for `key` (host objects, kept for the
        process: one per linear layer shape), or None where cuBLASLt offers none."""
        lib, plan = self.lib, key.plan
        lay = lt_layouts(plan)
        desc = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulDescCreate(ctypes.byref(desc), key.compute, CUDA_R_32F), "MatmulDescCreate")
        attrs = ((DESC_TRANSA, ctypes.c_int32(plan.op_first)), (DESC_TRANSB, ctypes.c_int32(plan.op_second)),
                 (DESC_EPILOGUE, ctypes.c_uint32(key.epilogue)), (DESC_BIAS_POINTER, ctypes.c_void_p(bias_ptr)))
        for attr, value in attrs:
            self._check(lib.cublasLtMatmulDescSetAttribute(desc, attr, ctypes.byref(value), ctypes.sizeof(value)),
                        f"MatmulDescSetAttribute {attr}")
        layouts = []
        for rows, cols, ld in (lay.a, lay.b, lay.c):
            h = ctypes.c_void_p()
            self._check(lib.cublasLtMatrixLayoutCreate(ctypes.byref(h), key.dtype, rows, cols, ld),
                        "MatrixLayoutCreate")
            layouts.append(h)
        pref = ctypes.c_void_p()
        self._check(lib.cublasLtMatmulPreferenceCreate(ctypes.byref(pref)), "MatmulPreferenceCreate")
        ws = ctypes.c_uint64(self.workspace.nbytes)
        self._check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MAX_WORKSPACE_BYTES, ctypes.byref(ws),
                                                             ctypes.sizeof(ws)), "set max workspace")
        for name, align in zip(("a", "b", "c", "d"), key.align):
            v = ctypes.c_uint32(align)
            self._check(lib.cublasLtMatmulPreferenceSetAttribute(pref, PREF_MIN_ALIGNMENT[name], ctypes.byref(v),
                                                                 ctypes.sizeof(v)), f"set {name} alignment")
        result = _HeuristicResult()
        found = ctypes.c_int(0)
        rc = lib.cublasLtMatmulAlgoGetHeuristic(self.handle, desc, layouts[0], layouts[1], layouts[2], layouts[2],
                                                pref, 1, ctypes.byref(result), ctypes.byref(found))
        lib.cublasLtMatmulPreferenceDestroy(pref)  # only the heuristic reads it
        if rc != 0 or found.value < 1 or result.state != 0:
            lib.cublasLtMatmulDescDestroy(desc)
            for h in layouts:
                lib.cublasLtMatrixLayoutDestroy(h)
            log.info("cuBLASLt: no fused algorithm for %s (status %s, %s found); unfused path", key, rc, found.value)
            return None
        return _Prepared(desc, layouts[0], layouts[1], layouts[2], result)

    def close(self) -> None:
        if self.handle:
            self.lib.cublasLtDestroy(self.handle)
            self.handle = ctypes.c_void_p()

