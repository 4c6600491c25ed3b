"""The CUDA backend's bfloat16 add / mul / divide (cuda/arrays.py's bf16_binary: one elementwise
kernel on the bit patterns) equal, bit for bit, the float32 route they replace (both sides widened,
CuPy's float32 op, one rounding back): broadcasting a channel vector, strided channel slices, a
scalar on either side, and inputs that round. Skipped without a CUDA GPU."""
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
