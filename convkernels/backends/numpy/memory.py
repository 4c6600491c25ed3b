"""Keep freed arrays' memory in the process for the next op, instead of handing it back to the
OS and faulting it in again page by page.

glibc serves an allocation above M_MMAP_THRESHOLD (128 KiB at first, raised as such blocks are
freed) with a fresh mmap and unmaps it on free, so every op's output of a few MiB starts on pages
the kernel must fault in and zero, one at a time, on the thread that touches them first. On the
2-core Xeon (2026-11-29, interleaved runs, two threads) an SD-VAE 256 decode ran 1.80-1.91 s as
glibc ships, 1.43-1.51 s with the threshold at its 32 MiB ceiling and a 1 GiB trim threshold.
Blocks above that ceiling, which glibc will not raise, are taken from the heap too (M_MMAP_MAX 0):
an SD-VAE 512x512 decode's activations of 64-128 MiB had cost 460,000 page faults (1.8 GB) a call,
and the decode 6.5-7.3 s against 5.7 s with them reused (2026-11-29). The heap then holds the
process's peak: once the backend's convs and linears have been idle for TRIM_IDLE_S (a minute), a thread
hands the free pages back (malloc_trim), so memory between bursts of requests is what is in use. A user who set
glibc's malloc options (MALLOC_* or GLIBC_TUNABLES) keeps them: nothing is changed then.

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
import threading
import time
import weakref

M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD, M_MMAP_MAX = -1, -2, -3, -4
#: glibc's ceiling for M_MMAP_THRESHOLD on 64-bit (mallopt refuses more)
MMAP_THRESHOLD = 32 << 20
#: free memory at the heap's top kept before it is returned to the OS
TRIM_THRESHOLD = 1 << 30
#: free memory a thread's own arena keeps at the top of its heaps. Why: a thread other than the main
#: one (a model worker's device thread) allocates from an arena of 64 MiB heaps, and glibc unmaps a
#: wholly free heap unless the one below keeps more than M_TOP_PAD free, whatever M_TRIM_THRESHOLD
#: says. An op's output that did not fit beside long-lived blocks took a fresh heap and gave it back
#: each op: a streamed Wan decode on a model worker's thread took 0.5-1.2 M page faults and twice
#: its time a request (2-core EPYC, 2026-11-30). At the heap's size no heap is given back
TOP_PAD = 64 << 20
#: the backends' heavy ops idle this long: the heap's free pages go back to the OS. Requests closer
#: together than this keep their pages: an SD-VAE 512 decode run every ~22 s (interleaved with other
#: runtimes' runs) took 7.1-7.2 s with 1 s and 10 s here, its 950 MB faulted in again each time,
#: against 5.4 s back to back (2-core Xeon, 2026-11-29). What is kept is at most one call's working
#: memory, which the backend's work_memory_budget (1 GiB) bounds for the image VAEs' tiled decodes.
TRIM_IDLE_S = 60.0
_done: list[bool] = []
_watched: "weakref.WeakSet" = weakref.WeakSet()


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
            ok = (bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
                  and bool(mallopt(M_MMAP_MAX, 0)) and bool(mallopt(M_TOP_PAD, TOP_PAD)))
            if ok:
                threading.Thread(target=_trim_when_idle, args=(libc.malloc_trim,), name="convkernels-trim",
                                 daemon=True).start()
        except (OSError, AttributeError):  # not glibc: its allocator is left as it is
            ok = False
    _done.append(ok)
    return ok


def watch(activity) -> None:
    """A backend's Activity (background.py: its convs and linears in flight, when the last ended),
    which the trimming thread waits on."""
    _watched.add(activity)


def _trim_when_idle(malloc_trim) -> None:
    """Once every watched backend has run no conv or linear for TRIM_IDLE_S, and some ran since
    the last trim: every free page of the heap back to the OS (a few ms; the next call faults in
    what it needs once, then reuses it again)."""
    trimmed_at = None
    while True:
        time.sleep(TRIM_IDLE_S / 4)
        activities = list(_watched)
        started = sum(a.started for a in activities)
        if started == trimmed_at or any(a.busy for a in activities):
            continue
        if all(time.monotonic() - a.last >= TRIM_IDLE_S for a in activities):
            malloc_trim(0)
            trimmed_at = started


def _no_huge_page_requests() -> None:
    import numpy as np

    core = getattr(np, "_core", None) or getattr(np, "core", None)  # NumPy 2, NumPy 1.26
    setter = getattr(getattr(core, "multiarray", None), "_set_madvise_hugepage", None)
    if setter is not None:  # another NumPy's internals: its default stays
        setter(False)
