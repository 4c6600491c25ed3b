"""Optional compiled CPU kernels. Built by `pip install` when a C compiler is present; every
user checks `AVAILABLE` and falls back to pure NumPy otherwise."""
import os

# Our OpenMP threads must sleep, not spin, between parallel regions: the gemms between them run
# on OpenBLAS's own threads, and spinning OpenMP threads took their cores (Winograd 512->512 64x64:
# 106 ms spinning, 68 ms passive, on 2 cores). Our own gemm and the kernels called per op run on
# pool.c's threads, which spin a bounded while and are not waited for when late; OpenMP threads
# spinning 1.3 ms instead made ConvNeXt-T b1 65 -> 55 ms on a quiet 2-core box but 110 -> 400 ms
# beside other jobs (2026-11-29). libgomp reads this once, when it is loaded.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

try:
    from . import _kernels
    AVAILABLE = True
except ImportError:  # no compiler at install time: NumPy paths only
    _kernels = None
    AVAILABLE = False
