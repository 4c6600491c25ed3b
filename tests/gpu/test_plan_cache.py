"""The CUDA plan cache's logic without a GPU: LRU order and capacity, hit/miss/evict/fallback
events (in the Prometheus registry too), the cached FALLBACK answer, the refusal hook, and
persistence that ignores corrupt and foreign files. The cuDNN side is a stand-in builder."""
from __future__ import annotations

import os

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from convkernels import REGISTRY
from convkernels.backends.cuda.plan_cache import (Fallback, NoPlan, PlanCache, PlanEntry, PlanKey,
                                                  PlanSerializer, PlanStore)


def key(i: int, dtype="float16") -> PlanKey:
    return PlanKey(0, dtype, "fprop", (1, 9 + i, 7, 3), (5, 3, 3, 3), (1, 9 + i, 7, 5), (1, 1),
                   (1, 1), (1, 1), (1, 1), 1, False, (True, False, "silu"), (True,) * 5)


def events() -> dict[str, float]:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            if s.name == "convkernels_plan_cache_events_total" and s.labels.get("backend") == "cuda":
                out[s.labels["event"]] = s.value
    return out


class Builder:
    def __init__(self, refuse=()):
        self.calls = []
        self.refuse = set(refuse)

    def __call__(self, k):
        def build():
            self.calls.append(k)
            if k in self.refuse:
                raise NoPlan("CUDNN_STATUS_NOT_SUPPORTED (stand-in)")
            return PlanEntry(plan=("plan", k.x_shape), meta={"index": len(self.calls)})
        return build


def test_lru_capacity_hits_misses_evictions():
    before = events()
    cache, b = PlanCache(capacity=2), Builder()
    for i in (0, 1, 0, 2, 1, 0):  # 0,1 miss; 0 hit; 2 miss evicts 1 (LRU); 1 miss evicts 0; 0 miss evicts 2
        cache.get(key(i), b(key(i)))
    assert cache.counts == {"hit": 1, "miss": 5, "evict": 3, "fallback": 0}
    assert len(cache) == 2 and key(1) in cache and key(0) in cache and key(2) not in cache
    assert [k.x_shape[1] for k in b.calls] == [9, 10, 11, 10, 9]
    after = events()
    for ev, n in cache.counts.items():
        assert after.get(ev, 0) - before.get(ev, 0) == n, ev


def test_no_plan_is_cached_as_fallback_and_not_rebuilt():
    cache, b = PlanCache(), Builder(refuse={key(3)})
    first = cache.get(key(3), b(key(3)))
    second = cache.get(key(3), b(key(3)))
    assert isinstance(first, Fallback) and second is first
    assert "NOT_SUPPORTED" in first.reason
    assert len(b.calls) == 1  # the "no plan" answer was remembered
    assert cache.counts == {"hit": 1, "miss": 1, "evict": 0, "fallback": 2}


def test_refusal_hook_and_other_errors():
    cache, b = PlanCache(), Builder()
    cache.refuse = lambda k: k.x_shape[1] == 12
    assert isinstance(cache.get(key(3), b(key(3))), Fallback)
    assert b.calls == []  # refused before any build
    assert isinstance(cache.get(key(4), b(key(4))), PlanEntry)

    def broken():
        raise RuntimeError("a bug, not a missing plan")
    with pytest.raises(RuntimeError):
        cache.get(key(5), broken)
    assert key(5) not in cache  # errors are not cached


class Ser(PlanSerializer):
    def dumps(self, entry):
        return repr(entry.plan).encode()

    def loads(self, k, blob, meta):
        if not blob.startswith(b"("):
            raise ValueError("cuDNN rejects this blob (stand-in)")
        return PlanEntry(plan=("loaded", blob), meta=meta)


def test_persistence_roundtrip_corrupt_and_foreign(tmp_path):
    store = PlanStore(str(tmp_path), "NVIDIA H100 80GB HBM3", "91900")
    b = Builder()
    PlanCache(store=store, serializer=Ser()).get(key(0), b(key(0)))
    path = store.path(key(0))
    assert os.path.exists(path) and store.saved == 1

    # a restarted server: loaded from disk, not rebuilt
    store2 = PlanStore(str(tmp_path), "NVIDIA H100 80GB HBM3", "91900")
    e = PlanCache(store=store2, serializer=Ser()).get(key(0), b(key(0)))
    assert e.plan[0] == "loaded" and e.meta == {"index": 1} and len(b.calls) == 1 and store2.loaded == 1

    # another GPU's directory is separate; a foreign file copied in is ignored and rebuilt
    store3 = PlanStore(str(tmp_path), "NVIDIA H200", "91900")
    assert store3.dir != store.dir
    with open(path, "rb") as f:
        data = f.read()
    with open(store3.path(key(0)), "wb") as f:
        f.write(data)
    e = PlanCache(store=store3, serializer=Ser()).get(key(0), b(key(0)))
    assert e.plan[0] == "plan" and store3.rejected == 1 and len(b.calls) == 2

    # corrupt bytes, a truncated header, and a blob the serializer rejects: all rebuilt
    for garbage in (b"\x00garbage", data[:20], data[: len(data) - len(repr(("plan", (1, 9, 7, 3))))] + b"junk"):
        with open(path, "wb") as f:
            f.write(garbage)
        st = PlanStore(str(tmp_path), "NVIDIA H100 80GB HBM3", "91900")
        n = len(b.calls)
        e = PlanCache(store=st, serializer=Ser()).get(key(0), b(key(0)))
        assert isinstance(e, PlanEntry) and e.plan[0] == "plan" and len(b.calls) == n + 1
        assert st.rejected == 1


def test_capacity_must_be_positive():
    with pytest.raises(ValueError):
        PlanCache(capacity=0)


def test_demote_replaces_a_plan_that_failed_its_first_run():
    cache, b = PlanCache(), Builder()
    assert isinstance(cache.get(key(0), b(key(0))), PlanEntry)
    fb = cache.demote(key(0), "CUDNN_STATUS_BAD_PARAM_MISALIGNED_POINTER (stand-in)")
    assert cache.peek(key(0)) is fb and cache.counts["fallback"] == 1
    assert cache.get(key(0), b(key(0))) is fb and len(b.calls) == 1
    assert cache.counts == {"hit": 1, "miss": 1, "evict": 0, "fallback": 2}
