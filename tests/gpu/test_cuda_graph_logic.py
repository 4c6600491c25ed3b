"""The CPU-side bookkeeping of whole-forward CUDA graphs (convkernels/backends/cuda/graphs.py):
the per-backend LRU over every model's graphs, releasing what it evicts, the exported gauges
(read back from the Prometheus registry's text), and the service settings that reach the
backend constructor. Runs everywhere; test_cuda_graphs.py checks the same on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
from prometheus_client import generate_latest

from convkernels import REGISTRY
from convkernels.backends.cuda.graphs import GraphCache


class Entry:
    """A captured graph as the cache sees it: its pool bytes, and whether it was released."""

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.released = False

    def release(self) -> None:
        self.released = True
        self.nbytes = 0


def gauge(name: str, backend: str) -> float:
    for line in generate_latest(REGISTRY).decode().splitlines():
        if line.startswith(f'{name}{{backend="{backend}"}} '):
            return float(line.split()[-1])
    raise AssertionError(f"{name} for backend {backend} not exported")


def test_lru_evicts_the_least_recently_used_over_all_forwards_and_releases_it():
    cache = GraphCache(capacity=3, backend_name="graph-test-lru")
    entries = {k: Entry(n) for k, n in [((0, "a"), 100), ((1, "a"), 200), ((0, "b"), 300)]}
    for key, e in entries.items():
        assert cache.put(key, e) == []
    assert cache.get((0, "a")) is entries[(0, "a")]  # now the most recent
    newest = Entry(400)
    assert cache.put((2, "a"), newest) == [(1, "a")]  # forward 1's graph was the oldest
    assert entries[(1, "a")].released and not entries[(0, "a")].released
    assert cache.get((1, "a")) is None
    assert sorted(cache.keys_of(0)) == ["a", "b"] and cache.keys_of(2) == ["a"]
    assert cache.held_bytes() == 100 + 300 + 400 and cache.held_bytes(0) == 400
    assert cache.evictions == 1


def test_replacing_a_key_releases_the_old_graph():
    cache = GraphCache(capacity=2, backend_name="graph-test-replace")
    old, new = Entry(10), Entry(20)
    cache.put((0, "k"), old)
    cache.put((0, "k"), new)
    assert old.released and not new.released and len(cache) == 1 and cache.held_bytes() == 20


def test_dropping_a_forward_releases_only_its_graphs():
    cache = GraphCache(capacity=8, backend_name="graph-test-drop")
    mine = [Entry(5), Entry(6)]
    other = Entry(7)
    cache.put((3, "x"), mine[0])
    cache.put((4, "x"), other)
    cache.put((3, "y"), mine[1])
    cache.drop_owner(3)
    assert all(e.released for e in mine) and not other.released
    assert cache.keys_of(3) == [] and cache.held_bytes() == 7


def test_graphs_held_and_pool_bytes_are_exported_as_gauges():
    name = "graph-test-gauges"
    cache = GraphCache(capacity=2, backend_name=name)
    cache.put((0, "a"), Entry(1000))
    cache.put((0, "b"), Entry(24))
    assert gauge("convkernels_cuda_graphs", name) == 2
    assert gauge("convkernels_cuda_graph_pool_bytes", name) == 1024
    cache.put((0, "c"), Entry(1))  # evicts the 1000-byte graph
    assert gauge("convkernels_cuda_graphs", name) == 2
    assert gauge("convkernels_cuda_graph_pool_bytes", name) == 25
    cache.drop_owner(0)
    assert gauge("convkernels_cuda_graphs", name) == 0
    assert gauge("convkernels_cuda_graph_pool_bytes", name) == 0


def test_capacity_below_one_is_one():
    cache = GraphCache(capacity=0, backend_name="graph-test-cap")
    a, b = Entry(1), Entry(2)
    cache.put((0, "a"), a)
    cache.put((0, "b"), b)
    assert a.released and len(cache) == 1


def test_a_graph_over_the_byte_bound_is_not_admitted():
    cache = GraphCache(capacity=4, backend_name="graph-test-bytes", max_graph_bytes=1000)
    assert cache.admits(1000) and not cache.admits(1001)
    assert GraphCache(backend_name="graph-test-default").admits(4 << 30)


def test_service_settings_pass_graph_options_to_the_cuda_backend_only(monkeypatch):
    from convkernels import get_backend
    from service.settings import Settings

    monkeypatch.setenv("CONVSERVE_CUDA_GRAPHS", "0")
    monkeypatch.setenv("CONVSERVE_CUDA_GRAPH_CAPACITY", "5")
    monkeypatch.setenv("CONVSERVE_CUDA_AUTOTUNE_PLANS", "3")
    monkeypatch.setenv("CONVSERVE_CUDA_GRAPH_MAX_BYTES", "1000")
    opts = Settings().backend_options()
    cuda = opts["cuda_options"]
    assert (cuda["cuda_graphs"], cuda["graph_capacity"], cuda["autotune_max_plans"], cuda["graph_max_bytes"]) \
        == (False, 5, 3, 1000)
    monkeypatch.delenv("CONVSERVE_CUDA_GRAPHS")
    assert Settings().backend_options()["cuda_options"]["cuda_graphs"] is True  # on by default
    # a backend other than cuda ignores the cuda-only options
    assert get_backend("numpy", **opts).name == "numpy"


FUSIONS = {"dw_ln": False, "dw_bias_in_ln": True, "lt_epilogues": True, "lt_gelu_approx": True, "ln_vec": True}


def test_service_settings_pass_the_fusion_switches_to_the_cuda_backend(monkeypatch):
    """CONVSERVE_CUDA_DW_LN & co. are read by the service's settings only and reach the cuda
    backend's constructor; unset, they are the backend's own defaults."""
    import dataclasses

    from service.settings import Settings

    for key in FUSIONS:
        monkeypatch.delenv(f"CONVSERVE_CUDA_{key.upper()}", raising=False)
    cuda = Settings().backend_options()["cuda_options"]
    assert {k: cuda[k] for k in FUSIONS} == FUSIONS
    for key, default in FUSIONS.items():
        monkeypatch.setenv(f"CONVSERVE_CUDA_{key.upper()}", "1" if not default else "0")
    cuda = Settings().backend_options()["cuda_options"]
    assert {k: cuda[k] for k in FUSIONS} == {k: not v for k, v in FUSIONS.items()}
    # the backend's options take every cuda option, with the same fusion defaults (importable
    # without cupy)
    from convkernels.backends.cuda.options import CudaOptions
    defaults = {f.name: f.default for f in dataclasses.fields(CudaOptions)}
    assert {k: defaults[k] for k in FUSIONS} == FUSIONS
    assert set(cuda) <= set(defaults)


def test_bad_graph_capacity_fails_settings(monkeypatch):
    from pydantic import ValidationError

    from service.settings import Settings

    monkeypatch.setenv("CONVSERVE_CUDA_GRAPH_CAPACITY", "0")
    with pytest.raises(ValidationError):
        Settings()


def test_records_until_a_shape_runs_eagerly_for_good():
    """GraphedForward.records (what Wan's decode asks before taking its functional step): True
    for shapes never seen and ones still capturable; False once a shape is ungraphable or its
    graph was over the byte bound. Several inputs make one key, in order."""
    from convkernels.backends.cuda.graphs import GraphedForward

    graphed = GraphedForward(object(), lambda *xs: xs, GraphCache(backend_name="graph-test-records"))
    x, cache = np.zeros((1, 2, 3, 4), np.float16), np.zeros((1, 2, 5, 4), np.float16)
    assert graphed.records(x) and graphed.records(x, cache)
    graphed.too_large[GraphedForward._key((x, cache))] = 5 << 30
    assert not graphed.records(x, cache) and graphed.records(cache, x) and graphed.records(x)
    graphed.ungraphable[GraphedForward._key((x,))] = "RuntimeError: a host sync"
    assert not graphed.records(x)
    assert graphed.stats()["too_large"] and graphed.stats()["ungraphable"]  # keys as strings, for JSON
