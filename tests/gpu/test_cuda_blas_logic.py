"""cuda.blas.plan_matmul, the row-major -> cuBLAS argument planner the CUDA backend's matmuls go
through: each plan is executed with NumPy exactly as cuBLAS reads its arguments (column-major,
ld, op, batch strides, from the operands' flat buffers) and compared with np.matmul on the same
views. Runs everywhere (no GPU): the same plans drive cublasGemmEx in the op suite on a GPU
(tests/test_ops*.py)."""
from __future__ import annotations

import numpy as np
import pytest

from torch_reference import fresh_rng, rel_l2

from convkernels import ConvSpec
from convkernels.backends.cuda import blas as cuda_blas
from convkernels.backends.cuda.blas import OP_N, OP_T, GemmPlan, NeedsCopy, plan_matmul
from convkernels.unfold import NumpyLike, conv_unfold_gemm

TOL = 1e-12  # float64 on both sides: only summation order differs


def execute_plan_numpy(plan: GemmPlan, first: np.ndarray, first_offset: int, second: np.ndarray,
                       second_offset: int, out_dtype=np.float64) -> np.ndarray:
    """What cuBLAS computes for `plan`, read from flat buffers the way cuBLAS reads them (column
    major, ld, op, batch strides); returns the row-major (batch..., M, N) result."""
    first, second = np.ravel(first), np.ravel(second)
    c = np.zeros(plan.batch * plan.stride_c, dtype=out_dtype)

    def matrix(buf, offset, op, ld, rows, cols):
        # the column-major op(X) of shape (rows, cols): X stored (rows, cols) for N, (cols, rows) for T
        r, cc = (rows, cols) if op == OP_N else (cols, rows)
        if ld < max(1, r):
            raise AssertionError(f"ld {ld} < {r} rows: cuBLAS rejects this plan")
        if offset + (r - 1) + (cc - 1) * ld >= buf.size:
            raise AssertionError("plan reads past the operand's buffer")
        isz = buf.itemsize
        stored = np.lib.stride_tricks.as_strided(buf[offset:], shape=(r, cc), strides=(isz, ld * isz))
        return stored if op == OP_N else stored.T

    for i in range(plan.batch):
        x = matrix(first, first_offset + i * plan.stride_first, plan.op_first, plan.ld_first, plan.m, plan.k)
        y = matrix(second, second_offset + i * plan.stride_second, plan.op_second, plan.ld_second, plan.k, plan.n)
        col = x.astype(np.float64) @ y.astype(np.float64)  # (m, n) column-major: C^T
        dst = np.lib.stride_tricks.as_strided(c[i * plan.stride_c:], shape=(plan.m, plan.n),
                                              strides=(c.itemsize, plan.ldc * c.itemsize))
        dst[...] = col
    return c.reshape(*plan.batch_shape, plan.n, plan.m)


