"""What every parity test needs beside its reference, torch-free so service helpers can import it:
fresh seeds, the relative L2 error, and the guard that a reference is worth comparing with."""
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
