"""Faults injected through settings (service/worker/fault_injection.py), each survived and counted in
`convserve_faults_total`: a device out-of-memory during decode is retried in smaller tiles and
succeeds (checked against a decode in those tiles) or answers 503 + Retry-After; a model bug
fails only its own batch (500 with an error id that is also in the log) while the worker keeps
serving; a weights file with a bad tensor stops the model from loading with a message naming
the tensor; corrupt plan-cache files are ignored (the CPU half of the CUDA plan-cache faults:
the GPU half is tests/gpu/test_cuda_plan_cache.py)."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import REPO, free_port, from_npy, metric, npy, scrape
from test_service_limits import assert_problem

NPY = {"content-type": "application/x-npy"}
GOLDEN_WEIGHTS = REPO / "tests" / "golden" / "tiny_vae_decoder.safetensors"
POISON = 31337.0


def lat(*shape):
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def decode(url, x, model="tiny-vae", **params):
    return httpx.post(f"{url}/v1/models/{model}/decode", content=npy(x), headers=NPY,
                      params={"format": "npy", **params}, timeout=120)


def fault_count(snap, fault, outcome, model="tiny-vae"):
    return metric(snap, "convserve_faults_total", model=model, fault=fault, outcome=outcome)


# ---- device out of memory -----------------------------------------------------------------------
# tiny-vae decodes 32-latent tiles by default; its widest conv activation is 32 channels at full
# resolution, so 1.5 MB fits a 8-latent tile (64x64x32x4 = 0.5 MB) but not a 16-latent one (2.1 MB)
OOM_LIMIT = 1_500_000


def test_device_oom_retries_in_smaller_tiles_and_succeeds(server_factory):
    srv = server_factory(models="tiny-vae", fault_oom_above_bytes=OOM_LIMIT)
    s0 = scrape(srv.url)
    x = lat(1, 4, 21, 19)  # 168x152 px: untiled, then 32-, 16-latent tiles run out; 8-latent tiles fit
    r = decode(srv.url, x)
    assert r.status_code == 200, r.text
    got = from_npy(r.content)
    s1 = scrape(srv.url)
    assert fault_count(s1, "device_oom", "recovered") - fault_count(s0, "device_oom", "recovered") == 1
    assert fault_count(s1, "device_oom", "retried") - fault_count(s0, "device_oom", "retried") == 3
    assert fault_count(s1, "device_oom", "failed") == fault_count(s0, "device_oom", "failed")

    # the answer is the model's own decode in 8-latent tiles (same seeded random weights)
    from convkernels import get_backend
    from models import load_model
    from models.autoencoder_kl import AutoencoderKLOptions
    ref = load_model("tiny-vae", "tiny-vae", get_backend("numpy"),
                     options=AutoencoderKLOptions(tile_latent_size=8)).decode(x, tiled=True)
    assert got.shape == ref.shape == (1, 168, 152, 3)
    err = np.linalg.norm(got - ref) / np.linalg.norm(ref)
    print(f"RELIABILITY fault=device_oom outcome=recovered rel_l2_vs_8_latent_tiles={err:.2e}")
    assert err < 1e-5

    # a small request needs no retry; a batch of two recovers row by row
    assert decode(srv.url, lat(1, 4, 3, 5)).status_code == 200
    r = decode(srv.url, lat(2, 4, 17, 9))
    assert r.status_code == 200 and from_npy(r.content).shape == (2, 136, 72, 3)
    s2 = scrape(srv.url)
    assert fault_count(s2, "device_oom", "recovered") - fault_count(s1, "device_oom", "recovered") == 1
    assert srv.proc.poll() is None


def test_device_oom_beyond_the_smallest_tile_is_503(server_factory):
    srv = server_factory(models="tiny-vae", fault_oom_above_bytes=200_000)  # not even an 8-latent tile fits
    s0 = scrape(srv.url)
    r = decode(srv.url, lat(1, 4, 20, 20))
    assert_problem(r, 503, "device-out-of-memory", "smallest tiles")
    assert int(r.headers["retry-after"]) >= 1
    s1 = scrape(srv.url)
    assert fault_count(s1, "device_oom", "failed") - fault_count(s0, "device_oom", "failed") == 1
    assert fault_count(s1, "device_oom", "recovered") == fault_count(s0, "device_oom", "recovered")
    # the worker is fine: what fits the "device" still decodes, and the server is ready
    r = decode(srv.url, lat(1, 4, 2, 3))
    assert r.status_code == 200 and from_npy(r.content).shape == (1, 16, 24, 3)
    assert httpx.get(f"{srv.url}/readyz").status_code == 200
    print("RELIABILITY fault=device_oom outcome=503 server_ready_after=yes")


# ---- a model bug inside the worker ----------------------------------------------------------------
def test_worker_exception_fails_only_its_batch_and_the_worker_keeps_serving(server_factory):
    srv = server_factory(models="tiny-vae", max_batch=4, max_queue_delay_ms=30, fault_poison_value=POISON)
    s0 = scrape(srv.url)
    bad = lat(1, 4, 6, 7)
    bad[0, 2, 3, 4] = POISON
    r = decode(srv.url, bad)
    assert_problem(r, 500, "model-error", "injected worker fault")
    error_id = r.json()["error_id"]
    assert error_id and error_id in r.json()["detail"]
    deadline = time.monotonic() + 5
    while error_id not in srv.log_path.read_text(errors="replace") and time.monotonic() < deadline:
        time.sleep(0.05)
    log = srv.log_path.read_text(errors="replace")
    assert error_id in log and "Traceback" in log and "injected worker fault" in log

    # the poisoned request beside good ones: requests batched with it may fail with it, every
    # request in another batch (another shape: never batched together) succeeds
    poisoned_shape_good = [lat(1, 4, 6, 7) for _ in range(3)]
    other = [lat(1, 4, 5, 5) for _ in range(6)]
    with ThreadPoolExecutor(10) as pool:
        bad_f = pool.submit(decode, srv.url, bad)
        same = [pool.submit(decode, srv.url, x) for x in poisoned_shape_good]
        others = [pool.submit(decode, srv.url, x) for x in other]
        rb, rs, ro = bad_f.result(), [f.result() for f in same], [f.result() for f in others]
    assert rb.status_code == 500
    assert all(r.status_code in (200, 500) for r in rs), [r.status_code for r in rs]
    assert [r.status_code for r in ro] == [200] * len(ro)
    failed = 1 + sum(r.status_code == 500 for r in rs)
    for r in rs:
        if r.status_code == 500:  # failed with it, so it shared its batch: same error id
            assert r.json()["type"].endswith("#model-error")

    # afterwards every shape decodes again
    for x in (lat(1, 4, 6, 7), lat(2, 4, 5, 5)):
        assert decode(srv.url, x).status_code == 200
    s1 = scrape(srv.url)
    assert fault_count(s1, "worker_exception", "failed") - fault_count(s0, "worker_exception", "failed") == failed + 1
    assert metric(s1, "convserve_requests_total", model="tiny-vae", endpoint="decode", status=500) - \
        metric(s0, "convserve_requests_total", model="tiny-vae", endpoint="decode", status=500) == failed + 1
    assert srv.proc.poll() is None
    print(f"RELIABILITY fault=worker_exception failed_requests={failed + 1} others_ok={len(ro) + 2}")


# ---- bad weights at start-up ----------------------------------------------------------------------
def start_unready(tmp_path: Path, **settings) -> tuple[subprocess.Popen, str, Path]:
    """A server started in a process of its own, its output in a log file."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    env.update({"CONVSERVE_BACKEND": "numpy", "CONVSERVE_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1"})
    env.update({f"CONVSERVE_{k.upper()}": str(v) for k, v in settings.items()})
    log_path = tmp_path / f"server-{port}.log"
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], cwd=REPO,
                            env=env, stdout=open(log_path, "wb"), stderr=subprocess.STDOUT)
    return proc, f"http://127.0.0.1:{port}", log_path


