"""The sharded decode through the service on real GPUs: `shards=2` requests to a real `convserve serve` on
two GPUs (CONVSERVE_SHARD_GROUPS=1), where the first GPU's model worker leads an NCCL group with the
second's (service/worker/shard_leader.py). Skipped with fewer than two GPUs (the same request path on emulated
shards: tests/test_service_shards.py).

- float32, a diffusers AutoencoderKL's saved weights: shards=2 equals diffusers' decode and the
  server's own unsharded decode; the group made by the first request serves the next;
- a Wan 2.1 clip: shards=2 equals the unsharded decode, whole and streamed;
- a shard that fails (CONVSERVE_FAULT_SHARD_FAIL_RANK=1, while a file exists) fails its request
  with 503 and Retry-After; both workers of the group are started again, and once the fault is
  gone a sharded request succeeds on a new group.
"""
from __future__ import annotations

import io
import time

import httpx
import numpy as np
import pytest
from gpu_support import cuda_or_skip, report_parity

pytestmark = pytest.mark.gpu
NPY = {"content-type": "application/x-npy"}


@pytest.fixture(scope="module", autouse=True)
def two_gpus():
    cuda_or_skip()
    import cupy as cp
    if cp.cuda.runtime.getDeviceCount() < 2:
        pytest.skip("needs two GPUs (a multi-GPU device kind)")
    from cupy.cuda import nccl  # noqa: F401


def decode(url, model, x, **params):
    from live_server import npy
    return httpx.post(f"{url}/v1/models/{model}/decode", content=npy(x), headers=NPY,
                      params={"format": "npy", **params}, timeout=300)


def pixels(r, server=None):
    assert r.status_code == 200, r.text[:400] + (diagnose(server) if server is not None else "")
    return np.load(io.BytesIO(r.content))


def diagnose(server) -> str:
    """The server log's tail, with every model worker's thread stacks (SIGUSR1, model_worker.main)
    where the answering front end knows its workers; the log is kept in $OUT whatever happens."""
    import os
    import signal

    try:
        for m in httpx.get(f"{server.url}/v1/models", timeout=10).json().get("models", []):
            for d in m.get("devices", []):
                if d.get("pid"):
                    os.kill(d["pid"], signal.SIGUSR1)
        time.sleep(2)
    except (httpx.HTTPError, ValueError, OSError):
        pass  # the log is what matters
    text = server.log_path.read_text(errors="replace")[-60000:]
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        with open(os.path.join(out, "shard_diagnosis.txt"), "a") as f:
            f.write(text)
    return "\n--- server log ---\n" + text[-3000:]


def test_two_gpu_requests_equal_diffusers_and_the_unsharded_decode(tmp_path_factory):
    from live_server import npy as npy_bytes, start_server, wait_until_every_device_is_ready
    from service_parity import rel_l2, save_models, vae_decode_ref

    saved = save_models(tmp_path_factory.mktemp("shards_gpu"))
    server = start_server(tmp_path_factory.mktemp("servers"), ready_timeout=240, backend="cuda", dtype="float32",
                          devices="0,1", models=f"vae=tiny-vae:{saved.root / 'vae'},wan=tiny-wan-vae", log_level="info",
                          request_timeout_s=150, shard_groups=1)
    wait_until_every_device_is_ready(server.url, "vae", timeout=240)
    try:
        rng = np.random.default_rng()
        errs = []
        for shape in [(2, 4, 9, 13), (1, 4, 16, 11)]:  # the second request reuses the group
            lat = rng.standard_normal(shape).astype(np.float32)
            sharded = pixels(decode(server.url, "vae", lat, shards="2"), server)
            whole = pixels(decode(server.url, "vae", lat))
            ref = vae_decode_ref(saved.vae, lat)
            errs.append((rel_l2(sharded, ref), rel_l2(sharded, whole)))
            assert errs[-1][0] < 1e-4 and errs[-1][1] < 1e-5, errs
        clip = rng.standard_normal((1, 4, 3, 9, 7)).astype(np.float32)
        wan_whole = pixels(decode(server.url, "wan", clip))
        wan_err = rel_l2(pixels(decode(server.url, "wan", clip, shards="2")), wan_whole)
        # the streamed route: one record per frame group, joined from both GPUs' rows
        from test_streaming import read_records
        r = httpx.post(f"{server.url}/v1/models/wan/decode/stream", content=npy_bytes(clip), headers=NPY,
                       params={"format": "npy", "shards": "2"}, timeout=300)
        groups, ended = read_records(r.content)
        assert r.status_code == 200 and ended and rel_l2(np.concatenate(groups, axis=1), wan_whole) < 1e-5
        report_parity(f"service shards=2 on 2 GPUs, float32: vs diffusers {errs[0][0]:.2e} / {errs[1][0]:.2e}, "
                      f"vs unsharded {errs[0][1]:.2e} / {errs[1][1]:.2e}; Wan vs unsharded {wan_err:.2e}")
        assert wan_err < 1e-5
    finally:
        server.stop()


def test_a_failing_shard_fails_the_request_and_the_group_comes_back(tmp_path_factory):
    from live_server import metric, scrape, start_server, wait_until_every_device_is_ready
    from reference_checks import cross_process_atol

    gate = tmp_path_factory.mktemp("fault") / "failing"
    gate.write_text("rank 1 fails while this file exists")
    server = start_server(tmp_path_factory.mktemp("servers_fault"), ready_timeout=240, backend="cuda",
                          dtype="float32", devices="0,1", models="tiny-vae", fault_shard_fail_rank=1,
                          fault_shard_fail_file=str(gate), shard_groups=1)
    wait_until_every_device_is_ready(server.url, "tiny-vae", timeout=240)
    try:
        lat = np.random.default_rng().standard_normal((1, 4, 9, 13)).astype(np.float32)
        r = decode(server.url, "tiny-vae", lat, shards="2")
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text[:300], diagnose(server))
        gate.unlink()
        deadline = time.monotonic() + 240
        while True:  # both workers started again and ready: the sharded request is served
            r = decode(server.url, "tiny-vae", lat, shards="2")
            if r.status_code == 200:
                break
            assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text[:300])
            assert time.monotonic() < deadline, "the shard group did not come back"
            time.sleep(1)
        # the new group's pixels and an unsharded decode on either GPU: two processes, each with the
        # cuDNN plans it chose, so equal to float32 summation order
        whole = pixels(decode(server.url, "tiny-vae", lat))
        np.testing.assert_allclose(pixels(r), whole, rtol=0, atol=cross_process_atol(whole))
        s = scrape(server.url)
        assert metric(s, "convserve_worker_restarts_total", device="cuda:1") >= 1
    finally:
        server.stop()
