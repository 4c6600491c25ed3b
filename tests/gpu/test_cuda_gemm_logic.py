"""The gemm_fallback algorithm of the CUDA backend (cuda_gemm.py) run with NumPy as its array
module, against torch.nn.functional in float64 -> fp32 tolerance. Runs everywhere (no GPU):
the same code runs on CuPy in test_cuda_ops.py."""
from __future__ import annotations

import numpy as np
import pytest

from torch_reference import fresh_rng, ref_conv, ref_conv_transpose, rel_l2

from convkernels import ConvSpec
from convkernels.backends import cuda_gemm

TOL = 1e-5

# (nd, N, spatial, C_in, C_out, kernel, stride, padding (lo,hi), dilation, groups)
FORWARD = [
    (1, 2, (23,), 5, 7, (3,), (2,), ((2, 0),), (1,), 1),
    (2, 2, (13, 11), 6, 9, (3, 3), (2, 2), ((0, 1), (1, 0)), (1, 1), 3),
    (2, 1, (15, 17), 7, 7, (5, 5), (1, 1), ((2, 2), (2, 2)), (2, 1), 7),  # depthwise, dilation
    (3, 1, (5, 9, 7), 3, 5, (3, 3, 3), (1, 2, 1), ((2, 0), (1, 1), (1, 1)), (1, 1, 1), 1),
]


@pytest.mark.parametrize("case", FORWARD, ids=lambda c: f"{c[0]}d-g{c[9]}")
@pytest.mark.parametrize("limit", [1 << 30, 600], ids=["whole", "tiled"])
def test_forward_matches_torch(case, limit):
    nd, n, sp, cin, cout, k, stride, pad, dil, g = case
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    spec = ConvSpec.make(nd, stride, pad, dil, g)
    out_shape = (n, *spec.output_spatial(sp, k), cout)
    ours, tiled = cuda_gemm.conv_forward(np, x, w, spec, out_shape, limit)
    assert tiled == (limit < cuda_gemm.unfold_bytes(x.shape, w.shape, out_shape, spec))
    assert rel_l2(ours, ref_conv(x, w, None, stride, pad, dil, g)) < TOL, f"seed {seed}"


# (nd, N, spatial, C_in, C_out, kernel, stride, padding, output_padding, dilation, groups)
TRANSPOSED = [
    (2, 2, (7, 9), 5, 3, (3, 3), (2, 2), (1, 1), (1, 1), (1, 1), 1),
    (2, 1, (6, 5), 4, 6, (4, 4), (2, 2), (1, 1), (0, 0), (1, 1), 2),
    (3, 1, (3, 5, 4), 4, 5, (3, 3, 3), (1, 2, 2), (1, 1, 1), (0, 1, 1), (1, 1, 1), 1),
]


@pytest.mark.parametrize("case", TRANSPOSED, ids=lambda c: f"t{c[0]}d-g{c[10]}")
@pytest.mark.parametrize("limit", [1 << 30, 400], ids=["whole", "tiled"])
def test_transpose_matches_torch(case, limit):
    nd, n, sp, cin, cout, k, stride, pad, opad, dil, g = case
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, *sp, cin)).astype(np.float32)
    w = rng.standard_normal((cout, *k, cin // g)).astype(np.float32)
    spec = ConvSpec.make(nd, stride, pad, dil, g, transpose=True, output_padding=opad)
    out_shape = (n, *spec.output_spatial(sp, k), cout)
    ours, tiled = cuda_gemm.conv_transpose(np, x, w, spec, out_shape, limit)
    assert tiled == (limit < cuda_gemm.unfold_bytes(x.shape, w.shape, out_shape, spec))
    ref = ref_conv_transpose(x, w, None, stride, pad, opad, dil, g)
    assert rel_l2(ours, ref) < TOL, f"seed {seed}"
