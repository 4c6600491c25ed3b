"""A restarted process on a persisted plan cache, the way `convserve serve` runs it: plans
loaded from disk (not built), on a worker thread other than the one that made the backend, with
autotune and CUDA graphs on, three calls (eager, capture, replay). The first H100 run of
benchmarks/service/cold_start.py (2026-11-24) lost the warm server on its first request after the log
said a stored plan "did not load (cuda_stream_is_capturing(fake_stream...) failed with context is
destroyed)"; each run here is a subprocess with faulthandler on, so a crash shows its stack."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from gpu_support import cuda_or_skip

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[2]

RUN = r"""
import json, sys, threading
import numpy as np
from convkernels import get_backend
from models import load_model

be = get_backend("cuda", dtype="float16", plan_cache_dir=sys.argv[1], autotune=True)
model = load_model("vae", "tiny-vae", be)  # seeded random weights: the same in both processes
lat = np.random.default_rng(7).standard_normal((2, 4, 9, 11)).astype(np.float32)
outs, errors = [], []

def serve():
    try:
        for _ in range(3):
            outs.append(model.decode(lat, tiled=False))
    except BaseException as exc:
        errors.append(repr(exc))

worker = threading.Thread(target=serve)
worker.start()
worker.join()
assert not errors, errors
np.save(sys.argv[2], np.stack(outs))
stats = be.plan_cache_stats()
print(json.dumps({k: stats.get(k) for k in ("store_loaded", "store_rejected", "store_saved", "miss")}))
"""


def run(cache: Path, out: Path) -> dict:
    import json

    env = {**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    p = subprocess.run([sys.executable, "-X", "faulthandler", "-c", RUN, str(cache), str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, f"exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-6000:]}"
    assert "did not load" not in p.stderr, p.stderr[-3000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_restart_on_a_persisted_plan_cache_serves_from_a_worker_thread(tmp_path):
    cuda_or_skip()
    cache = tmp_path / "plans"
    first = run(cache, tmp_path / "first.npy")
    assert first["store_saved"] > 0 and first["store_loaded"] == 0, first
    second = run(cache, tmp_path / "second.npy")
    assert second["store_loaded"] > 0 and second["store_rejected"] == 0, second
    a, b = np.load(tmp_path / "first.npy"), np.load(tmp_path / "second.npy")
    assert np.isfinite(b).all()
    # three calls (eager, captured, replayed) agree within fp16 rounding, across the restart too
    for out in (*a, *b):
        assert np.linalg.norm(out - a[0]) / np.linalg.norm(a[0]) < 1e-2
