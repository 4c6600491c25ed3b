"""Triton's model configuration, statistics and repository extensions through the real
tritonclient.http client against a real uvicorn server: the values must come from the server's
settings and from the requests this test sends (cross-checked with the Prometheus text)."""
from __future__ import annotations

import math
import threading
import time

import httpx
import numpy as np
import pytest

from live_server import metric_sum, npy, scrape

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

MAX_BATCH = 6          # not a power of two: the batcher runs 1, 2, 4 and 6 rows
QUEUE_DELAY_MS = 3.5
MAX_QUEUE = 48
SERVED = ("tiny-vae", "tiny-convnext")
BROKEN = "broken"      # an optional entry whose preset does not exist: configured, never served


@pytest.fixture(scope="module")
def server(server_factory):
    return server_factory(models=f"{','.join(SERVED)},{BROKEN}=no-such-preset?", max_batch=MAX_BATCH,
                          max_queue_delay_ms=QUEUE_DELAY_MS, max_queue=MAX_QUEUE)


@pytest.fixture(scope="module")
def client(server):
    c = httpclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60)
    yield c
    c.close()


def pixels_input(px: np.ndarray):
    inp = httpclient.InferInput("pixels", list(px.shape), "FP32")
    inp.set_data_from_numpy(px)
    return inp


def stats_of(client, model: str) -> dict:
    doc = client.get_inference_statistics(model)
    (entry,) = doc["model_stats"]
    assert entry["name"] == model and entry["version"] == "1"
    return entry


def delta(after: dict, before: dict, *path) -> int:
    a, b = after, before
    for key in path:
        a, b = a[key], b[key]
    return a - b


def batch_counts(entry: dict) -> dict[int, int]:
    return {b["batch_size"]: b["compute_infer"]["count"] for b in entry["batch_stats"]}


def test_server_lists_the_extensions(client):
    ext = client.get_server_metadata()["extensions"]
    assert {"binary_tensor_data", "model_configuration", "statistics"} <= set(ext)


def test_config_follows_metadata_and_settings(client):
    rng = np.random.default_rng()
    for name in SERVED:
        cfg, meta = client.get_model_config(name), client.get_model_metadata(name)
        assert cfg["name"] == name and cfg["max_batch_size"] == MAX_BATCH
        assert cfg["platform"] == meta["platform"]
        for section, tensors in (("input", meta["inputs"]), ("output", meta["outputs"])):
            assert [t["name"] for t in cfg[section]] == [t["name"] for t in tensors]
            for c, t in zip(cfg[section], tensors):
                assert c["data_type"] == "TYPE_" + t["datatype"]
                assert t["shape"][0] == -1 and c["dims"] == t["shape"][1:]  # the batch axis is left out
        batching = cfg["dynamic_batching"]
        assert batching["max_queue_delay_microseconds"] == QUEUE_DELAY_MS * 1000
        assert batching["preferred_batch_size"] == [1, 2, 4, 6]
        assert batching["default_queue_policy"]["max_queue_size"] == MAX_QUEUE
        assert client.get_model_config(name, model_version="1") == cfg
    # the embedding width in the config is the width inference returns
    emb_dims = {o["name"]: o["dims"] for o in client.get_model_config("tiny-convnext")["output"]}["embedding"]
    res = client.infer("tiny-convnext", [pixels_input(rng.random((1, 64, 64, 3), dtype=np.float32))])
    assert list(res.as_numpy("embedding").shape[1:]) == emb_dims
    vae_in = client.get_model_config("tiny-vae")["input"][0]
    assert vae_in["name"] == "latents" and vae_in["dims"][0] == 4  # channels, then free H, W
    with pytest.raises(InferenceServerException, match="no model named"):
        client.get_model_config("nope")
    with pytest.raises(InferenceServerException, match="only version 1"):
        client.get_model_config("tiny-vae", model_version="2")


