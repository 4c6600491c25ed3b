"""The NumPy backend's dtype="bfloat16" (convkernels/_cpu/gemm_bf16.c via backends/numpy/bf16.py):
linear layers as bfloat16 products with float32 accumulation on CPUs with AVX512-BF16.

- the kernel equals torch's float64 product of the same operands rounded to bfloat16 (so its
  only error is float32 accumulation), at odd sizes that leave tails in every direction of its
  8-row x 32-column tiles, and odd K (a half pair);
- through the backend: bias, GELU/SiLU and a residual after it, equal to torch on the rounded
  operands, and within bfloat16's error of the float32 linear (stated: about 2e-3);
- a packed weight is reused while its array lives, and a new array is packed anew;
- on a CPU without AVX512-BF16 (or without the compiled kernels) dtype=bfloat16 is float32's
  linear, bit for bit (the CI machines vary: some days an EPYC without it).
"""
from __future__ import annotations

import numpy as np
import pytest

from torch_reference import F, fresh_rng, rel_l2, torch

from convkernels import _cpu, get_backend
from convkernels.backends.numpy import bf16

needs_bf16 = pytest.mark.skipif(not bf16.available(), reason="this CPU has no AVX512-BF16 (or no compiled kernels)")


def rounded(a) -> torch.Tensor:
    """a rounded to bfloat16 (nearest even, as the kernel does), in float64"""
    return torch.from_numpy(np.asarray(a, np.float32)).to(torch.bfloat16).to(torch.float64)


@needs_bf16
@pytest.mark.parametrize("m,k,n", [(1, 1, 1), (7, 5, 3), (17, 33, 65), (9, 96, 31), (203, 97, 130)])
def test_the_kernel_is_the_rounded_operands_product(m, k, n):
    rng, seed = fresh_rng()
    a = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    out = np.full((m, n), np.nan, np.float32)
    _cpu._kernels.gemm_bf16(a, bf16.Bf16Linear().packed(w), out, m, k, n)
    ref = (rounded(a) @ rounded(w).T).numpy()
    assert rel_l2(out, ref) < 1e-6, f"seed {seed}"
    assert rel_l2(out, a.astype(np.float64) @ w.T.astype(np.float64)) > 1e-4  # it is bfloat16: not float32's


@needs_bf16
@pytest.mark.parametrize("activation", [None, "gelu", "silu"])
def test_the_backend_linear_in_bfloat16(activation):
    rng, seed = fresh_rng()
    be, be32 = get_backend("numpy", dtype="bfloat16"), get_backend("numpy")
    x = rng.standard_normal((2, 7, 9, 45)).astype(np.float32)
    w = (rng.standard_normal((70, 45)) / 6).astype(np.float32)
    bias = rng.standard_normal(70).astype(np.float32)
    res = rng.standard_normal((2, 7, 9, 70)).astype(np.float32)
    ours = be.linear(be.asarray(x), w, bias, residual=res, activation=activation)
    assert ours.dtype == np.float32 and ours.shape == res.shape
    y = F.linear(rounded(x), rounded(w), torch.from_numpy(bias.astype(np.float64)))
    y = {None: y, "gelu": F.gelu(y), "silu": F.silu(y)}[activation] + torch.from_numpy(res.astype(np.float64))
    assert rel_l2(ours, y.numpy()) < 1e-6, f"seed {seed}"
    err32 = rel_l2(ours, be32.linear(be32.asarray(x), w, bias, residual=res, activation=activation))
    assert 1e-5 < err32 < 1e-2, f"seed {seed}: {err32:.2e} from float32"


@needs_bf16
def test_a_weight_is_packed_once_while_it_lives():
    lin = bf16.Bf16Linear()
    w = np.ones((40, 9), np.float32)
    first = lin.packed(w)
    assert lin.packed(w) is first
    other = np.full((40, 9), 2.0, np.float32)
    assert lin.packed(other) is not first


def test_without_avx512_bf16_bfloat16_is_the_float32_linear(monkeypatch):
    monkeypatch.setattr(bf16, "available", lambda: False)
    be, be32 = get_backend("numpy", dtype="bfloat16"), get_backend("numpy")
    assert be.bf16_linear is None and be.dtype == "bfloat16"
    rng, _ = fresh_rng()
    x = rng.standard_normal((3, 5, 16)).astype(np.float32)
    w = rng.standard_normal((24, 16)).astype(np.float32)
    assert np.array_equal(be.linear(be.asarray(x), w, activation="gelu"), be32.linear(be32.asarray(x), w, activation="gelu"))