def _strides(x) -> tuple:
    return tuple(s // x.itemsize for s in x.strides)


def _offset(view, base) -> int:
    return (view.__array_interface__["data"][0] - base.__array_interface__["data"][0]) // base.itemsize


def _root(x):
    """The array owning x's memory (a C-contiguous buffer here)."""
    while x.base is not None and isinstance(x.base, np.ndarray):
        x = x.base
    return x


def plan_with_copies(a, b):
    """plan_matmul, copying an operand it cannot read in place as the backend does (a
    contiguous copy; if it was contiguous, one with the batch broadcast made real)."""
    lead = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    for _ in range(5):  # each operand: a contiguous copy, then its batch broadcast made real
        try:
            return plan_matmul(a.shape, _strides(a), b.shape, _strides(b)), a, b
        except NeedsCopy as need:
            x = a if need.operand == "a" else b
            x = (np.ascontiguousarray(x) if not x.flags.c_contiguous else
                 np.ascontiguousarray(np.broadcast_to(x, (*lead, *x.shape[-2:]))))
            a, b = (x, b) if need.operand == "a" else (a, x)
    raise AssertionError("no plan after copying both operands")


def run_planned(a, b):
    """Plan a @ b and run the plan on the operands' flat buffers, as the device would."""
    plan, a, b = plan_with_copies(a, b)
    ra, rb = _root(a), _root(b)
    return plan, execute_plan_numpy(plan, rb, _offset(b, rb), ra, _offset(a, ra))


def operand(rng, shape, kind):
    """A view of `shape` laid out as `kind`: contiguous, a transposed view, a column slice of
    a wider row-major buffer, or a row slice with a gap between batch items."""
    if kind == "contiguous":
        return rng.standard_normal(shape)
    if kind == "transposed":  # stored (..., cols, rows), viewed swapped: cuBLAS op T
        return np.swapaxes(rng.standard_normal((*shape[:-2], shape[-1], shape[-2])), -1, -2)
    if kind == "wide_rows":  # rows further apart than cols: ld > cols
        return rng.standard_normal((*shape[:-1], shape[-1] + 5))[..., 2:2 + shape[-1]]
    if kind == "batch_gap":  # batch items further apart than one matrix
        return rng.standard_normal((*shape[:-2], shape[-2] + 3, shape[-1]))[..., 1:1 + shape[-2], :]
    raise ValueError(kind)


KINDS = ["contiguous", "transposed", "wide_rows", "batch_gap"]
# (a shape, b shape): odd sizes, size-1 rows/cols, batches, broadcast batches
SHAPES = [
    ((7, 5), (5, 9)),
    ((1, 13), (13, 3)),
    ((11, 1), (1, 6)),
    ((9, 4), (4, 1)),
    ((3, 7, 5), (3, 5, 2)),
    ((2, 3, 6, 5), (5, 4)),      # b broadcast over every batch axis: batch stride 0
    ((4, 5), (3, 5, 7)),         # a broadcast
    ((2, 1, 3, 4), (1, 5, 4, 2)),  # both broadcast, each on a different axis
]


@pytest.mark.parametrize("shapes", SHAPES, ids=lambda s: f"{s[0]}x{s[1]}")
@pytest.mark.parametrize("kind_a", KINDS)
@pytest.mark.parametrize("kind_b", KINDS)
def test_plan_executes_like_np_matmul(shapes, kind_a, kind_b):
    rng, seed = fresh_rng()
    a, b = operand(rng, shapes[0], kind_a), operand(rng, shapes[1], kind_b)
    plan, got = run_planned(a, b)
    want = np.matmul(a, b)
    assert got.shape == want.shape
    assert rel_l2(got, want) < TOL, f"seed {seed}, plan {plan}"


def test_views_need_no_copy_and_map_to_the_expected_ops():
    """The layouts the models produce (linear's transposed weight, attention's k^T and query
    chunks) are read in place: op T for a transposed view, the row pitch as ld."""
    rng, _ = fresh_rng()
    w = rng.standard_normal((12, 7))               # linear weight (O, I), used as w.T
    x = rng.standard_normal((5, 7))
    plan = plan_matmul(x.shape, _strides(x), w.T.shape, _strides(w.T))
    assert (plan.op_first, plan.ld_first) == (OP_T, 7) and (plan.op_second, plan.ld_second) == (OP_N, 7)
    assert (plan.m, plan.n, plan.k, plan.batch) == (12, 5, 7, 1)
    k = rng.standard_normal((2, 9, 4))
    q = rng.standard_normal((2, 9, 4))[:, 3:8]     # a query chunk
    plan = plan_matmul(q.shape, _strides(q), np.swapaxes(k, -1, -2).shape, _strides(np.swapaxes(k, -1, -2)))
    assert plan.op_first == OP_T and plan.stride_first == 36 and plan.stride_second == 36 and plan.batch == 2
    _, got = run_planned(q, np.swapaxes(k, -1, -2))
    assert rel_l2(got, q @ np.swapaxes(k, -1, -2)) < TOL


@pytest.mark.parametrize("bad", ["reversed", "both_strided", "mixed_batch"])
def test_layouts_cublas_cannot_read_ask_for_a_copy(bad):
    rng, _ = fresh_rng()
    b = rng.standard_normal((5, 4))
    if bad == "reversed":
        a = rng.standard_normal((3, 5))[:, ::-1]
    elif bad == "both_strided":
        a = rng.standard_normal((6, 10))[::2, ::2]
    else:  # batch axes (2, 3): one real, one broadcast: no single batch stride
        a = np.broadcast_to(rng.standard_normal((2, 1, 3, 5)), (2, 3, 3, 5))
    with pytest.raises(NeedsCopy) as info:
        plan_matmul(a.shape, _strides(a), b.shape, _strides(b))
    assert info.value.operand == "a"


def test_shapes_that_do_not_chain_are_refused():
    with pytest.raises(ValueError):
        plan_matmul((3, 4), (4, 1), (5, 2), (2, 1))


def test_gemm_fallback_conv_through_planned_matmul_matches_torch():
    """gemm_fallback hands its products to the backend's matmul (cuBLAS C API on the GPU); the
    same conv with every product planned and executed as cuBLAS would matches torch."""
    from torch_reference import ref_conv

    rng, seed = fresh_rng()
    x = rng.standard_normal((2, 9, 7, 6)).astype(np.float32)
    w = rng.standard_normal((9, 3, 3, 2)).astype(np.float32)
    spec = ConvSpec.make(2, (2, 1), ((1, 0), (1, 1)), (1, 1), 3)
    out_shape = (2, *spec.output_spatial((9, 7), (3, 3)), 9)
    calls = []

    def planned(p, q):
        calls.append((p.shape, q.shape))
        return run_planned(p, q)[1].astype(np.float32)

    ours, _ = conv_unfold_gemm(NumpyLike(np, contiguous_weights=True), x, w, spec, out_shape, 1 << 30,
                               matmul=planned)
    assert calls, "the conv did not use the matmul it was given"
    assert rel_l2(ours, ref_conv(x, w, None, (2, 1), ((1, 0), (1, 1)), (1, 1), 3)) < 1e-5, f"seed {seed}"


def test_dtype_codes_match_cuda_library_types():
    # cudaDataType / cublasComputeType_t values from library_types.h and cublas_api.h (CUDA 13)
    assert (cuda_blas.CUDA_R_32F, cuda_blas.CUDA_R_16F, cuda_blas.CUDA_R_16BF) == (0, 2, 14)
    assert (cuda_blas.COMPUTE_32F, cuda_blas.COMPUTE_32F_FAST_TF32) == (68, 77)
