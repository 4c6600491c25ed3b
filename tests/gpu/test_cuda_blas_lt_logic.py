"""The pure parts of the cuBLASLt fused linear (convkernels/backends/cuda/blas_lt.py), on the CPU:
which epilogue a layer gets, and the layouts handed to cuBLASLt for x @ W^T, executed here the
way cuBLASLt reads them (column-major stored matrices, ld, op) and checked against
torch.nn.functional.linear. Runs without a GPU."""
from __future__ import annotations

import numpy as np
import pytest

from torch_reference import F, fresh_rng, rel_l2, torch

from convkernels.backends.cuda.blas import OP_N, OP_T
from convkernels.backends.cuda.blas_lt import (EPILOGUE_BIAS, EPILOGUE_DEFAULT, EPILOGUE_GELU, EPILOGUE_GELU_BIAS,
                                               EPILOGUE_RELU, EPILOGUE_RELU_BIAS, MAX_ALIGNMENT, alignment, lt_epilogue,
                                               lt_key, lt_layouts, plan_linear)


def test_epilogue_choice():
    assert lt_epilogue(True, None, False, False) == EPILOGUE_BIAS
    assert lt_epilogue(True, None, True, False) == EPILOGUE_BIAS          # fc2: bias, residual as C
    assert lt_epilogue(False, None, True, False) == EPILOGUE_DEFAULT
    assert lt_epilogue(True, "gelu_tanh", False, False) == EPILOGUE_GELU_BIAS
    assert lt_epilogue(False, "gelu_tanh", False, False) == EPILOGUE_GELU
    assert lt_epilogue(True, "relu", False, False) == EPILOGUE_RELU_BIAS
    # erf GELU only where its tanh approximation is allowed
    assert lt_epilogue(True, "gelu", False, False) is None
    assert lt_epilogue(True, "gelu", False, True) == EPILOGUE_GELU_BIAS
    assert lt_epilogue(True, "silu", False, True) is None
    # cuBLASLt would activate after adding C: an activation with a residual is not fusable
    assert lt_epilogue(True, "gelu_tanh", True, True) is None


def reference_linear(x: np.ndarray, w: np.ndarray, bias, residual, epilogue: int) -> np.ndarray:
    """What cuBLASLt computes for `epilogue`, as its documentation defines the epilogues (float64;
    GELU as its tanh approximation; C with beta = 1 added before the activation)."""
    y = x.astype(np.float64) @ w.astype(np.float64).T
    if epilogue in (EPILOGUE_BIAS, EPILOGUE_RELU_BIAS, EPILOGUE_GELU_BIAS):
        y = y + bias.astype(np.float64)
    if residual is not None:  # C with beta = 1, before the activation
        y = y + residual.astype(np.float64)
    if epilogue in (EPILOGUE_RELU, EPILOGUE_RELU_BIAS):
        y = np.maximum(y, 0.0)
    if epilogue in (EPILOGUE_GELU, EPILOGUE_GELU_BIAS):
        y = 0.5 * y * (1.0 + np.tanh(0.7978845608028654 * (y + 0.044715 * y ** 3)))
    return y


def read_stored(buf, rows, cols, ld):
    """A column-major (rows, cols) matrix with leading dimension ld, as cuBLASLt reads it."""
    assert ld >= rows and (cols - 1) * ld + rows <= buf.size, "layout reads past the buffer"
    return np.lib.stride_tricks.as_strided(buf, shape=(rows, cols), strides=(buf.itemsize, ld * buf.itemsize))


def execute_lt(plan, w_flat, x_flat):
    lay = lt_layouts(plan)
    a = read_stored(w_flat, *lay.a)
    b = read_stored(x_flat, *lay.b)
    op_a = a if plan.op_first == OP_N else a.T
    op_b = b if plan.op_second == OP_N else b.T
    assert op_a.shape == (plan.m, plan.k) and op_b.shape == (plan.k, plan.n)
    d_rows, d_cols, ldc = lay.c
    d = np.zeros(ldc * d_cols)
    read_stored(d, d_rows, d_cols, ldc)[...] = op_a @ op_b
    return d.reshape(d_cols, ldc)[:, :d_rows]  # row-major (M, N)


