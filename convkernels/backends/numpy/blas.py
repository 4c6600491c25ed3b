"""BLAS threads of the NumPy backend's small gemms."""
from __future__ import annotations

import contextlib

# gemms below this many multiply-adds run on one BLAS thread: OpenBLAS wakes its pool for
# them anyway, and on a busy box each wake-up stalls ~16 ms for 0.05 ms of work (measured on
# the 2-core CI kind: (2048,16)@(16,64) took 16 ms with the pool, 0.06 ms pinned to one thread)
SMALL_GEMM_MACS = 1 << 24


class BlasThreads:
    """Context factory that pins BLAS to one thread for small gemms (no-op without threadpoolctl)."""

    def __init__(self):
        try:
            from threadpoolctl import ThreadpoolController
            self._ctl = ThreadpoolController()
        except Exception:  # threadpoolctl missing or no BLAS found: leave BLAS as it is
            self._ctl = None

    def for_macs(self, macs: float):
        if self._ctl is None or macs >= SMALL_GEMM_MACS:
            return contextlib.nullcontext()
        return self._ctl.limit(limits=1, user_api="blas")
