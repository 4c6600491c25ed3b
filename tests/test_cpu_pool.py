"""The compiled kernels' own thread pool (convkernels/_cpu/pool.c), which runs the gemm tiles,
Winograd's transforms, the fused depthwise + LayerNorm and the epilogue: its caller waits for no
thread that took no work. Checked in fresh processes (the pool is per process): results equal a
float64 product with two workers, from several Python threads at once and in a fork()ed child;
an idle process's workers stop spinning within milliseconds; one thread starts no worker."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convkernels import _cpu
from convkernels.backends.numpy import fused

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.skipif(not _cpu.AVAILABLE or not fused.panel_width(),
                                reason="no compiled gemm tiles here (no compiler, or not x86-64 v3/v4)")

PROBE = r"""
import json, os, sys, threading, time
import numpy as np
from convkernels.backends.numpy import fused

rng = np.random.default_rng(0)
def case(m=301, k=77, n=130):
    a = rng.standard_normal((m, k)).astype(np.float32); w = rng.standard_normal((n, k)).astype(np.float32)
    return a, w, a.astype(np.float64) @ w.T.astype(np.float64)
def err(a, w, want):
    got = fused.linear(a, w, None, None, None, fused.pack_panels)
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))
def pool_threads():
    tids = []
    for tid in os.listdir("/proc/self/task"):
        try:
            if open(f"/proc/self/task/{tid}/comm").read().strip() == "convkernels":
                tids.append(tid)
        except OSError:
            pass
    return tids
def threads(wait_s=0.0):  # a new worker names itself when it first runs: give it a moment
    end = time.monotonic() + wait_s
    while not pool_threads() and time.monotonic() < end:
        time.sleep(0.01)
    return len(pool_threads())
def pool_cpu_ticks():
    total = 0
    for tid in pool_threads():
        fields = open(f"/proc/self/task/{tid}/stat").read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total
out = {"before": threads()}
a, w, want = case()
out["one"] = err(a, w, want)
out["after"] = threads(float(os.environ["OMP_NUM_THREADS"]) - 1.0)
errs = []
def many():
    a, w, want = case()
    errs.extend(err(a, w, want) for _ in range(20))
ts = [threading.Thread(target=many) for _ in range(4)]
[t.start() for t in ts]; [t.join() for t in ts]
out["threads_worst"] = max(errs)
err(a, w, want)
t0 = pool_cpu_ticks(); time.sleep(0.5); out["idle_cpu_s"] = (pool_cpu_ticks() - t0) / os.sysconf("SC_CLK_TCK")
r, wfd = os.pipe()
pid = os.fork()
if pid == 0:
    before = threads()
    e = err(a, w, want)
    os.write(wfd, json.dumps({"err": e, "workers_started": threads(1.0) - before}).encode()); os._exit(0)
os.close(wfd)
os.waitpid(pid, 0)
out["child"] = json.loads(os.read(r, 4096))
print(json.dumps(out))
"""


def probe(threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONPATH": str(REPO)}
    run = subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=120, cwd=REPO)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_two_threads_results_idle_and_fork():
    got = probe(2)
    assert got["one"] < 1e-5 and got["threads_worst"] < 1e-5, got
    assert got["before"] == 0 and got["after"] == 1, f"one worker beside the caller expected: {got}"
    # bounded spin: the worker spins ~0.1-0.4 ms after a job, then sleeps (spinning for ever, as
    # OMP_WAIT_POLICY=ACTIVE does, costs it the whole half second; ticks are 10 ms)
    assert got["idle_cpu_s"] <= 0.03, got
    assert got["child"]["err"] < 1e-5, got
    assert got["child"]["workers_started"] == 1, f"a fork()ed child starts its own worker: {got}"


def test_one_thread_starts_no_worker():
    got = probe(1)
    assert got["one"] < 1e-5 and got["threads_worst"] < 1e-5, got
    assert got["before"] == got["after"] == 0, got
