"""Keep freed arrays' memory in the process for the next op, instead of handing it back to the
OS and faulting it in again page by page.

glibc serves an allocation above M_MMAP_THRESHOLD (128 KiB at first, raised as such blocks are
freed) with a fresh mmap and unmaps it on free, so every op's output of a few MiB starts on pages
the kernel must fault in and zero, one at a time, on the thread that touches them first. On the
2-core Xeon (2026-11-29, interleaved runs, two threads) an SD-VAE 256 decode ran 1.80-1.91 s as
glibc ships, 1.43-1.51 s with the threshold at its 32 MiB ceiling and a 1 GiB trim threshold.
Blocks above 32 MiB are still mapped and unmapped (the process's memory stays bounded by its
peak plus the trim threshold). A user who set glibc's malloc options (MALLOC_* or
GLIBC_TUNABLES) keeps them: nothing is changed then.

NumPy asks for transparent huge pages on every large array (madvise). Where the kernel compacts
memory to find them at fault time (`defrag` = madvise, as on the 2-core Xeon VM), a fresh 38 MB
array took 114-158 ms to touch once a few hundred MB were mapped, against 15-20 ms in 4 KiB pages;
loading SD-VAE (its Winograd panels, transformed at load) took 5.1-6.4 s against 1.8 s, and steady
decodes were the same either way (2.5-2.9 s, 2026-11-29). So that request is turned off too, unless
the user chose with NUMPY_MADVISE_HUGEPAGE.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (mallopt refuses more)
MMAP_THRESHOLD = 32 << 20
#: free memory at the heap's top kept before it is returned to the OS
TRIM_THRESHOLD = 1 << 30
_done: list[bool] = []


def user_set_malloc_options(env=os.environ) -> bool:
    """glibc's own malloc settings in the environment (MALLOC_ARENA_MAX, MALLOC_TRIM_THRESHOLD_, ...)"""
    return any(k.startswith("MALLOC_") or k == "GLIBC_TUNABLES" for k in env)


def retain_freed_memory(env=os.environ) -> bool:
    """Raise glibc's mmap and trim thresholds once per process; True where it was done."""
    if _done:
        return _done[0]
    if "NUMPY_MADVISE_HUGEPAGE" not in env:
        _no_huge_page_requests()
    ok = False
    if not user_set_malloc_options(env):
        try:
            libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
            mallopt = libc.mallopt  # glibc (and musl lacks it: AttributeError)
            ok = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
        except (OSError, AttributeError):  # not glibc: its allocator is left as it is
            ok = False
    _done.append(ok)
    return ok


def _no_huge_page_requests() -> None:
    import numpy as np

    core = getattr(np, "_core", None) or getattr(np, "core", None)  # NumPy 2, NumPy 1.26
    setter = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if setter is not None:  # another NumPy's internals: its default stays
        setter(False)
