"""The CUDA plan cache on the GPU: a key cuDNN "refuses" (test hook) goes to gemm_fallback,
the FALLBACK answer is cached (no rebuild), results stay correct and the metrics say so;
LRU eviction; persistence to a cache dir (restart loads instead of building; corrupt files
rebuilt); autotune builds a correct plan. Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations

import glob
import os

import numpy as np
import pytest

from gpu_support import cuda_or_skip
from op_backends import put, scrape
from test_cuda_paths import conv_count
from torch_reference import fresh_rng, ref_conv, rel_l2

from convkernels import ConvSpec

pytestmark = pytest.mark.gpu


def make(**options):
    cuda_or_skip()
    from convkernels import get_backend

    return get_backend("cuda", **options)


def events(snap) -> dict:
    return {ev: snap.get(("convkernels_plan_cache_events_total", (("backend", "cuda"), ("event", ev))), 0.0)
            for ev in ("hit", "miss", "evict", "fallback")}


def conv3x3(be, rng, cin=16, cout=24, hw=(19, 21), bias=True):
    x, xh = put(be, rng.standard_normal((1, *hw, cin)))
    w, wh = put(be, rng.standard_normal((cout, 3, 3, cin)) / 12)
    b, bh = put(be, rng.standard_normal(cout)) if bias else (None, None)
    spec = ConvSpec.make(2, 1, 1)
    out = be.to_host(be.conv(x, w, spec, b, activation="silu"))
    ref = ref_conv(xh, wh, bh, (1, 1), ((1, 1), (1, 1)), (1, 1), 1, None, "silu")
    return rel_l2(out, ref)


def test_refused_key_runs_gemm_fallback_cached_and_correct():
    be = make(dtype="float16")
    rng, seed = fresh_rng()
    be.plan_cache.refuse = lambda key: key.x_shape[-1] == 16 and key.kind == "fprop"
    before = scrape()
    errs = [conv3x3(be, rng) for _ in range(3)]
    after = scrape()
    assert max(errs) < 1e-2, f"seed {seed}: {errs}"
    assert conv_count(after, "conv2d", "gemm_fallback") - conv_count(before, "conv2d", "gemm_fallback") == 3
    assert conv_count(after, "conv2d", "cudnn") - conv_count(before, "conv2d", "cudnn") == 0
    d = {k: events(after)[k] - events(before)[k] for k in events(after)}
    assert d == {"hit": 2, "miss": 1, "evict": 0, "fallback": 3}, d
    st = be.plan_cache_stats()
    assert st["fallbacks"] == 1 and st["plans"] == 0
    # a key the hook does not refuse still takes cuDNN
    before = scrape()
    assert conv3x3(be, rng, cin=8) < 1e-2
    assert conv_count(scrape(), "conv2d", "cudnn") - conv_count(before, "conv2d", "cudnn") == 1


def test_lru_eviction_and_alignment_in_key():
    be = make(dtype="float16", plan_cache_capacity=2)
    rng, seed = fresh_rng()
    before = scrape()
    for hw in ((9, 9), (10, 9), (9, 9), (11, 9), (10, 9)):
        assert conv3x3(be, rng, hw=hw) < 1e-2, f"seed {seed}"
    d = {k: events(scrape())[k] - events(before)[k] for k in ("hit", "miss", "evict")}
    assert d == {"hit": 1, "miss": 4, "evict": 2}, d
    assert be.plan_cache_stats()["size"] == 2
    # an input that starts 2 bytes into a buffer (not 16-byte aligned) is a different plan key
    x = be.asarray(rng.standard_normal((1 * 9 * 9 * 16 + 1,)).astype(np.float32))[1:].reshape(1, 9, 9, 16)
    w = be.asarray(rng.standard_normal((24, 3, 3, 16)).astype(np.float32) / 12)
    n0 = be.plan_cache.counts["miss"]
    xh = be.to_host(x).astype(np.float64)
    out = be.to_host(be.conv2d(x, w, padding=1))
    ref = ref_conv(xh, be.to_host(w).astype(np.float64), None, (1, 1), ((1, 1), (1, 1)), (1, 1), 1)
    assert rel_l2(out, ref) < 1e-2
    assert be.plan_cache.counts["miss"] == n0 + 1


def test_persistence_restart_loads_and_corrupt_files_rebuild(tmp_path):
    rng, seed = fresh_rng()
    be1 = make(dtype="float16", plan_cache_dir=str(tmp_path))
    assert conv3x3(be1, rng) < 1e-2
    st = be1.plan_cache_stats()
    files = glob.glob(os.path.join(st["store_dir"], "*.plan"))
    assert st["store_saved"] == 1 and len(files) == 1, st
    be2 = make(dtype="float16", plan_cache_dir=str(tmp_path))  # a restarted server
    assert conv3x3(be2, rng) < 1e-2, f"seed {seed}"
    st2 = be2.plan_cache_stats()
    assert st2["store_loaded"] == 1 and st2["store_rejected"] == 0, st2
    with open(files[0], "r+b") as f:  # corrupt the serialized plan after the header
        f.seek(-64, 2)
        f.write(os.urandom(64))
    be3 = make(dtype="float16", plan_cache_dir=str(tmp_path))
    assert conv3x3(be3, rng) < 1e-2, f"seed {seed}"
    st3 = be3.plan_cache_stats()
    assert st3["store_loaded"] == 0 and st3["store_rejected"] == 1, st3  # checksum: never handed to cuDNN
    with open(files[0], "wb") as f:
        f.write(b"not a plan")
    be4 = make(dtype="float16", plan_cache_dir=str(tmp_path))
    assert conv3x3(be4, rng) < 1e-2
    assert be4.plan_cache_stats()["store_rejected"] == 1


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_autotuned_plans_are_correct(dtype):
    be = make(dtype=dtype, autotune=True, autotune_max_plans=8)
    rng, seed = fresh_rng()
    tol = 1e-5 if dtype == "float32" else 1e-2
    assert conv3x3(be, rng, cin=32, cout=32, hw=(24, 20)) < tol, f"seed {seed}"
    entry = next(e for e in be.plan_cache._entries.values())
    assert getattr(entry, "meta", {}).get("plan_index") is not None


def test_small_kd_choice_is_measured_with_autotune():
    be = make(dtype="bfloat16", autotune=True, autotune_max_plans=4)
    rng, seed = fresh_rng()
    x, xh = put(be, rng.standard_normal((1, 6, 12, 14, 32)))
    w, wh = put(be, rng.standard_normal((32, 3, 3, 3, 32)) / 16)
    out = be.to_host(be.conv3d(x, w, padding=((0, 0), (1, 1), (1, 1))))
    ref = ref_conv(xh, wh, None, (1, 1, 1), ((0, 0), (1, 1), (1, 1)), (1, 1, 1), 1)
    assert rel_l2(out, ref) < 1e-2, f"seed {seed}"
    (key, times), = be.measurements.items()
    assert set(times) == {"cudnn", "small_kd_2d"}
    chosen = [c["path"] for c in be.conv_choices() if c["op"] == "conv3d"]
    assert chosen == [min(times, key=times.get)]
    print("small_kd_2d measurement (ms):", times)
