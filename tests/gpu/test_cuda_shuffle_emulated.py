"""The CUDA backend's copy kernels (cuda/src/shuffle.cu) on the CPU, in the float32 and bfloat16
builds (cuda_emulation.py), where there is no GPU, with the grid the backend launches
(shuffle_grid) and with a grid small enough that both of a kernel's strides are taken:
- pixel_shuffle3 (Wan 2.2's DupUp3D in one copy) against diffusers' own DupUp3D module, bit for bit;
- phase_interleave (upsample_conv2d's phase form, cuda/upsample.py) after torch's 2x2 conv with
  spec.upsample_conv_as_phases' weight, against torch's nearest 2x + 3x3 conv (+ a residual);
- phase_interleave_shuffled_vec, the same with diffusers' DupUp3D of a source as the residual,
  read where the source lies.
(tests/test_ops.py and test_ops_conv.py run the ops on a GPU.)"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_emulation import build

from torch_reference import F, fresh_rng, rel_l2, torch

from convkernels.backends.cuda.kernels import shuffle_grid
from convkernels.spec import upsample_conv_as_phases

RUNNER = r"""
extern "C" void run_pixel_shuffle3(const T* x, T* y, long long rows, int T_in, int H, int W, int Ci, int To, int Ho,
                                   int Wo, int Co, int ft, int fh, int fw, int repeats, int start, int gx, int gy,
                                   int vec) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = gx; grid.y = gy;
    if (vec)
        launch(grid, [=] { pixel_shuffle3_vec(x, y, rows, T_in, H, W, Ci, To, Ho, Wo, Co, ft, fh, fw, repeats, start); });
    else
        launch(grid, [=] { pixel_shuffle3(x, y, rows, T_in, H, W, Ci, To, Ho, Wo, Co, ft, fh, fw, repeats, start); });
}
extern "C" void run_phase_interleave(const T* y, const T* r, T* out, long long rows, int H, int W, int C, int has_r,
                                     int gx, int gy, int vec) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = gx; grid.y = gy;
    if (vec)
        launch(grid, [=] { phase_interleave_vec(y, r, out, rows, H, W, C, has_r); });
    else
        launch(grid, [=] { phase_interleave(y, r, out, rows, H, W, C, has_r); });
}
extern "C" void run_phase_interleave_shuffled(const T* y, const T* x, T* out, long long rows, int H, int W, int C,
                                              int T_in, int Ci, int To, int ft, int repeats, int start, int gx,
                                              int gy) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = gx; grid.y = gy;
    launch(grid, [=] { phase_interleave_shuffled_vec(y, x, out, rows, H, W, C, T_in, Ci, To, ft, repeats, start); });
}
"""
#: a small GPU's multiprocessor count, so the emulated grids stay a few blocks
SMS = 2


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def built(request, tmp_path_factory):
    return request.param, build(tmp_path_factory, RUNNER, request.param)


def lanes(dtype: str) -> int:
    """Elements in one 16-byte vector of the _vec kernels (their VEC)."""
    return 4 if dtype == "float32" else 8


def shuffle(lib, x: np.ndarray, cout: int, ft: int, fs: int, start: int, grid=None, vec: bool = False) -> np.ndarray:
    n, t, h, w, ci = x.shape
    repeats = cout * ft * fs * fs // ci
    to, ho, wo = t * ft - start, h * fs, w * fs
    y = np.zeros((n, to, ho, wo, cout), x.dtype)
    gx, gy = grid or shuffle_grid(n * to * ho, wo * cout // (16 // x.itemsize if vec else 1), SMS)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    i = ctypes.c_int
    lib.run_pixel_shuffle3(p(x), p(y), ctypes.c_longlong(n * to * ho), i(t), i(h), i(w), i(ci), i(to), i(ho), i(wo),
                           i(cout), i(ft), i(fs), i(fs), i(repeats), i(start), i(gx), i(gy), i(vec))
    return y


@pytest.mark.parametrize("cin,cout,ft,fs,first,shape", [
    (6, 3, 2, 2, False, (2, 3, 5, 7)), (6, 3, 2, 2, True, (1, 3, 5, 7)), (10, 5, 1, 2, False, (2, 2, 3, 5)),
    (4, 8, 2, 2, True, (1, 1, 3, 3)), (40, 20, 1, 2, False, (1, 1, 2, 9)),   # rows of 360 > one block
    # whole vectors of channels, Wan 2.2's two kinds: each output channel reads channel o (16 -> 16,
    # 8 -> 8) or 2o + s (16 -> 8 with time, 32 -> 16 without)
    (16, 16, 2, 2, True, (1, 2, 3, 5)), (8, 8, 1, 2, False, (2, 1, 3, 4)),
    (16, 8, 2, 2, False, (1, 2, 3, 5)), (32, 16, 1, 2, False, (1, 2, 2, 11))])
@pytest.mark.parametrize("small_grid", [False, True])
@pytest.mark.parametrize("vec", [False, True], ids=["scalar", "vec"])
def test_pixel_shuffle3_is_dup_up3d(built, cin, cout, ft, fs, first, shape, small_grid, vec):
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    dtype, lib = built
    repeats = cout * ft * fs * fs // cin
    if vec and ((ft * fs * fs) % repeats or cin % lanes(dtype) or cout % lanes(dtype)):
        pytest.skip("pixel_shuffle3_vec takes whole vectors of channels and a repeat count dividing the factors")
    rng, seed = fresh_rng()
    storage = np.float32 if dtype == "float32" else np.uint16  # bfloat16: its bit patterns, any of them
    x = rng.integers(0, 2 ** 16, (*shape, cin)).astype(storage) if storage is np.uint16 \
        else rng.standard_normal((*shape, cin)).astype(np.float32)
    start = ft - 1 if first and ft > 1 else 0
    ours = shuffle(lib, x, cout, ft, fs, start, grid=(1, 3) if small_grid else None, vec=vec)
    as_torch = torch.from_numpy(x.view(np.int16) if storage is np.uint16 else x).movedim(-1, 1)
    ref = DupUp3D(cin, cout, ft, fs)(as_torch, first_chunk=first).movedim(1, -1).contiguous().numpy()
    np.testing.assert_array_equal(ours.view(ref.dtype), ref, err_msg=f"seed {seed}")


def interleave(lib, y: np.ndarray, r: np.ndarray | None, grid=None, vec: bool = False) -> np.ndarray:
    """The kernel as cuda.kernels.phase_interleave launches it: y (N, H+1, W+1, 4C) -> (N, 2H, 2W, C)."""
    n, h1, w1, c4 = y.shape
    h, w, c = h1 - 1, w1 - 1, c4 // 4
    out = np.zeros((n, 2 * h, 2 * w, c), y.dtype)
    gx, gy = grid or shuffle_grid(n * 2 * h, 2 * w * c // (16 // y.itemsize if vec else 1), SMS)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    i = ctypes.c_int
    lib.run_phase_interleave(p(y), p(y if r is None else r), p(out), ctypes.c_longlong(n * 2 * h), i(h), i(w), i(c),
                             i(r is not None), i(gx), i(gy), i(vec))
    return out


@pytest.mark.parametrize("shape,cout", [((2, 5, 7, 6), 3), ((1, 3, 4, 9), 11), ((1, 2, 3, 4), 70),  # 70: rows > one block
                                        ((1, 3, 5, 8), 16), ((2, 2, 3, 4), 72)])               # whole vectors
@pytest.mark.parametrize("small_grid", [False, True])
@pytest.mark.parametrize("with_residual", [False, True])
@pytest.mark.parametrize("vec", [False, True], ids=["scalar", "vec"])
def test_phase_interleave_after_the_phase_conv_is_torchs_upsample_conv(built, shape, cout, small_grid, with_residual,
                                                                       vec):
    dtype, lib = built
    if vec and cout % lanes(dtype):
        pytest.skip("phase_interleave_vec takes whole vectors of channels")
    rng, seed = fresh_rng()
    n, h, w, cin = shape
    x = torch.from_numpy(rng.standard_normal(shape)).movedim(-1, 1)
    wt = rng.standard_normal((cout, 3, 3, cin)) / np.sqrt(9 * cin)
    res = torch.from_numpy(rng.standard_normal((n, 2 * h, 2 * w, cout)))
    phases = torch.from_numpy(upsample_conv_as_phases(np, wt)).movedim(-1, 1)
    y = F.conv2d(x, phases, padding=1).movedim(1, -1).contiguous()        # (N, H+1, W+1, 4 cout)
    assert tuple(y.shape) == (n, h + 1, w + 1, 4 * cout)
    ref = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), torch.from_numpy(wt).movedim(-1, 1), padding=1)
    ref = ref.movedim(1, -1) + (res if with_residual else 0)
    grid = (1, 3) if small_grid else None
    if dtype == "float32":
        ours = interleave(lib, y.float().numpy(), res.float().numpy() if with_residual else None, grid, vec)
        assert rel_l2(ours, ref.numpy()) < 1e-5, f"seed {seed}"
        return
    # bfloat16: the kernel's layout and its one rounding of y + r, against torch's own bfloat16 values
    yb, rb = y.to(torch.bfloat16), res.to(torch.bfloat16)
    ours = interleave(lib, yb.view(torch.int16).numpy().view(np.uint16),
                      rb.view(torch.int16).numpy().view(np.uint16) if with_residual else None, grid, vec)
    placed = torch.zeros((n, 2 * h, 2 * w, cout), dtype=torch.float32)
    for a in (0, 1):
        for b in (0, 1):
            p = 2 * a + b
            placed[:, a::2, b::2] = yb[:, a:a + h, b:b + w, p * cout:(p + 1) * cout].float()
    want = (placed + (rb.float() if with_residual else 0)).to(torch.bfloat16)
    np.testing.assert_array_equal(ours, want.view(torch.int16).numpy().view(np.uint16), err_msg=f"seed {seed}")
    assert rel_l2(_bf16_to_f32(ours), ref.numpy()) < 1e-2, f"seed {seed}"


def _bf16_to_f32(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


@pytest.mark.parametrize("cin,cout,ft,first,frames", [
    (16, 16, 2, False, 2), (16, 16, 2, True, 1), (16, 8, 2, False, 2),   # each channel once / every second
    (16, 8, 2, True, 2),  # a first chunk where the time offset picks the channel: `start` shifts it
    (32, 16, 1, False, 3), (8, 8, 1, False, 1), (64, 16, 2, False, 1)])  # every 2nd / once / every 4th
@pytest.mark.parametrize("small_grid", [False, True])
def test_phase_interleave_shuffled_adds_diffusers_dup_up3d(built, cin, cout, ft, first, frames, small_grid):
    """The phases of torch's 2x2 conv put in place plus diffusers' DupUp3D of a source (N, T, H, W,
    Cin), read where it lies: float32 against torch's upsample conv + the shortcut; bfloat16 bit for
    bit against the same placement and sum rounded once."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    dtype, lib = built
    repeats = cout * ft * 4 // cin
    if cout % lanes(dtype) or cin % lanes(dtype) or (ft * 4) % repeats:
        pytest.skip("phase_interleave_shuffled_vec takes whole vectors of channels and a repeat count dividing 4 ft")
    rng, seed = fresh_rng()
    n, h, w = 2, 3, 4
    start = ft - 1 if first and ft > 1 else 0
    to = frames * ft - start
    x = torch.from_numpy(rng.standard_normal((n * to, h, w, cout))).movedim(-1, 1)
    wt = rng.standard_normal((cout, 3, 3, cout)) / np.sqrt(9 * cout)
    src = torch.from_numpy(rng.standard_normal((n, frames, h, w, cin)))
    phases = torch.from_numpy(upsample_conv_as_phases(np, wt)).movedim(-1, 1)
    y = F.conv2d(x, phases, padding=1).movedim(1, -1).contiguous()        # (N To, H+1, W+1, 4 cout)
    short = DupUp3D(cin, cout, ft, 2)(src.movedim(-1, 1), first_chunk=first).movedim(1, -1)
    short = short.reshape(n * to, 2 * h, 2 * w, cout)
    grid = (1, 3) if small_grid else shuffle_grid(n * to * 2 * h, 2 * w * cout // lanes(dtype), SMS)

    def run(yv: np.ndarray, xv: np.ndarray) -> np.ndarray:
        out = np.zeros((n * to, 2 * h, 2 * w, cout), yv.dtype)
        p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
        i = ctypes.c_int
        lib.run_phase_interleave_shuffled(p(yv), p(xv), p(out), ctypes.c_longlong(n * to * 2 * h), i(h), i(w),
                                          i(cout), i(frames), i(cin), i(to), i(ft), i(repeats), i(start),
                                          i(grid[0]), i(grid[1]))
        return out

    if dtype == "float32":
        ours = run(y.float().numpy(), src.float().contiguous().numpy())
        ref = F.conv2d(F.interpolate(x, scale_factor=2, mode="nearest"), torch.from_numpy(wt).movedim(-1, 1),
                       padding=1).movedim(1, -1) + short
        assert rel_l2(ours, ref.numpy()) < 1e-5, f"seed {seed}"
        return
    yb, sb = y.to(torch.bfloat16), src.to(torch.bfloat16)
    bits = lambda t: t.contiguous().view(torch.int16).numpy().view(np.uint16)
    ours = run(bits(yb), bits(sb))
    placed = torch.zeros((n * to, 2 * h, 2 * w, cout), dtype=torch.float32)
    for a in (0, 1):
        for b in (0, 1):
            p = 2 * a + b
            placed[:, a::2, b::2] = yb[:, a:a + h, b:b + w, p * cout:(p + 1) * cout].float()
    short_b = DupUp3D(cin, cout, ft, 2)(sb.float().movedim(-1, 1), first_chunk=first).movedim(1, -1)
    want = (placed + short_b.reshape(n * to, 2 * h, 2 * w, cout)).to(torch.bfloat16)
    np.testing.assert_array_equal(ours, bits(want), err_msg=f"seed {seed}")
