"""How our OpenMP threads wait between parallel regions, chosen before libgomp loads (it reads
OMP_WAIT_POLICY and GOMP_SPINCOUNT once, when loaded; a user's setting of either is kept).

A libgomp thread that finds no work spins GOMP_SPINCOUNT times (one `pause` each: ~13 ns on the
2-core Xeon of 2026-11-29, ~45 ns on Skylake) and then sleeps on a futex. A sleeping thread costs
every parallel region a wake-up, and on a VM that is an inter-processor interrupt through the
hypervisor: ConvNeXt-T b1 (~60 regions) ran 65 ms on two threads that slept at once (PASSIVE),
55 ms with 300000 spins, 51 ms spinning for ever (same box, interleaved runs).

- Where gemm.c's tiles do the products (x86-64 with AVX2 and FMA), no other thread pool runs
  beside ours, so our threads spin a bounded while: long enough to bridge the Python between two
  ops, short enough that an idle worker stops burning a core within milliseconds.
- Elsewhere OpenBLAS runs the products on its own threads, which spinning OpenMP threads starve
  (Winograd 512->512 64x64: 106 ms spinning, 68 ms passive, on 2 cores): they sleep at once.
"""
from __future__ import annotations

import os
import platform

#: spins before a waiting thread sleeps where our tiles run: ~1.3 ms on the 2026 Xeon, ~5 ms on
#: Skylake's slower `pause`; either way bounded, where OMP_WAIT_POLICY=ACTIVE never sleeps
TILES_SPIN_COUNT = "100000"


def tiles_expected() -> bool:
    """Whether gemm.c's tiles will run here (x86-64 with AVX2 and FMA, as NumPy detected them).
    Decided without loading the extension, which would load libgomp before its policy is set."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return False
    try:
        from numpy._core._multiarray_umath import __cpu_features__ as features
    except ImportError:  # NumPy 1.x
        from numpy.core._multiarray_umath import __cpu_features__ as features
    return bool(features.get("AVX2") and features.get("FMA3"))


def apply_default_wait_policy(env=None, tiles: bool | None = None) -> dict:
    """Set the wait policy in `env` (os.environ by default) unless the user set one; returns
    what was set ({} when the user's choice stands)."""
    env = os.environ if env is None else env
    if "OMP_WAIT_POLICY" in env or "GOMP_SPINCOUNT" in env:
        return {}
    chosen = ({"GOMP_SPINCOUNT": TILES_SPIN_COUNT} if (tiles_expected() if tiles is None else tiles)
              else {"OMP_WAIT_POLICY": "PASSIVE"})
    env.update(chosen)
    return chosen
