"""The CUDA backend's pixel_shuffle3 kernel (cuda_src/shuffle.cu: Wan 2.2's DupUp3D in one copy) on
the CPU, in the float32 and bfloat16 builds (cuda_emulation.py), where there is no GPU, against
diffusers' own DupUp3D module: bit for bit, with the grid the backend launches (shuffle_grid) and
with a grid small enough that both of the kernel's strides are taken.
(tests/test_ops.py runs the op on a GPU.)"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_emulation import build

from torch_reference import fresh_rng, torch

from convkernels.backends.cuda_kernels import shuffle_grid

RUNNER = r"""
extern "C" void run_pixel_shuffle3(const T* x, T* y, long long rows, int T_in, int H, int W, int Ci, int To, int Ho,
                                   int Wo, int Co, int ft, int fh, int fw, int repeats, int start, int gx, int gy) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = gx; grid.y = gy;
    launch(grid, [=] { pixel_shuffle3(x, y, rows, T_in, H, W, Ci, To, Ho, Wo, Co, ft, fh, fw, repeats, start); });
}
"""
#: a small GPU's multiprocessor count, so the emulated grids stay a few blocks
SMS = 2


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def built(request, tmp_path_factory):
    return request.param, build(tmp_path_factory, RUNNER, request.param)


def shuffle(lib, x: np.ndarray, cout: int, ft: int, fs: int, start: int, grid=None) -> np.ndarray:
    n, t, h, w, ci = x.shape
    repeats = cout * ft * fs * fs // ci
    to, ho, wo = t * ft - start, h * fs, w * fs
    y = np.zeros((n, to, ho, wo, cout), x.dtype)
    gx, gy = grid or shuffle_grid(n * to * ho, wo * cout, SMS)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    i = ctypes.c_int
    lib.run_pixel_shuffle3(p(x), p(y), ctypes.c_longlong(n * to * ho), i(t), i(h), i(w), i(ci), i(to), i(ho), i(wo),
                           i(cout), i(ft), i(fs), i(fs), i(repeats), i(start), i(gx), i(gy))
    return y


@pytest.mark.parametrize("cin,cout,ft,fs,first,shape", [
    (6, 3, 2, 2, False, (2, 3, 5, 7)), (6, 3, 2, 2, True, (1, 3, 5, 7)), (10, 5, 1, 2, False, (2, 2, 3, 5)),
    (4, 8, 2, 2, True, (1, 1, 3, 3)), (40, 20, 1, 2, False, (1, 1, 2, 9))])   # rows of 360 > one block
@pytest.mark.parametrize("small_grid", [False, True])
def test_pixel_shuffle3_is_dup_up3d(built, cin, cout, ft, fs, first, shape, small_grid):
    from diffusers.models.autoencoders.autoencoder_kl_wan import DupUp3D

    dtype, lib = built
    rng, seed = fresh_rng()
    storage = np.float32 if dtype == "float32" else np.uint16  # bfloat16: its bit patterns, any of them
    x = rng.integers(0, 2 ** 16, (*shape, cin)).astype(storage) if storage is np.uint16 \
        else rng.standard_normal((*shape, cin)).astype(np.float32)
    start = ft - 1 if first and ft > 1 else 0
    ours = shuffle(lib, x, cout, ft, fs, start, grid=(1, 3) if small_grid else None)
    as_torch = torch.from_numpy(x.view(np.int16) if storage is np.uint16 else x).movedim(-1, 1)
    ref = DupUp3D(cin, cout, ft, fs)(as_torch, first_chunk=first).movedim(1, -1).contiguous().numpy()
    np.testing.assert_array_equal(ours.view(ref.dtype), ref, err_msg=f"seed {seed}")
