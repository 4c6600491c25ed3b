"""The CUDA backend's GroupNorm, LayerNorm, depthwise + LayerNorm and vectorised depthwise
kernels and its 8-bit pixel conversion to_u8 (cuda/kernels.py, the source CuPy compiles) run on the CPU: the
float32 build of the same source, compiled as C++ (cuda_emulation.py), launched with the grid the
backend's wrapper uses (gn_chunks). Checks the thread-to-column mapping, the 16-byte vector
path, groups that split a vector, the chunking and the folded finalize, rows held in registers
across a warp's lanes, against torch.nn.functional, where there is no GPU.
(fp16/bf16 differ only in the load/store conversions and the vector width;
tests/test_ops.py and tests/gpu/test_cuda_convnext_fusions.py run all three on a GPU.)"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_emulation import build

from torch_reference import F, fresh_rng, from_t, ref_activation, ref_conv, rel_l2, to_t, torch

from convkernels.backends.cuda.kernels import (ACT_CODES, BLOCK, DW_TW, LN_MAXV, dw_ln_applies, gn_chunks,
                                               ln_vectorised, rms_vectorised)

#: the launch geometry the emulated GroupNorm uses: an H100's multiprocessor count (the backend
#: reads the device's own; the chunking covers every row for any count)
H100_SMS = 132

RUNNERS = r"""
extern "C" void run_group_norm(const float* x, float* y, double* acc, const float* w, const float* b,
                               int N, long long S, int C, int G, long long rows_per_chunk, int nchunks,
                               double count, float eps, int has_w, int has_b, int a, int vec) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = nchunks; grid.y = N;
    launch(grid, [=] { gn_stats(x, acc, S, C, G, rows_per_chunk, vec); });
    launch(grid, [=] { gn_norm(x, y, acc, w, b, S, C, G, rows_per_chunk, count, eps, has_w, has_b, a, vec); });
}

extern "C" void run_layer_norm(const float* x, float* y, const float* w, const float* b, const float* xb,
                               long long rows, int C, float eps, int a, int vec, int has_xb) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)((rows + BLOCK_THREADS / 32 - 1) / (BLOCK_THREADS / 32));
    if (vec) launch(grid, [=] { ln_rows_vec(x, y, w, b, xb, rows, C, 1, 1, has_xb, eps, a); });
    else launch(grid, [=] { ln_rows(x, y, w, b, xb, rows, C, 1, 1, has_xb, eps, a); });
}

extern "C" void run_rms_norm_vec(const float* x, float* y, const float* w, long long rows, int C, float eps,
                                 int a, long long grp, long long gstride, const float* b, const float* r,
                                 int has_b, int has_r) {
    blockDim.x = BLOCK_THREADS;
    int per_block = BLOCK_THREADS / (C / 4);
    dim3 grid; grid.x = (unsigned)((rows + per_block - 1) / per_block);
    launch(grid, [=] { rms_rows_vec(x, y, w, rows, C, 1, eps, a, grp, gstride, b, r, has_b, has_r); });
}

extern "C" void run_rms_norm(const float* x, float* y, const float* w, long long rows, int C, float eps,
                             int a, long long grp, long long gstride, const float* b, const float* r,
                             int has_b, int has_r) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)((rows + BLOCK_THREADS / 32 - 1) / (BLOCK_THREADS / 32));
    launch(grid, [=] { rms_rows(x, y, w, rows, C, 1, eps, a, grp, gstride, b, r, has_b, has_r); });
}

extern "C" void run_dw_ln(const float* x, const float* wt, const float* bias, const float* nw, const float* nb,
                          float* y, int H, int W, int C, int KH, int KW, float eps, long long pixels) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)((pixels + BLOCK_THREADS / 32 - 1) / (BLOCK_THREADS / 32));
    launch(grid, [=] { dw_ln(x, wt, bias, nw, nb, y, H, W, C, KH, KW, KH / 2, KW / 2, 1, eps, pixels); });
}

extern "C" void run_to_u8(const float* x, unsigned char* y, long long n) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = 2;  // grid-stride: two blocks cover any size
    launch(grid, [=] { to_u8(x, y, n); });
}

