"""The CUDA backend's attention softmax kernels (cuda/src/softmax.cu) on the CPU, in the bfloat16
build (cuda_emulation.py), where there is no GPU: softmax_rows_f32, which bfloat16 attention runs
on its float32 scores and which writes each probability as two bfloat16 values (its rounding, then
the rest), and softmax_rows, on scores stored as bfloat16. Rows longer than a block's 256 threads,
odd lengths, large scores and a scale, against torch in float64.
(tests/test_ops.py and tests/gpu/test_cuda_attention_bf16.py run the attention on a GPU.)"""
from __future__ import annotations

import ctypes

import numpy as np
import pytest
from cuda_emulation import build

from torch_reference import fresh_rng, torch

RUNNERS = r"""
extern "C" void run_softmax_f32(const float* x, T* y, long long rows, int L, float scale) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)rows;
    launch(grid, [=] { softmax_rows_f32(x, y, rows, L, scale); });
}

extern "C" void run_softmax(const T* x, T* y, long long rows, int L, float scale) {
    blockDim.x = BLOCK_THREADS;
    dim3 grid; grid.x = (unsigned)rows;
    launch(grid, [=] { softmax_rows(x, y, rows, L, scale); });
}
"""


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    return build(tmp_path_factory, RUNNERS, "bfloat16")


def to_bf16(x) -> np.ndarray:
    """bfloat16 bit patterns (uint16) of float values, rounded to nearest even (torch's rounding)."""
    return torch.from_numpy(np.asarray(x, np.float32)).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bf16(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def run(lib, name: str, x: np.ndarray, scale: float, halves: int = 1) -> np.ndarray:
    """The kernel's output as float32: (rows, halves * length)."""
    rows, length = x.shape
    y = np.zeros((rows, halves * length), np.uint16)
    p = lambda a: a.ctypes.data_as(ctypes.c_void_p)
    getattr(lib, name)(p(x), p(y), ctypes.c_longlong(rows), ctypes.c_int(length), ctypes.c_float(scale))
    return from_bf16(y)


@pytest.mark.parametrize("rows,length", [(3, 301), (2, 1000), (40, 7)])
def test_softmax_of_float32_scores_written_as_two_bfloat16_halves(lib, rows, length):
    rng, seed = fresh_rng()
    scale = 1.0 / np.sqrt(512.0)
    # a 512-channel mid-block's raw scores: q.k of order 100 before the 1/sqrt(512) scale
    scores = (rng.standard_normal((rows, length)) * 60.0).astype(np.float32)
    exact = torch.softmax(torch.from_numpy(scores.astype(np.float64)) * scale, dim=-1).numpy()
    both = run(lib, "run_softmax_f32", scores, scale, halves=2)
    hi, lo = both[:, :length], both[:, length:]
    # the first half: each probability within one bfloat16 rounding (a relative 2^-8) of the exact one
    assert np.all(np.abs(hi - exact) <= 2.0 ** -8 * exact + 1e-30), f"seed {seed}"
    # the second: what the first missed, so that the two together hold 16 bits of it (float32's
    # exp and sum leave a relative 2^-20 or so)
    assert np.all(np.abs(lo) <= 2.0 ** -8 * np.abs(hi) + 1e-30), f"seed {seed}"
    assert np.all(np.abs(hi + lo - exact) <= 2.0 ** -15 * exact + 1e-30), f"seed {seed}"
    assert np.allclose((hi + lo).sum(-1), 1.0, atol=1e-4), f"seed {seed}"
    # what the halves buy: several times smaller errors than the rounding alone
    err = lambda y: float(np.linalg.norm((y - exact) / exact) / np.sqrt(exact.size))
    assert err(hi + lo) < err(hi) / 16, f"seed {seed}: {err(hi + lo):.2e} vs {err(hi):.2e}"
    # what storing these scores as bfloat16 first would cost: several times one rounding of the
    # probabilities (the reason the kernel takes float32)
    from_rounded = run(lib, "run_softmax", to_bf16(scores), scale)
    print(f"relative rms error: both halves {err(hi + lo):.2e}, the first {err(hi):.2e}, "
          f"from bfloat16 scores {err(from_rounded):.2e}")
    assert err(from_rounded) > 2 * err(hi), f"seed {seed}: {err(from_rounded):.2e} vs {err(hi):.2e}"
