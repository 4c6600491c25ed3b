"""The service's processes and Python's garbage collector (service/gc_pauses.py): a served front end
and model worker have frozen their start-up heaps, and every collection's pause reaches /metrics."""
from __future__ import annotations

import gc

import httpx
import numpy as np

from live_server import metric, npy, scrape
from service import gc_pauses, metrics


def _pause_count(samples: dict, process: str, generation: str) -> float:
    return metric(samples, "convserve_gc_pause_seconds_count", process=process, generation=generation)


def test_a_served_front_end_and_worker_froze_their_start_up_heaps(live_server):
    lat = np.random.default_rng(0).standard_normal((1, 4, 5, 6)).astype(np.float32)
    r = httpx.post(f"{live_server.url}/v1/models/tiny-vae/decode", content=npy(lat),
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200
    samples = scrape(live_server.url)
    frozen = {dict(k[1])["process"]: v for k, v in samples.items() if k[0] == "convserve_gc_frozen_objects"}
    # FastAPI, pydantic and the routes are tens of thousands of objects; a worker's modules and
    # models as many: a freeze that missed its moment (or never ran) leaves far fewer or none
    assert frozen.get("frontend", 0) > 20_000, frozen
    assert frozen.get("worker", 0) > 20_000, frozen


def test_gc_freeze_false_keeps_the_collector_as_shipped(server_factory):
    srv = server_factory(models="tiny-vae", gc_freeze="false")
    samples = scrape(srv.url)
    frozen = {dict(k[1])["process"]: v for k, v in samples.items() if k[0] == "convserve_gc_frozen_objects"}
    assert frozen == {"frontend": 0.0, "worker": 0.0}


def test_each_collection_is_observed_by_generation_and_the_freezes_own_is_not():
    gc_pauses.watch("frontend")
    was_enabled = gc.isenabled()
    gc.disable()  # no collection but the test's own meanwhile (another thread's allocation could start one)
    try:
        gc_pauses.publish_pauses()
        before = {gen: _pause_count(_local(), "frontend", gen) for gen in ("0", "2")}
        gc.collect(0)
        gc.collect(2)
        gc.collect(2)
        gc_pauses.publish_pauses()
        after = {gen: _pause_count(_local(), "frontend", gen) for gen in ("0", "2")}
        assert after["2"] - before["2"] == 2
        assert after["0"] - before["0"] == 1
        frozen = gc_pauses.freeze_startup_heap("frontend")
        # frozen objects may die after the freeze (other threads drop theirs): never more than frozen
        assert 0 < gc.get_freeze_count() <= frozen
        gc_pauses.publish_pauses()
        # its own full collection is start-up work: not counted as a pause
        assert _pause_count(_local(), "frontend", "2") == after["2"]
    finally:
        gc.unfreeze()  # this test process's objects go back under the collector
        if was_enabled:
            gc.enable()


def test_freeze_disabled_freezes_nothing():
    before = gc.get_freeze_count()
    assert gc_pauses.freeze_startup_heap("worker", enabled=False) == 0
    assert gc.get_freeze_count() <= before  # nothing frozen (what was may only have died since)


def _local() -> dict[tuple, float]:
    out = {}
    for fam in metrics.REGISTRY.collect():
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out