// grid-stride kernel: two blocks cover any size (a GPU launches up to 32 per SM)
extern "C" void run_dw2d_vec(const float* x, const float* wt, const float* bias, const float* res, float* y,
                             int H, int W, int C, int OH, int OW, int KH, int KW, int ph, int pw,
                             int has_bias, int has_res, int a, long long items) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = 2;
    launch(grid, [=] { dw2d_vec(x, wt, bias, res, y, H, W, C, OH, OW, KH, KW, ph, pw, has_bias, has_res, a, items); });
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build(tmp_path_factory, RUNNERS)


def group_norm(lib, x, groups, w, b, eps, activation, vec):
    n, c = x.shape[0], x.shape[-1]
    s = x.size // (n * c)
    rows_per_chunk, nchunks = gn_chunks(n, s, H100_SMS)
    x = np.ascontiguousarray(x, np.float32)
    y = np.full_like(x, np.nan)
    acc = np.zeros((n, groups, 2), np.float64)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    lib.run_group_norm(p(x), p(y), p(acc), p(w), p(b), ctypes.c_int(n), ctypes.c_longlong(s), ctypes.c_int(c),
                       ctypes.c_int(groups), ctypes.c_longlong(rows_per_chunk), ctypes.c_int(nchunks),
                       ctypes.c_double(s * (c // groups)), ctypes.c_float(eps), ctypes.c_int(1), ctypes.c_int(1),
                       ctypes.c_int(ACT_CODES[activation]), ctypes.c_int(vec))
    return y, nchunks


@pytest.mark.parametrize("shape,groups,vec", [
    ((2, 5, 7, 12), 3, 1),      # 3 float4 columns per row, 64 rows side by side
    ((1, 9, 11, 8), 4, 1),      # a float4 spans two groups of 2 channels
    ((3, 4, 5, 6), 2, 0),       # channels not a multiple of 4: one channel per thread
    ((1, 130, 1040), 8, 1),     # 260 columns > 256 threads; 130 chunks of one row
    ((2, 33, 20), 5, 0),        # groups of 4 channels, scalar path, odd rows
])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_group_norm_kernels_match_torch(lib, shape, groups, vec, activation):
    rng, seed = fresh_rng()
    c = shape[-1]
    x = (rng.standard_normal(shape) * 3 + 1.5).astype(np.float32)
    w = rng.standard_normal(c).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    ours, nchunks = group_norm(lib, x, groups, w, b, 1e-6, activation, vec)
    ref = from_t(ref_activation(F.group_norm(to_t(x.astype(np.float64)), groups, torch.from_numpy(w.astype(np.float64)),
                                             torch.from_numpy(b.astype(np.float64)), 1e-6), activation))
    assert np.isfinite(ours).all(), "an element was never written"
    assert rel_l2(ours, ref) < 1e-5, f"seed {seed}, {nchunks} chunks"


@pytest.mark.parametrize("sms", [1, 78, H100_SMS, 144])
def test_chunks_cover_every_row_once(sms):
    for n, rows in ((1, 1), (1, 7), (1, 4096), (2, 262144), (128, 3136), (600, 5), (3, 529)):
        per_chunk, chunks = gn_chunks(n, rows, sms)
        assert per_chunk >= 1 and per_chunk * chunks >= rows > per_chunk * (chunks - 1), (n, rows)


@pytest.mark.parametrize("n,h,w,c,k", [(2, 9, 13, 12, 7), (1, 5, 6, 8, 3), (3, 7, 3, 20, 5)])
@pytest.mark.parametrize("epilogue", [False, True])
def test_vectorised_depthwise_matches_torch(lib, n, h, w, c, k, epilogue):
    """dw2d_vec (stride 1, 'same' padding): widths not a multiple of its 4 columns per thread,
    narrower than the kernel, batch > 1; bias + SiLU + residual fused."""
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wd = rng.standard_normal((c, k, k, 1)).astype(np.float32)
    wt = np.ascontiguousarray(wd.reshape(c, -1).T)  # (KH*KW, C), as the backend's _dw_weights
    b = rng.standard_normal(c).astype(np.float32)
    r = rng.standard_normal((n, h, w, c)).astype(np.float32)
    y = np.full_like(x, np.nan)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    items = n * h * -(-w // DW_TW) * (c // 4)
    i32 = ctypes.c_int
    lib.run_dw2d_vec(p(x), p(wt), p(b), p(r), p(y), i32(h), i32(w), i32(c), i32(h), i32(w), i32(k), i32(k),
                     i32(k // 2), i32(k // 2), i32(epilogue), i32(epilogue), i32(ACT_CODES["silu" if epilogue else None]),
                     ctypes.c_longlong(items))
    pad = ((k // 2, k // 2), (k // 2, k // 2))
    ref = ref_conv(x, wd, b if epilogue else None, (1, 1), pad, (1, 1), c, r if epilogue else None,
                   "silu" if epilogue else None)
    assert np.isfinite(y).all(), "an element was never written"
    assert rel_l2(y, ref) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("rows,c", [
    (13, 12),     # 3 float4 vectors per row; the second block's last warps have no row
    (7, 260),     # 65 vectors: lane 0 holds three, the others two
    (9, 4 * 32 * LN_MAXV),  # the widest row the registers hold
    (1, 4),
])
@pytest.mark.parametrize("vec", [1, 0])
@pytest.mark.parametrize("activation,input_bias", [(None, False), ("gelu", False), (None, True)])
def test_layer_norm_kernels_match_torch(lib, rows, c, vec, activation, input_bias):
    """ln_rows_vec (row in registers, 16-byte loads) and ln_rows: odd row counts, rows narrower
    than a warp's vectors, warps without a row, a per-channel bias added before the norm;
    against torch in float64."""
    rng, seed = fresh_rng()
    x = (rng.standard_normal((rows, c)) * 2 + 0.7).astype(np.float32)
    w = rng.standard_normal(c).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    xb = (3 * rng.standard_normal(c)).astype(np.float32)
    y = np.full_like(x, np.nan)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    lib.run_layer_norm(p(x), p(y), p(w), p(b), p(xb), ctypes.c_longlong(rows), ctypes.c_int(c), ctypes.c_float(1e-6),
                       ctypes.c_int(ACT_CODES[activation]), ctypes.c_int(vec), ctypes.c_int(input_bias))
    xin = x.astype(np.float64) + (xb.astype(np.float64) if input_bias else 0.0)
    ref = from_t(ref_activation(F.layer_norm(to_t(xin), (c,), torch.from_numpy(w.astype(np.float64)),
                                             torch.from_numpy(b.astype(np.float64)), 1e-6), activation))
    assert np.isfinite(y).all(), "an element was never written"
    assert rel_l2(y, ref) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("rows,c", [(37, 96), (5, 4 * 256), (23, 12), (64, 4 * 3), (19, 4 * 32), (7, 4 * 128)])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_rms_norm_rows_spread_over_threads_match_torch(lib, rows, c, activation):
    """rms_rows_vec: a row on C/4 consecutive threads of float32 (rows straddling warps: 24
    threads per row, 10 rows per block and 16 threads idle; rows of whole warps, summed by
    shuffles: one row per block at the widest, 8 rows of one warp, 2 rows of 4 warps; a last
    block with fewer rows), Wan's eps, against torch in float64."""
    rng, seed = fresh_rng()
    x = (rng.standard_normal((rows, c)) * rng.uniform(0.1, 10)).astype(np.float32)
    x[0] = 0.0  # a zero row: eps keeps it finite
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    y = np.full_like(x, np.nan)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    eps = 1e-24 / c
    lib.run_rms_norm_vec(p(x), p(y), p(w), ctypes.c_longlong(rows), ctypes.c_int(c), ctypes.c_float(eps),
                         ctypes.c_int(ACT_CODES[activation]), ctypes.c_longlong(rows), ctypes.c_longlong(rows),
                         p(w), p(w), 0, 0)
    ref = from_t(ref_activation(F.rms_norm(torch.from_numpy(x.astype(np.float64)), (c,),
                                           torch.from_numpy(w.astype(np.float64)), eps), activation))
    assert np.isfinite(y).all(), "an element was never written"
    assert rel_l2(y, ref) < 1e-5, f"seed {seed}"


@pytest.mark.parametrize("vec,c", [(True, 96), (True, 12), (False, 13), (False, 96)])
def test_rms_norm_rows_land_in_groups_of_a_larger_buffer(lib, vec, c):
    """The `groups` the backend's rms_norm_rows gives both RMS kernels: x's rows of each frame
    (3 frames of 2 rows x 5 columns, a sharded conv's own band) written as a group every 4 x 5
    rows of the output from row 5 on (the band of a frame of 4 rows, after a halo row), where
    the joined buffer holds them; every other row left as it was."""
    rng, seed = fresh_rng()
    frames, rows, cols, h = 3, 2, 5, 4
    x = rng.standard_normal((frames, rows, cols, c)).astype(np.float32)
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    out = np.full((frames, h, cols, c), np.nan, np.float32)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    run = lib.run_rms_norm_vec if vec else lib.run_rms_norm
    eps = 1e-24 / c
    start = out[:, 1:].ctypes.data  # the first frame's second row: the band after one halo row
    run(p(x), ctypes.c_void_p(start), p(w), ctypes.c_longlong(x.size // c), ctypes.c_int(c), ctypes.c_float(eps),
        ctypes.c_int(ACT_CODES["silu"]), ctypes.c_longlong(rows * cols), ctypes.c_longlong(h * cols), p(w), p(w), 0, 0)
    ref = ref_activation(F.rms_norm(torch.from_numpy(x.astype(np.float64)), (c,),
                                    torch.from_numpy(w.astype(np.float64)), eps), "silu").numpy()
    assert rel_l2(out[:, 1:1 + rows], ref) < 1e-5, f"seed {seed}"
    assert np.isnan(out[:, 0]).all() and np.isnan(out[:, 1 + rows:]).all(), "rows outside the groups were written"


@pytest.mark.parametrize("vec,rows,c", [(True, 37, 96), (True, 5, 4 * 256), (False, 11, 13), (False, 9, 96)])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_rms_norm_adds_bias_and_residual_in_its_pass(lib, vec, rows, c, activation):
    """Both RMS kernels with a bias and a residual (DC-AE's norm before its block's shortcut, the
    backend's rms_norm_affine): act(norm * w + b) + residual, against torch in float64; with
    either left out, the other alone."""
    rng, seed = fresh_rng()
    x, res = (rng.standard_normal((rows, c)).astype(np.float32) for _ in range(2))
    w = rng.uniform(0.5, 1.5, c).astype(np.float32)
    b = rng.standard_normal(c).astype(np.float32)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    run = lib.run_rms_norm_vec if vec else lib.run_rms_norm
    t = lambda a: torch.from_numpy(a.astype(np.float64))
    normed = F.rms_norm(t(x), (c,), t(w), 1e-5)
    for has_b, has_r in ((1, 1), (1, 0), (0, 1)):
        y = np.full_like(x, np.nan)
        run(p(x), p(y), p(w), ctypes.c_longlong(rows), ctypes.c_int(c), ctypes.c_float(1e-5),
            ctypes.c_int(ACT_CODES[activation]), ctypes.c_longlong(rows), ctypes.c_longlong(rows), p(b), p(res),
            has_b, has_r)
        ref = ref_activation(normed + (t(b) if has_b else 0), activation).numpy() + (res if has_r else 0)
        assert rel_l2(y, ref) < 1e-5, f"seed {seed}: bias {has_b}, residual {has_r}"


def test_rms_norm_vector_path_choice():
    """rms_rows_vec where rows are whole 16-byte vectors, at most a block's threads, aligned."""
    assert rms_vectorised(96, 2, [0, 16, 4096])     # Wan's 96 channels in bf16: 12 threads a row
    assert rms_vectorised(384, 2, [0])
    assert rms_vectorised(4 * BLOCK, 4, [0])         # float32, one row per block
    assert not rms_vectorised(4 * BLOCK + 4, 4, [0])
    assert not rms_vectorised(97, 2, [0])            # not whole vectors
    assert not rms_vectorised(96, 2, [0, 8])         # a buffer off 16 bytes


def test_layer_norm_vector_path_choice():
    """ln_rows_vec only where whole 16-byte vectors fit the lanes' registers and every buffer
    is 16-byte aligned."""
    assert ln_vectorised(768, 2, [0, 256, 4096])            # ConvNeXt-T's widest stage, fp16
    assert ln_vectorised(1024, 2, [0, 16])                  # ConvNeXt-B's, fp16
    assert not ln_vectorised(1024, 4, [0])                  # fp32: 256 vectors > 32 * LN_MAXV
    assert not ln_vectorised(100, 2, [0])                   # not whole vectors of 8 halves
    assert not ln_vectorised(96, 2, [0, 8])                 # a buffer off 16 bytes
    assert ln_vectorised(96, 2, [0], rows=3136)             # ConvNeXt-T stage 1 at batch 1
    assert not ln_vectorised(96, 2, [0], rows=100352)       # ... at batch 32: ln_rows measured faster


@pytest.mark.parametrize("n,h,w,c,k", [(2, 5, 7, 12, 7), (1, 9, 4, 260, 3), (3, 3, 3, 8, 7),
                                       (1, 2, 13, 4 * 32 * LN_MAXV, 5)])
def test_depthwise_layer_norm_matches_torch(lib, n, h, w, c, k):
    """dw_ln: LayerNorm(depthwise conv + bias) in one pass; images narrower than the kernel,
    batch > 1, lanes with and without a vector, the widest row; against torch in float64."""
    rng, seed = fresh_rng()
    x = rng.standard_normal((n, h, w, c)).astype(np.float32)
    wd = (rng.standard_normal((c, k, k, 1)) / k).astype(np.float32)
    wt = np.ascontiguousarray(wd.reshape(c, -1).T)  # (KH*KW, C), as the backend's _dw_weights
    b = rng.standard_normal(c).astype(np.float32)
    nw = (1 + 0.3 * rng.standard_normal(c)).astype(np.float32)
    nb = rng.standard_normal(c).astype(np.float32)
    y = np.full_like(x, np.nan)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    i32 = ctypes.c_int
    lib.run_dw_ln(p(x), p(wt), p(b), p(nw), p(nb), p(y), i32(h), i32(w), i32(c), i32(k), i32(k), ctypes.c_float(1e-6),
                  ctypes.c_longlong(n * h * w))
    conv = ref_conv(x, wd, b, (1, 1), ((k // 2, k // 2), (k // 2, k // 2)), (1, 1), c)
    ref = F.layer_norm(torch.from_numpy(conv), (c,), torch.from_numpy(nw.astype(np.float64)),
                       torch.from_numpy(nb.astype(np.float64)), 1e-6).numpy()
    assert np.isfinite(y).all(), "an element was never written"
    assert rel_l2(y, ref) < 1e-5, f"seed {seed}"


def test_depthwise_layer_norm_applies_to_convnext_blocks_only():
    assert dw_ln_applies(96, 2, (7, 7), (96, 7, 7, 1), [0, 16, 32])
    assert dw_ln_applies(1024, 2, (7, 7), (1024, 7, 7, 1), [0])
    assert not dw_ln_applies(96, 2, (7, 7), (96, 7, 7, 2), [0])     # channel multiplier 2
    assert not dw_ln_applies(96, 2, (4, 4), (96, 4, 4, 1), [0])     # even kernel: no 'same' padding
    assert not dw_ln_applies(100, 2, (7, 7), (100, 7, 7, 1), [0])   # not whole vectors
    assert not dw_ln_applies(96, 2, (7, 7), (96, 7, 7, 1), [0, 8])  # a buffer off 16 bytes


def test_to_u8_is_the_host_formula(lib):
    """to_u8 (to_host_async(uint8=True)), float32 build: every edge value of the host formula
    (clip, x * 255 = k + 0.5 boundaries, +-inf) and NaN -> 0, over more elements than two blocks
    of threads, so the grid-stride loop wraps."""
    from pixel_cases import edge_values, host_to_uint8, pixel_array

    x = pixel_array(np.random.default_rng(), (3, 41, 37, 3))
    x.reshape(-1)[-5:] = np.nan
    assert x.size > 2 * BLOCK and x.size > edge_values().size
    y = np.full(x.shape, 77, np.uint8)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    lib.run_to_u8(p(x), p(y), ctypes.c_longlong(x.size))
    np.testing.assert_array_equal(y, host_to_uint8(x))
    assert (y.reshape(-1)[-5:] == 0).all()
