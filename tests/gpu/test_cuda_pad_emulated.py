"""The CUDA backend's one-copy pad (cuda/src/shuffle.cu pad3 and pad3_vec) on the CPU, in the float32
and bfloat16 builds (cuda_emulation.py), where there is no GPU: against NumPy's np.pad of each axis in
its own mode (zeros = constant, replicate = edge, reflect = reflect), bit for bit, with odd sizes,
pads of 0-2 lines on either side, every mode on every axis, the grid the backend launches
(shuffle_grid) and one small enough that both of a kernel's strides are taken. (tests/test_ops.py
runs the op on a GPU.)"""
from __future__ import annotations

import ctypes
import itertools

import numpy as np
import pytest
from cuda_emulation import build

from convkernels.backends.cuda.kernels import shuffle_grid

RUNNER = r"""
extern "C" void run_pad3(const T* x, T* y, long long rows, int T_in, int H, int W, int C, int To, int Ho, int Wo,
                         int pt, int ph, int pw, int mt, int mh, int mw, int gx, int gy, int vec) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = gx; grid.y = gy;
    if (vec)
        launch(grid, [=] { pad3_vec(x, y, rows, T_in, H, W, C, To, Ho, Wo, pt, ph, pw, mt, mh, mw); });
    else
        launch(grid, [=] { pad3(x, y, rows, T_in, H, W, C, To, Ho, Wo, pt, ph, pw, mt, mh, mw); });
}
"""
SMS = 2
MODES = {"zeros": 0, "replicate": 1, "reflect": 2}
NUMPY = {"zeros": "constant", "replicate": "edge", "reflect": "reflect"}


@pytest.fixture(scope="module", params=["float32", "bfloat16"])
def built(request, tmp_path_factory):
    return request.param, build(tmp_path_factory, RUNNER, request.param)


def pad3(lib, x: np.ndarray, pads, modes, vec: bool, grid=None) -> np.ndarray:
    n, t, h, w, c = x.shape
    to, ho, wo = (s + a + b for s, (a, b) in zip((t, h, w), pads))
    y = np.full((n, to, ho, wo, c), 7, x.dtype)  # not zeros: a zero the kernel failed to write shows
    gx, gy = grid or shuffle_grid(n * to * ho, wo * c // (16 // x.itemsize if vec else 1), SMS)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    i = ctypes.c_int
    lib.run_pad3(p(x), p(y), ctypes.c_longlong(n * to * ho), i(t), i(h), i(w), i(c), i(to), i(ho), i(wo),
                 *(i(a) for a, _ in pads), *(i(MODES[m]) for m in modes), i(gx), i(gy), i(vec))
    return y


def reference(x: np.ndarray, pads, modes) -> np.ndarray:
    for axis, ((a, b), mode) in enumerate(zip(pads, modes), start=1):
        width = [(0, 0)] * x.ndim
        width[axis] = (a, b)
        x = np.pad(x, width, mode=NUMPY[mode])
    return x


def sample(dtype: str, shape, rng) -> np.ndarray:
    if dtype == "bfloat16":  # bit patterns: finite values, the sign bit and every mantissa bit in play
        return rng.integers(0, 0x7F00, shape, dtype=np.uint16) | (rng.integers(0, 2, shape, dtype=np.uint16) << 15)
    return rng.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("modes", list(itertools.product(MODES, repeat=3)))
def test_every_mode_on_every_axis(built, modes):
    dtype, lib = built
    rng = np.random.default_rng(sum(MODES[m] * 3 ** k for k, m in enumerate(modes)))
    vec_c = 16 // (4 if dtype == "float32" else 2)
    for shape, pads in (((2, 3, 5, 7, 3), ((1, 1), (1, 1), (1, 1))),
                        ((1, 4, 3, 6, 2 * vec_c), ((2, 0), (2, 1), (0, 2))),
                        ((1, 1, 2, 3, 5), ((0, 0), (1, 1), (1, 1)))):
        if any(m == "reflect" and max(p) >= s for m, p, s in zip(modes, pads, shape[1:4])):
            continue  # reflection needs the pad narrower than the axis (TensorOps.pad checks it)
        x = sample(dtype, shape, rng)
        want = reference(x, pads, modes)
        for vec in ((False, True) if shape[-1] % vec_c == 0 else (False,)):
            for grid in (None, (1, 3)):
                got = pad3(lib, x, pads, modes, vec, grid)
                assert got.shape == want.shape and np.array_equal(got, want), (shape, pads, modes, vec, grid)


def test_a_wide_row_takes_several_blocks_and_strides(built):
    dtype, lib = built
    rng = np.random.default_rng(3)
    x = sample(dtype, (1, 3, 4, 97, 8), rng)  # rows of 99 x 8 elements: more than one block of threads
    pads, modes = ((1, 1), (1, 1), (1, 1)), ("replicate", "reflect", "reflect")
    want = reference(x, pads, modes)
    for vec in (False, True):
        for grid in (None, (2, 5)):
            assert np.array_equal(pad3(lib, x, pads, modes, vec, grid), want)
