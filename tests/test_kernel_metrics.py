"""Convs run through the dispatcher show up in the Prometheus exposition with the right
backend/op/path labels and counts."""
from __future__ import annotations

import numpy as np
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from convkernels import REGISTRY, _cpu, get_backend


def scrape() -> dict[tuple, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def conv_count(snap, op, path, backend="numpy"):
    return snap.get(("convkernels_conv_total", (("backend", backend), ("op", op), ("path", path))), 0.0)


def test_conv_counts_by_path_match_what_ran():
    be = get_backend("numpy")
    rng = np.random.default_rng()
    before = scrape()
    x = rng.standard_normal((1, 11, 13, 6)).astype(np.float32)
    for _ in range(3):
        be.conv2d(x, rng.standard_normal((6, 7, 7, 1)).astype(np.float32), padding=3, groups=6)
    for _ in range(2):
        be.conv2d(x, rng.standard_normal((5, 3, 3, 6)).astype(np.float32), padding=1)
    be.conv2d(x, rng.standard_normal((4, 1, 1, 6)).astype(np.float32))
    be.conv_transpose2d(x, rng.standard_normal((3, 4, 4, 6)).astype(np.float32), stride=2, padding=1)
    be.conv3d(rng.standard_normal((1, 3, 5, 5, 2)).astype(np.float32),
              rng.standard_normal((2, 3, 3, 3, 2)).astype(np.float32), padding=1)
    after = scrape()
    dw_path = "depthwise_direct" if _cpu.AVAILABLE else "depthwise_shift"
    expected = {("conv2d", dw_path): 3, ("conv2d", "im2col_gemm"): 2, ("conv2d", "pointwise_gemm"): 1,
                ("conv_transpose2d", "subpixel_gemm"): 1, ("conv3d", "im2col_gemm"): 1}
    for (op, path), n in expected.items():
        assert conv_count(after, op, path) - conv_count(before, op, path) == n, (op, path)
    # latency histogram observed once per conv, under the same labels
    key = ("convkernels_conv_seconds_count", (("backend", "numpy"), ("op", "conv2d"), ("path", dw_path)))
    assert after[key] - before.get(key, 0.0) == 3
    # memo: 5 distinct conv keys -> 5 misses; the 3 repeats are hits
    miss = ("convkernels_plan_cache_events_total", (("backend", "numpy"), ("event", "miss")))
    hit = ("convkernels_plan_cache_events_total", (("backend", "numpy"), ("event", "hit")))
    assert after[miss] - before.get(miss, 0.0) == 5
    assert after[hit] - before.get(hit, 0.0) == 3
    assert any(name == "convkernels_plan_build_seconds_count" for name, _ in after)


def test_sampling_rate_zero_records_no_latency_but_still_counts():
    be = get_backend("numpy", timing_sample_rate=0.0)
    x = np.ones((1, 9, 9, 3), np.float32)
    w = np.ones((3, 2, 2, 3), np.float32)  # a key no other test uses
    before = scrape()
    be.conv2d(x, w, dilation=3)
    after = scrape()
    assert conv_count(after, "conv2d", "im2col_gemm") - conv_count(before, "conv2d", "im2col_gemm") == 1
    key = ("convkernels_conv_seconds_count", (("backend", "numpy"), ("op", "conv2d"), ("path", "im2col_gemm")))
    assert after.get(key, 0.0) == before.get(key, 0.0)
