"""The CUDA backend's bfloat16 add / mul / divide (cuda/arrays.py's bf16_binary: one elementwise
kernel on the bit patterns) equal, bit for bit, the float32 route they replace (both sides widened,
CuPy's float32 op, one rounding back): broadcasting a channel vector, strided channel slices, a
scalar on either side, and inputs that round; and the gate of a gated linear unit in one kernel. Skipped
without a CUDA GPU."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_support import cuda_backend, cuda_or_skip

from torch_reference import fresh_rng

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module", autouse=True)
def cuda_available():
    cuda_or_skip()


@pytest.mark.parametrize("op", ["add", "mul", "divide"])
def test_bf16_binary_equals_the_float32_route(op):
    be = cuda_backend("bfloat16")
    cp, arrays = be.cp, be.arrays
    ufunc = {"add": cp.add, "mul": cp.multiply, "divide": cp.true_divide}[op]
    rng, seed = fresh_rng()
    x = be.asarray(rng.standard_normal((2, 7, 9, 48)).astype(np.float32) * 3)
    bias = be.asarray(rng.standard_normal(48).astype(np.float32) + 2.5)
    y = be.asarray(rng.standard_normal((2, 7, 9, 48)).astype(np.float32) + 0.1)
    left, right = be.slice(x, -1, 0, 24), be.slice(y, -1, 24, 48)  # channel slices: strided views
    for a, b in ((x, bias), (x, y), (left, right), (x, 1.0 / 3.0), (0.75, y)):
        ours = getattr(be, op)(a, b)
        wide = [arrays.f32(v) if hasattr(v, "dtype") else v for v in (a, b)]
        want = arrays.cast(ufunc(*wide), "bfloat16")
        assert ours.dtype == np.uint16 and ours.shape == want.shape
        assert cp.array_equal(ours, want), f"seed {seed}: {op} of {getattr(a, 'shape', a)}, {getattr(b, 'shape', b)}"


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_gated_is_the_sliced_route_rounded_once(dtype):
    """gated (one kernel over a gated linear unit's halves, DC-AE's GLUMBConv) against the route
    it replaces (slice, SiLU, multiply), both from the same stored values, in float64 terms: within
    the two roundings of the sliced route"""
    be = cuda_backend(dtype)
    rng, seed = fresh_rng()
    x = be.asarray(rng.standard_normal((2, 7, 9, 2 * 45)).astype(np.float32) * 2)
    ours = be.gated(x, "silu")
    assert ours is not None and be.dtype_of(ours) == dtype and ours.shape == (2, 7, 9, 45)
    sliced = be.mul(be.slice(x, -1, 0, 45), be.silu(be.slice(x, -1, 45, 90)))
    held = be.to_host(x).astype(np.float64)
    exact = held[..., :45] * held[..., 45:] / (1 + np.exp(-held[..., 45:]))
    tol = {"float32": 1e-6, "float16": 2e-3, "bfloat16": 1.5e-2}[dtype]
    for got in (ours, sliced):
        err = np.linalg.norm(be.to_host(got).astype(np.float64) - exact) / np.linalg.norm(exact)
        assert err < tol, f"seed {seed}: {err:.2e}"
