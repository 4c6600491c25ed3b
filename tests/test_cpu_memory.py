"""The NumPy backend keeps freed arrays' memory for the next op (convkernels/backends/numpy/memory.py):
once a backend exists, arrays of a few MiB, and arrays past glibc's 32 MiB mmap ceiling, freed and
allocated again reuse their pages instead of faulting fresh ones in (counted as minor page faults,
not timed); the free pages go back to the OS once the backend's ops have been idle a while, and not
while one runs; a user's glibc malloc options are left alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convkernels.backends.numpy import memory

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import json, resource
import numpy as np
from convkernels import get_backend
from convkernels.backends.numpy import memory
get_backend("numpy")
import sys
SIZES = [int(v) for v in sys.argv[1:]] or [24, 8, 30, 16, 24]
def cycle():  # ops' outputs (8-30 MiB unless told), two alive at a time
    keep = []
    for mib in SIZES:
        a = np.empty((mib << 20) // 4, np.float32); a[:] = 1.0; keep.append(a)
        if len(keep) > 2: keep.pop(0)
for _ in range(3): cycle()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10): cycle()
core = getattr(np, "_core", None) or np.core
huge = core.multiarray._get_madvise_hugepage()
print(json.dumps({"applied": memory._done, "faults": (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 10,
                  "huge_pages": huge}))
"""


def probe(*sizes, script=PROBE, **extra) -> dict:
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith("MALLOC_") or k in ("GLIBC_TUNABLES", "NUMPY_MADVISE_HUGEPAGE"))}
    env.update(extra, PYTHONPATH=str(REPO))
    run = subprocess.run([sys.executable, "-c", script, *map(str, sizes)], env=env, capture_output=True, text=True,
                         timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_freed_arrays_reuse_their_pages():
    got = probe()
    if got["applied"] != [True]:
        pytest.skip("not glibc: its allocator is left as it is")
    # glibc as it ships: ~2600 faults a cycle here (each freed block unmapped or trimmed)
    assert got["faults"] < 50, got


def test_arrays_past_the_mmap_ceiling_reuse_their_pages_too():
    """64-96 MiB activations (SD-VAE 512's) came from a fresh mmap each time: 460,000 faults a decode."""
    got = probe(64, 96, 64)
    if got["applied"] != [True]:
        pytest.skip("not glibc: its allocator is left as it is")
    assert got["faults"] < 50, got
    # the same cycle as glibc ships (a user's option keeps it so): every block faulted in again
    assert probe(64, 96, 64, MALLOC_ARENA_MAX="8")["faults"] > 10_000


THREAD = r"""
import json, resource, threading
import numpy as np
from convkernels import get_backend
from convkernels.backends.numpy import memory
get_backend("numpy")
out = {}
def worker():
    # a thread's own glibc arena is 64 MiB heaps: a long-lived block low in the first, then ops'
    # outputs that do not fit beside it, each in a second heap that is wholly free after the op
    keep = np.ones((30 << 20) // 4, np.float32)
    def op():
        a = np.empty((40 << 20) // 4, np.float32); a[:] = 1.0
    for _ in range(3): op()
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for _ in range(10): op()
    out["faults"] = (resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0) / 10
    out["kept"] = float(keep.sum())
t = threading.Thread(target=worker); t.start(); t.join()
print(json.dumps({"applied": memory._done, **out}))
"""


def test_a_threads_own_arena_keeps_its_heaps_too():
    """A model worker's device thread allocates from its own arena, whose free heaps glibc unmapped
    whatever the trim threshold said: a streamed Wan decode took 0.5-1.2 M faults a request."""
    got = probe(script=THREAD)
    if got["applied"] != [True]:
        pytest.skip("not glibc: its allocator is left as it is")
    assert got["faults"] < 50, got
    # as glibc ships (a user's option keeps it so): the second heap unmapped and faulted in each op
    assert probe(script=THREAD, MALLOC_ARENA_MAX="8")["faults"] > 5_000


TRIM = r"""
import json, time
import numpy as np
from convkernels import get_backend
from convkernels.backends.numpy import memory
memory.TRIM_IDLE_S = 1.0  # the thread reads it each round (10 s as shipped)
be = get_backend("numpy")
def rss(): return int(open("/proc/self/statm").read().split()[1]) * 4096 >> 20
def held_after_free(busy_s):
    with be.activity:
        big = np.empty(320 << 18, np.float32); big[:] = 1.0  # 320 MiB
        pin = np.ones(1 << 18, np.float32)  # allocated after it: the heap's top stays in use
        del big
        time.sleep(busy_s)  # a conv still running: nothing is handed back
        during = rss()
    time.sleep(3 * memory.TRIM_IDLE_S)
    return during, rss(), pin.sum()
during, idle, _ = held_after_free(2.5 * memory.TRIM_IDLE_S)
print(json.dumps({"applied": memory._done, "during": during, "idle": idle}))
"""


def test_free_pages_go_back_once_idle_and_not_while_busy():
    got = probe(script=TRIM)
    if got["applied"] != [True]:
        pytest.skip("not glibc: its allocator is left as it is")
    assert got["during"] - got["idle"] > 200, got  # MiB: the 320 MiB block's pages, once idle


def test_a_users_malloc_options_are_kept():
    assert probe(MALLOC_TRIM_THRESHOLD_="131072")["applied"] == [False]
    assert probe(GLIBC_TUNABLES="glibc.malloc.check=0")["applied"] == [False]
    assert memory.user_set_malloc_options({"MALLOC_ARENA_MAX": "2"})
    assert not memory.user_set_malloc_options({"MALLOC": "x", "PATH": "/bin"})


def test_numpy_stops_asking_for_huge_pages_unless_the_user_chose():
    """NumPy's transparent-huge-page request made fresh arrays 7x slower to fault in where the kernel
    compacts memory for them (memory.py); NUMPY_MADVISE_HUGEPAGE, NumPy's own switch, wins."""
    assert probe()["huge_pages"] is False
    assert probe(NUMPY_MADVISE_HUGEPAGE="1")["huge_pages"] is True
