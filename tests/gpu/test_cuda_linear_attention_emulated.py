"""The CUDA backend's kernels for DC-AE: ReLU linear attention, the grouped 1x1 conv and the gate
of a gated linear unit (cuda/src/linear_attention.cu, grouped_pw in depthwise.cu, gated in
elementwise.cu) on the CPU (cuda_emulation.py), where there is no
GPU: la_sums over chunks (the wrapper's la_chunks, with a small GPU's multiprocessor count so a
launch has several chunks), la_apply, and grouped_pw with bias, activation and residual, in the
float32 and bfloat16 builds, against float64 references of the same inputs. Odd token counts
(partial tiles and chunks), head dimensions past one warp, the projections in one buffer or in two
read as their concatenation, groups of unequal in and out widths, a gate over more elements than
the launch has threads.
(tests/gpu/test_cuda_linear_attention.py runs them on a GPU.)"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_emulation import build

from convkernels.backends.cuda.attention import la_chunks
from convkernels.backends.cuda.conv_paths import GP_TT
from torch_reference import F, fresh_rng, torch

RUNNERS = r"""
extern "C" void run_la_sums(const T* qkv, const T* qkv2, float* part, long long tokens, int G, int G1, int d,
                            long long chunk, int chunks, int ng, float scale) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)chunks; grid.y = (unsigned)ng;
    launch(grid, [=] { la_sums(qkv, qkv2, part, tokens, G, G1, d, chunk, scale); });
}
extern "C" void run_la_apply(const T* qkv, const T* qkv2, const float* sums, T* y, long long tokens, int G, int G1,
                             int d, float eps, long long per_block, int ng) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)((tokens + per_block - 1) / per_block); grid.y = (unsigned)ng;
    launch(grid, [=] { la_apply(qkv, qkv2, sums, y, tokens, G, G1, d, eps, per_block); });
}
extern "C" void run_gated(const T* x, T* y, long long n, int h, int a, int blocks) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)blocks;
    launch(grid, [=] { gated(x, y, n, h, a); });
}
extern "C" void run_grouped_pw(const T* x, const T* w, const T* b, const T* r, T* y, long long P, int G, int cg,
                               int og, int has_b, int has_r, int a, int tile) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)((P + tile - 1) / tile); grid.y = (unsigned)G;
    launch(grid, [=] { grouped_pw(x, w, b, r, y, P, G, cg, og, has_b, has_r, a); });
}
"""

P = lambda a: a.ctypes.data_as(ctypes.c_void_p)  # noqa: E731


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def build_of(request, tmp_path_factory):
    return request.param, build(tmp_path_factory, RUNNERS, request.param)


def stored(x: np.ndarray, dtype: str) -> tuple[np.ndarray, np.ndarray]:
    """(the kernel's input buffer, the values it holds as float64)."""
    if dtype == "float32":
        x = np.ascontiguousarray(x, np.float32)
        return x, x.astype(np.float64)
    bits = torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    return np.ascontiguousarray(bits), (bits.astype(np.uint32) << 16).view(np.float32).astype(np.float64)


def loaded(y: np.ndarray, dtype: str) -> np.ndarray:
    return y.astype(np.float64) if dtype == "float32" else (y.astype(np.uint32) << 16).view(np.float32)


def reference(qkv: np.ndarray, d: int, eps: float) -> np.ndarray:
    """diffusers' form in float64: v padded with ones, times relu(k)^T, times relu(q), divided by
    the last row (tokens (N, T, G * 3d) -> (N, T, G * d))."""
    n, t, c = qkv.shape
    x = qkv.reshape(n, t, c // (3 * d), 3 * d)
    q, k, v = np.maximum(x[..., :d], 0), np.maximum(x[..., d:2 * d], 0), x[..., 2 * d:]
    v1 = np.concatenate([v, np.ones_like(v[..., :1])], -1)
    sums = np.einsum("ntgi,ntgj->ngij", k, v1)
    out = np.einsum("ntgi,ngij->ntgj", q, sums)
    return (out[..., :d] / (out[..., d:] + eps)).reshape(n, t, -1)


@pytest.mark.parametrize("n,tokens,groups,d,sms,first", [(2, 63, 3, 8, 6, 3), (1, 301, 2, 40, 3, 2),
                                                           (1, 45, 1, 64, 2, 1), (2, 63, 5, 8, 6, 2),
                                                           (1, 101, 2, 24, 3, 1)])
def test_linear_attention_passes_match_float64(build_of, n, tokens, groups, d, sms, first):
    """first < groups: the projections in two buffers (groups 0..first-1 in the first, the rest in
    the second), read as their concatenation on channels (DC-AE's base and multiscale projections)"""
    dtype, lib = build_of
    rng, seed = fresh_rng()
    buf, exact_in = stored(rng.standard_normal((n, tokens, groups * 3 * d)), dtype)
    # the buffers the kernels read: the whole one, or its two halves each made contiguous
    one = np.ascontiguousarray(buf[..., :first * 3 * d])
    two = np.ascontiguousarray(buf[..., first * 3 * d:]) if first < groups else one
    eps = 1e-15
    chunk, chunks = la_chunks(tokens, n * groups, sms)
    assert chunks > 1 or tokens <= 32, (chunk, chunks)  # the chunks' sum is exercised
    part = np.zeros((n, groups, chunks, d, d + 1), np.float32)
    lib.run_la_sums(P(one), P(two), P(part), ctypes.c_longlong(tokens), groups, first, d, ctypes.c_longlong(chunk),
                    chunks, n * groups, ctypes.c_float(1.0 / tokens))
    sums = np.ascontiguousarray(part.sum(axis=2), np.float32)
    x = exact_in.reshape(n, tokens, groups, 3 * d)
    v1 = np.concatenate([x[..., 2 * d:], np.ones_like(x[..., :1])], -1)
    want = np.einsum("ntgi,ntgj->ngij", np.maximum(x[..., d:2 * d], 0), v1) / tokens
    np.testing.assert_allclose(sums, want, rtol=2e-5, atol=1e-6, err_msg=f"seed {seed}")
    y = np.zeros((n, tokens, groups * d), buf.dtype)
    lib.run_la_apply(P(one), P(two), P(sums), P(y), ctypes.c_longlong(tokens), groups, first, d,
                     ctypes.c_float(eps / tokens), ctypes.c_longlong(64), n * groups)
    got, exact = loaded(y, dtype), reference(exact_in, d, eps)
    err = np.linalg.norm(got - exact) / np.linalg.norm(exact)
    assert err < (1e-6 if dtype == "float32" else 4e-3), f"seed {seed}: {err:.2e}"
    # the tolerance is no blanket: an output off by a factor of two, as a lost normalisation would leave it, fails
    assert np.linalg.norm(got - exact * 2) / np.linalg.norm(exact) > 0.5


@pytest.mark.parametrize("pixels,groups,cg,og,epilogue", [(2 * GP_TT + 7, 3, 5, 7, "bias_silu_residual"),
                                                          (77, 4, 32, 32, "plain"), (9, 2, 64, 64, "bias")])
def test_grouped_pointwise_matches_torch(build_of, pixels, groups, cg, og, epilogue):
    dtype, lib = build_of
    rng, seed = fresh_rng()
    xb, x = stored(rng.standard_normal((pixels, groups * cg)), dtype)
    wb, w = stored(rng.standard_normal((groups * og, cg)) / np.sqrt(cg), dtype)
    bb, b = stored(rng.standard_normal(groups * og), dtype)
    rb, r = stored(rng.standard_normal((pixels, groups * og)), dtype)
    has_b, has_r, act = "bias" in epilogue, "residual" in epilogue, 1 if "silu" in epilogue else 0
    y = np.zeros((pixels, groups * og), xb.dtype)
    lib.run_grouped_pw(P(xb), P(wb), P(bb), P(rb), P(y), ctypes.c_longlong(pixels), groups, cg, og, int(has_b),
                       int(has_r), act, GP_TT)
    xt = torch.from_numpy(x.T.reshape(1, groups * cg, pixels, 1))
    ref = F.conv2d(xt, torch.from_numpy(w.reshape(groups * og, cg, 1, 1)),
                   torch.from_numpy(b) if has_b else None, groups=groups)
    ref = (F.silu(ref) if act else ref).numpy().reshape(groups * og, pixels).T + (r if has_r else 0)
    err = np.linalg.norm(loaded(y, dtype) - ref) / np.linalg.norm(ref)
    assert err < (1e-6 if dtype == "float32" else 4e-3), f"seed {seed}: {err:.2e}"


@pytest.mark.parametrize("rows,h,activation", [(37, 45, "silu"), (5, 300, "gelu"), (1, 7, None)])
def test_gated_matches_torch(build_of, rows, h, activation):
    """y = x[:, :h] * act(x[:, h:]): a grid of 2 blocks, fewer threads than elements (the
    grid-stride loop), odd h, against torch in float64 on the stored values"""
    from convkernels.backends.cuda.kernels import ACT_CODES
    dtype, lib = build_of
    rng, seed = fresh_rng()
    xb, x = stored(rng.standard_normal((rows, 2 * h)) * 2, dtype)
    y = np.zeros((rows, h), xb.dtype)
    lib.run_gated(P(xb), P(y), ctypes.c_longlong(rows * h), h, ACT_CODES[activation], 2)
    gate = torch.from_numpy(x[:, h:])
    gate = {"silu": F.silu, "gelu": F.gelu, None: lambda t: t}[activation](gate).numpy()
    ref = x[:, :h] * gate
    err = np.linalg.norm(loaded(y, dtype) - ref) / np.linalg.norm(ref)
    assert err < (1e-6 if dtype == "float32" else 4e-3), f"seed {seed}: {err:.2e}"
    if activation is not None:  # the halves' roles are told apart (a product alone is symmetric)
        swapped = x[:, h:] * {"silu": F.silu, "gelu": F.gelu}[activation](torch.from_numpy(x[:, :h])).numpy()
        assert np.linalg.norm(loaded(y, dtype) - swapped) / np.linalg.norm(ref) > 0.1
