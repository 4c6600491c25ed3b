"""What every parity test needs beside its reference, torch-free so service helpers can import it:
fresh seeds, the relative L2 error, the guard that a reference is worth comparing with, and the
element-wise bound between two processes' float32 results of one computation."""
from __future__ import annotations

import os

import numpy as np


def fresh_seed() -> int:
    """A new seed every run (tests print it with their figures) for fresh random weights."""
    return int.from_bytes(os.urandom(4), "little")


def rel_l2(ours, ref) -> float:
    ours = np.asarray(ours, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    denom = np.linalg.norm(ref)
    return float(np.linalg.norm(ours - ref) / (denom if denom > 0 else 1.0))


# A pixel decode in [0, 1] is informative when it varies and the clamp leaves most of it alone.
# The bar is what the 1e-4 relative L2 checks need: around a mean near 0.5, a std of 0.005 still
# bounds the error at 1 % of the variation. The bar was 0.02 once, and a valid draw fell under it:
# over 800 draws of the Qwen-Image test's reference the std ran from 0.023 up (mean 0.09), and a
# CI run drew 0.018. At least a quarter of it must lie inside (0, 1), where the clamp hides nothing:
# TAESD's references (latents at twice the unit scale, through its tanh) had 47-49 % inside for 3
# seeds in 300, under the half that was asked once.
INFORMATIVE_STD = 0.005
MAX_CLAMPED = 0.75


def assert_informative(ref, what: str) -> None:
    """The reference decode must vary and stay mostly unclamped, or comparing with it proves nothing."""
    ref = np.asarray(ref)
    std, clamped = float(ref.std()), float(np.mean((ref <= 0) | (ref >= 1)))
    assert std > INFORMATIVE_STD and clamped < MAX_CLAMPED, \
        f"{what}: reference flat or saturated (std {std:.4f}, {clamped:.0%} clamped)"



def assert_latents_informative(ref, what: str) -> None:
    """An encode's reference latents must be finite and vary, or comparing with them proves nothing.
    Latents are not pixels: normalised ones spread around 0 with a std near 1, so the pixel guard's
    clamp count means nothing for them (an LTX-2 encode of std 0.73 once had 79 % outside (0, 1))."""
    ref = np.asarray(ref, dtype=np.float64)
    assert np.isfinite(ref).all(), f"{what}: reference latents hold NaN or inf"
    std = float(ref.std())
    assert std > INFORMATIVE_STD * max(1.0, float(np.abs(ref.mean()))), \
        f"{what}: reference latents flat (std {std:.4g}, mean {float(ref.mean()):.4g})"

# The same float32 model run in two processes (two model workers, a worker and the test, two GPUs)
# may sum in another order: each process times its own conv paths (a Winograd F(4x4) in one, an
# im2col gemm in the other) and BLAS splits a gemm by its thread count. Measured on tiny-vae's
# decode (pixels in [0, 1]): every conv forced onto one path moved a pixel by up to 48 float32 ulps
# (winograd_f4x3, 5.7e-6), 40 random mixes of paths by up to 54 (6.4e-6); two workers once differed
# by 1.01e-6, which a 1e-6 bound failed 2 runs in 9. 256 ulps (3.1e-5) leaves about 5x headroom
# over that and still sits far below a wrong answer: other random weights, or another row's latents,
# moved some pixel of every decode by over 0.79.
CROSS_PROCESS_ULPS = 256


def cross_process_atol(ref, ulps: int = CROSS_PROCESS_ULPS) -> float:
    """Element-wise bound between two processes' float32 results of one computation: `ulps` float32
    units in the last place at the reference's magnitude (at least 1, the pixel range)."""
    scale = max(1.0, float(np.max(np.abs(np.asarray(ref, dtype=np.float64)))))
    return ulps * float(np.finfo(np.float32).eps) * scale