def bad_checkpoints(tmp_path: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, text the error must name)."""
    from safetensors.numpy import load_file, save_file

    good = load_file(str(GOLDEN_WEIGHTS))
    names = sorted(k for k in good if k.endswith(".weight") and good[k].ndim == 4)
    out = {}
    t = dict(good)
    victim = names[len(names) // 2]
    t[victim] = np.ascontiguousarray(t[victim][:-1])  # one output channel short
    save_file(t, str(tmp_path / "misshaped.safetensors"))
    out["misshaped"] = (tmp_path / "misshaped.safetensors", victim)
    t = dict(good)
    victim_nan = names[1]
    t[victim_nan] = t[victim_nan].copy()
    t[victim_nan].reshape(-1)[7] = np.nan
    save_file(t, str(tmp_path / "nan.safetensors"))
    out["nan"] = (tmp_path / "nan.safetensors", victim_nan)
    data = GOLDEN_WEIGHTS.read_bytes()
    (tmp_path / "truncated.safetensors").write_bytes(data[: len(data) // 2])
    out["truncated"] = (tmp_path / "truncated.safetensors", "truncated.safetensors")
    return out


def test_bad_weights_fail_start_up_naming_the_tensor(tmp_path):
    """A checkpoint that is misshaped, holds a NaN or is cut short fails the server's start: exit 2
    with one line naming the tensor (or the file), so an orchestrator restarts the pod and shows
    why. (A worker restarted later whose load fails is served as 503 instead:
    test_service_cli.test_a_restarted_worker_that_fails_to_load_is_served_as_503.)"""
    cases = bad_checkpoints(tmp_path)
    procs = [(name,) + start_unready(tmp_path, models=f"tiny-vae=tiny-vae:{path}") for name, (path, _) in cases.items()]
    try:
        for name, proc, _url, log_path in procs:
            assert proc.wait(120) == 2, (name, log_path.read_text(errors="replace")[-3000:])
            text = log_path.read_text(errors="replace")
            assert "Traceback" not in text, (name, text[-3000:])
            errors = [line for line in text.splitlines() if line.startswith("convserve: error: ")]
            must = cases[name][1]
            assert len(errors) == 1 and must in errors[0], (name, text[-3000:])
            print(f"RELIABILITY fault=bad_weights case={name} exit=2 names={must!r}")
    finally:
        for _, proc, _, _ in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(15)


# ---- plan cache files (pure Python, so on the CPU) ------------------------------------------------
def test_plan_cache_ignores_unreadable_and_lying_files(tmp_path):
    """Beyond tests/gpu/test_plan_cache.py (garbage, truncated, foreign GPU, rejected blob): a
    directory where the file should be, an empty file, and a header length that lies."""
    from convkernels.backends.cuda.plan_cache import FILE_MAGIC, PlanCache, PlanEntry, PlanKey, PlanSerializer, PlanStore

    class Ser(PlanSerializer):
        def dumps(self, entry):
            return b"plan-bytes"

        def loads(self, k, blob, meta):
            return PlanEntry(plan=("loaded", blob), meta=meta)

    key = PlanKey(0, "float16", "fprop", (1, 13, 11, 3), (5, 3, 3, 3), (1, 13, 11, 5), (1, 1), (1, 1), (1, 1),
                  (1, 1), 1, False, (True, False, None), (True,) * 5)
    builds = []

    def build():
        builds.append(1)
        return PlanEntry(plan=("built", len(builds)), meta={})

    def fresh():
        st = PlanStore(str(tmp_path), "NVIDIA H100", "91900")
        return st, PlanCache(store=st, serializer=Ser())

    st, cache = fresh()
    path = st.path(key)
    os.makedirs(path)  # a directory squatting on the file name: unreadable, and unsavable too
    e = cache.get(key, build)
    assert isinstance(e, PlanEntry) and e.plan[0] == "built" and len(builds) == 1
    os.rmdir(path)
    for content in (b"", FILE_MAGIC + (10**9).to_bytes(4, "little") + b"{}",
                    FILE_MAGIC + (3).to_bytes(4, "little") + b"\xff\xfe\xfd" + b"blob"):
        with open(path, "wb") as f:
            f.write(content)
        st, cache = fresh()
        n = len(builds)
        e = cache.get(key, build)
        assert isinstance(e, PlanEntry) and e.plan[0] == "built" and len(builds) == n + 1
        assert st.rejected == 1, content[:20]
    # and the rebuilt plan was saved over the bad file: the next start loads it
    st, cache = fresh()
    assert cache.get(key, build).plan == ("loaded", b"plan-bytes") and st.loaded == 1


def test_video_decoder_oom_retries_in_smaller_tiles_in_process():
    """The same recovery for the Wan video VAE (tiles in pixels, tile size and stride halved),
    called as the worker calls it; the result equals the model's own decode in those tiles."""
    from convkernels import get_backend
    from models import load_model
    from models.nn.tiling import video_tiles
    from service.worker import fault_injection, oom_recovery
    from service.hosted_model import HostedModel
    from service.settings import ModelEntry

    be = get_backend("numpy")
    model = load_model("tiny-wan-vae", "tiny-wan-vae", be)
    fault_injection.arm(be, fault_injection.FaultSettings(oom_above_bytes=1_500_000))  # 96x96 frames: 2.4 MB convs; 64-px tiles: 1 MB
    x = np.random.default_rng().standard_normal((1, 4, 2, 12, 12)).astype(np.float32)
    with pytest.raises(MemoryError):
        model.decode(x, tiled=False)
    hm = HostedModel(ModelEntry("tiny-wan-vae", "tiny-wan-vae"), model, load_seconds=0.0)
    out = oom_recovery.decode(hm, x, tiled=None, clamp=True)
    assert model.tiling.tile_px == 256  # the model's own tiles are back after the retry
    ref_model = load_model("tiny-wan-vae", "tiny-wan-vae", get_backend("numpy"))
    ref_model.tiling = video_tiles(64, 48)
    ref = ref_model.decode(x, tiled=True)
    assert out.shape == ref.shape == (1, 5, 96, 96, 3)
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    print(f"RELIABILITY fault=device_oom model=tiny-wan-vae outcome=recovered rel_l2_vs_64px_tiles={err:.2e}")
    assert err < 1e-5


def test_an_unexpected_exception_in_a_route_is_a_problem_with_an_error_id(caplog):
    """Any bug that escapes a route still answers problem+json (500, error_id) and logs the
    traceback under the same id (the safety net behind every fix the fuzzers led to)."""
    from fastapi.testclient import TestClient

    from service.frontend.app import create_app
    from service.settings import Settings

    app = create_app(Settings(backend="numpy", models="tiny-vae"))

    @app.get("/boom")
    async def boom():
        raise KeyError("a bug")

    client = TestClient(app, raise_server_exceptions=False)  # no lifespan: no models needed
    with caplog.at_level("ERROR", logger="convserve"):
        r = client.get("/boom")
    assert r.status_code == 500 and r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["type"].endswith("#internal-error") and body["error_id"] in body["detail"]
    assert "a bug" not in body["detail"]  # internals stay in the log
    logged = [rec for rec in caplog.records if body["error_id"] in rec.getMessage()]
    assert logged and logged[0].exc_info is not None
