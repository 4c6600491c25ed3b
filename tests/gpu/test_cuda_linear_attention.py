"""ReLU linear attention on the GPU through the CUDA backend's two passes (relu_linear_attention_sums
/ _apply, cuda/src/linear_attention.cu) against the generic route of models/nn/linear_attention.py
on the NumPy backend in float64 terms, from the same stored inputs: float32 within 1e-5, float16 and
bfloat16 within a few of their roundings; odd token counts, a batch, head dimensions of 8, 32
(DC-AE's) and 40. (Whole models: test_dc_ae_gpu.py; row shards: test_row_shard_cuda.py.) Skipped
without a CUDA GPU."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_support import cuda_backend, cuda_or_skip

from convkernels import get_backend
from models.nn.linear_attention import relu_linear_attention
from torch_reference import fresh_rng, rel_l2

pytestmark = pytest.mark.gpu

TOL = {"float32": 1e-5, "float16": 3e-3, "bfloat16": 2e-2}


@pytest.fixture(scope="module", autouse=True)
def cuda_available():
    cuda_or_skip()


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("n,h,w,groups,d", [(2, 7, 9, 3, 8), (1, 33, 31, 4, 32), (1, 5, 61, 2, 40)])
def test_linear_attention_kernels_match_the_generic_route(dtype, n, h, w, groups, d):
    be = cuda_backend(dtype)
    rng, seed = fresh_rng()
    qkv = be.asarray(rng.standard_normal((n, h, w, groups * 3 * d)).astype(np.float32))
    held = be.to_host(qkv).astype(np.float64)  # what the device holds, rounded to its dtype
    assert be.relu_linear_attention_sums(qkv, d, 1.0 / (h * w)) is not None  # the kernels, not the slices
    ours = be.to_host(relu_linear_attention(be, qkv, d))
    assert ours.shape == (n, h, w, groups * d) and be.dtype_of(relu_linear_attention(be, qkv, d)) == dtype
    ref = get_backend("numpy", dtype="float32")
    exact = np.asarray(relu_linear_attention(ref, held.astype(np.float32), d), np.float64)
    err = rel_l2(ours, exact)
    assert err < TOL[dtype], f"seed {seed}: {err:.2e}"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("n,h,w,first,second,d", [(2, 7, 9, 3, 3, 8), (1, 33, 31, 2, 1, 32)])
def test_two_buffers_are_read_as_their_concatenation(dtype, n, h, w, first, second, d):
    """DC-AE's base and multiscale projections, passed as a list: the kernels read both where they
    lie and give what the concatenated buffer gives, to the bit"""
    be = cuda_backend(dtype)
    rng, _ = fresh_rng()
    a, b = (be.asarray(rng.standard_normal((n, h, w, g * 3 * d)).astype(np.float32)) for g in (first, second))
    assert be.relu_linear_attention_sums([a, b], d, 1.0 / (h * w)) is not None
    ours = be.to_host(relu_linear_attention(be, [a, b], d))
    joined = be.to_host(relu_linear_attention(be, be.concat([a, b], axis=-1), d))
    assert ours.shape == (n, h, w, (first + second) * d)
    np.testing.assert_array_equal(ours, joined)