def test_stats_count_exactly_the_requests_sent(client, server):
    rng = np.random.default_rng()
    model = "tiny-convnext"
    before, prom_before = stats_of(client, model), scrape(server.url)
    sent_rows = [2, 3, 1]
    for rows in sent_rows:  # one at a time: each request is a batch of its own
        client.infer(model, [pixels_input(rng.random((rows, 64, 64, 3), dtype=np.float32))])
    r = httpx.post(f"{server.url}/v1/models/{model}/encode", content=npy(rng.random((2, 64, 64, 3), dtype=np.float32)),
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text  # other protocols feed the same statistics
    sent_rows.append(2)
    with pytest.raises(InferenceServerException):  # 4 channels: rejected before the model, one failure
        client.infer(model, [pixels_input(rng.random((1, 64, 64, 4), dtype=np.float32))])
    t_after = time.time()
    after, prom_after = stats_of(client, model), scrape(server.url)

    ok = len(sent_rows)
    assert delta(after, before, "inference_count") == sum(sent_rows)
    assert delta(after, before, "execution_count") == ok
    for key in ("success", "queue", "compute_input", "compute_infer", "compute_output"):
        assert delta(after, before, "inference_stats", key, "count") == ok, key
    assert delta(after, before, "inference_stats", "fail", "count") == 1
    for key in ("success", "fail", "compute_infer"):
        assert delta(after, before, "inference_stats", key, "ns") > 0, key
    # every request's time covers its queue wait and its model call (1 ns of rounding per figure)
    spent = {k: delta(after, before, "inference_stats", k, "ns") for k in ("success", "queue", "compute_infer")}
    assert spent["success"] + 2 * ok >= spent["queue"] + spent["compute_infer"]
    grew = {size: n - batch_counts(before).get(size, 0) for size, n in batch_counts(after).items()}
    assert {size: n for size, n in grew.items() if n} == {1: 1, 2: 2, 3: 1}
    assert abs(after["last_inference"] - t_after * 1000) < 60_000

    # the same events as the Prometheus series, which are kept at the same points
    prom = lambda name, **labels: metric_sum(prom_after, name, **labels) - metric_sum(prom_before, name, **labels)  # noqa: E731
    assert prom("convserve_requests_total", model=model, status="200") == ok
    assert prom("convserve_requests_total", model=model) == ok + 1
    assert prom("convserve_batch_size_count", model=model) == ok
    assert prom("convserve_batch_size_sum", model=model) == sum(sent_rows)
    assert prom("convserve_queue_wait_seconds_count", model=model) == ok
    assert math.isclose(prom("convserve_queue_wait_seconds_sum", model=model),
                        delta(after, before, "inference_stats", "queue", "ns") / 1e9, rel_tol=1e-6, abs_tol=1e-6)


def test_stats_under_concurrent_requests(client, server):
    """Concurrent requests batch however the timing falls; the counts still add up exactly."""
    model, n = "tiny-vae", 9
    rng = np.random.default_rng()
    before = stats_of(client, model)
    errors, start = [], threading.Barrier(n)

    def one():
        c = httpclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60)
        try:
            lat = rng.standard_normal((1, 4, 5, 7)).astype(np.float32)
            inp = httpclient.InferInput("latents", list(lat.shape), "FP32")
            inp.set_data_from_numpy(lat)
            start.wait(30)
            c.infer(model, [inp])
        except Exception as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            c.close()

    threads = [threading.Thread(target=one) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors
    after = stats_of(client, model)
    executions = delta(after, before, "execution_count")
    assert delta(after, before, "inference_count") == n
    assert delta(after, before, "inference_stats", "success", "count") == n
    assert delta(after, before, "inference_stats", "queue", "count") == n
    assert math.ceil(n / MAX_BATCH) <= executions <= n
    grew = {size: c - batch_counts(before).get(size, 0) for size, c in batch_counts(after).items()}
    assert set(size for size, c in grew.items() if c) <= {1, 2, 4, 6}  # the sizes the config promises
    assert sum(grew.values()) == executions
    assert sum(size * c for size, c in grew.items()) == n


def test_all_models_stats(client):
    doc = client.get_inference_statistics()
    assert [e["name"] for e in doc["model_stats"]] == list(SERVED)
    for e in doc["model_stats"]:
        assert set(e["inference_stats"]) >= {"success", "fail", "queue", "compute_input", "compute_infer",
                                             "compute_output"}


def test_repository_index(client, server):
    index = {e["name"]: e for e in client.get_model_repository_index()}
    assert set(index) == {*SERVED, BROKEN}
    assert all(index[name]["state"] == "READY" for name in SERVED)
    assert index[BROKEN]["state"] == "UNAVAILABLE" and "no-such-preset" in index[BROKEN]["reason"]
    r = httpx.post(f"{server.url}/v2/repository/index", json={"ready": True}, timeout=10)
    assert r.status_code == 200 and [e["name"] for e in r.json()] == list(SERVED)
    for body in (b"[1]", b"{", b'{"ready": "yes"}'):
        r = httpx.post(f"{server.url}/v2/repository/index", content=body, timeout=10)
        assert r.status_code == 400 and r.headers["content-type"] == "application/problem+json", body
    with pytest.raises(InferenceServerException, match="CONVSERVE_MODELS"):
        client.load_model("tiny-vae")
    with pytest.raises(InferenceServerException, match="CONVSERVE_MODELS"):
        client.unload_model("tiny-vae")
    r = httpx.post(f"{server.url}/v2/repository/models/tiny-vae/load", timeout=10)
    assert r.status_code == 405 and r.json()["type"].endswith("#repository-changes-unsupported")
    assert client.is_server_ready() and client.is_model_ready("tiny-vae")