@pytest.mark.parametrize("m,k,n,row_pitch", [(7, 13, 5, 13), (1, 96, 384, 96), (37, 33, 9, 40), (3, 1, 1, 1)])
def test_layouts_compute_x_times_w_transposed(m, k, n, row_pitch):
    """The plan for x (M, K) (rows `row_pitch` apart) and a contiguous weight (N, K): the weight
    is read as op T, x as op N, the output (M, N) row-major."""
    rng, seed = fresh_rng()
    x_buf = rng.standard_normal(m * row_pitch)
    x = np.lib.stride_tricks.as_strided(x_buf, shape=(m, k), strides=(row_pitch * 8, 8))
    w = rng.standard_normal((n, k))
    plan = plan_linear(x.shape, (row_pitch, 1), w.shape, (k, 1))
    if n > 1 and k > 1:
        assert plan.op_first == OP_T and plan.op_second == OP_N
    ours = execute_lt(plan, w.ravel(), x_buf)
    ref = F.linear(torch.from_numpy(np.ascontiguousarray(x)), torch.from_numpy(w)).numpy()
    assert rel_l2(ours, ref) < 1e-12, f"seed {seed}"


def test_batches_are_refused():
    plan = plan_linear((4, 8), (8, 1), (3, 8), (8, 1))
    with pytest.raises(ValueError):
        lt_layouts(type(plan)(**{**plan.__dict__, "batch": 2}))


@pytest.mark.parametrize("epilogue,activation,has_bias,has_res", [
    (EPILOGUE_BIAS, None, True, True),
    (EPILOGUE_GELU_BIAS, "gelu_tanh", True, False),
    (EPILOGUE_DEFAULT, None, False, True),
])
def test_epilogue_semantics_match_torch(epilogue, activation, has_bias, has_res):
    """What the chosen epilogue computes equals the layer's definition (torch)."""
    rng, seed = fresh_rng()
    x, w = rng.standard_normal((11, 7)), rng.standard_normal((5, 7))
    b, r = rng.standard_normal(5), rng.standard_normal((11, 5))
    assert lt_epilogue(has_bias, activation, has_res, False) == epilogue
    t = F.linear(torch.from_numpy(x), torch.from_numpy(w), torch.from_numpy(b) if has_bias else None)
    if activation:
        t = F.gelu(t, approximate="tanh")
    ref = t.numpy() + (r if has_res else 0)
    ours = reference_linear(x, w, b if has_bias else None, r if has_res else None, epilogue)
    assert rel_l2(ours, ref) < 1e-12, f"seed {seed}"


def test_tanh_gelu_stays_within_half_precision_of_erf_gelu():
    """The bound cuda/blas_lt.py gives for running ConvNeXt's erf GELU as cuBLASLt's tanh GELU."""
    v = torch.linspace(-10, 10, 200001, dtype=torch.float64)
    diff = (F.gelu(v) - F.gelu(v, approximate="tanh")).abs().max().item()
    assert diff < 5e-4, diff


def test_alignment_and_keys():
    assert alignment(0) == MAX_ALIGNMENT and alignment(1 << 20) == MAX_ALIGNMENT
    assert alignment(0x1010) == 16 and alignment(0x1002) == 2
    plan = plan_linear((4, 8), (8, 1), (3, 8), (8, 1))
    ptrs = {"a": 512, "b": 1024, "c": 2048, "d": 2048, "bias": 4096}
    k1 = lt_key(2, 68, plan, EPILOGUE_BIAS, False, ptrs)
    assert k1 == lt_key(2, 68, plan, EPILOGUE_BIAS, False, {**ptrs, "a": 768})       # both 256-aligned
    assert k1 != lt_key(2, 68, plan, EPILOGUE_BIAS, False, {**ptrs, "bias": 4096 + 16})
    assert k1 != lt_key(2, 68, plan, EPILOGUE_GELU_BIAS, False, ptrs)
    assert k1 != lt_key(2, 68, plan, EPILOGUE_BIAS, True, ptrs)
