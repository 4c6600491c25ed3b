"""How the compiled kernels' OpenMP threads wait between ops (convkernels/_cpu/wait_policy.py):
where our own tiles do the products they spin a bounded while (a sleeping thread costs every op a
wake-up), elsewhere they sleep at once (OpenBLAS's threads need the cores); a user's
OMP_WAIT_POLICY or GOMP_SPINCOUNT is never overridden; and an idle process stops burning CPU."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from convkernels import _cpu
from convkernels._cpu import wait_policy

REPO = Path(__file__).resolve().parents[1]


def test_default_is_a_bounded_spin_with_tiles_and_sleep_without():
    env: dict = {}
    assert wait_policy.apply_default_wait_policy(env, tiles=True) == {"GOMP_SPINCOUNT": wait_policy.TILES_SPIN_COUNT}
    assert env == {"GOMP_SPINCOUNT": wait_policy.TILES_SPIN_COUNT} and int(env["GOMP_SPINCOUNT"]) < 10**6
    env = {}
    assert wait_policy.apply_default_wait_policy(env, tiles=False) == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert env == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("user", [{"OMP_WAIT_POLICY": "ACTIVE"}, {"OMP_WAIT_POLICY": "passive"},
                                  {"GOMP_SPINCOUNT": "INFINITE"}, {"GOMP_SPINCOUNT": "0"}])
@pytest.mark.parametrize("tiles", [True, False])
def test_a_users_setting_is_kept(user, tiles):
    env = dict(user)
    assert wait_policy.apply_default_wait_policy(env, tiles=tiles) == {}
    assert env == user


def child_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env.update(extra, PYTHONPATH=str(REPO))
    return env


PROBE = """
import json, os, resource, time
import numpy as np
from convkernels import _cpu
from convkernels.backends.numpy import fused
seen = {k: os.environ.get(k) for k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
cpu = lambda: sum(resource.getrusage(resource.RUSAGE_SELF)[:2])
idle = None
if fused.panel_width():
    a = np.ones((600, 256), np.float32); w = np.ones((256, 256), np.float32)
    for _ in range(5):
        fused.linear(a, w, None, None, None, fused.pack_panels)  # forks the team
    t0 = cpu(); time.sleep(0.5); idle = cpu() - t0
print(json.dumps({"env": seen, "idle_cpu_s": idle, "tiles": wait_policy_tiles}))
""".replace("wait_policy_tiles", "__import__('convkernels._cpu.wait_policy', fromlist=['x']).tiles_expected()")


def probe(**extra) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE], env=child_env(OMP_NUM_THREADS="2", **extra),
                         capture_output=True, text=True, timeout=120, cwd=REPO)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_import_sets_the_policy_before_libgomp_loads_and_keeps_the_users():
    got = probe()
    want = ({"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": wait_policy.TILES_SPIN_COUNT} if got["tiles"]
            else {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None})
    assert got["env"] == want
    assert probe(OMP_WAIT_POLICY="ACTIVE")["env"] == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}


@pytest.mark.skipif(not _cpu.AVAILABLE or os.cpu_count() < 2, reason="needs the compiled kernels and two CPUs")
def test_an_idle_process_stops_spinning():
    """After its last op a process's threads sleep within milliseconds: half a second of idling
    costs well under a tenth of a CPU-second (spinning for ever, OMP_WAIT_POLICY=ACTIVE, costs
    up to the half second)"""
    got = probe()
    if got["idle_cpu_s"] is None:
        pytest.skip("no compiled gemm tiles on this CPU")
    assert got["idle_cpu_s"] < 0.1, got
