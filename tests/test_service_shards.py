"""The `shards` option of a decode through a real `convserve serve` (service/frontend/decode_request.py,
service/worker/shard_leader.py), on the NumPy backend with two CPU devices (CONVSERVE_DEVICES=0,1), each
server in two forms:
- "emulated": the first device's worker decodes the shards itself on emulated shards (threads);
- "gloo": the two workers form a real multi-process shard group, as on GPUs, with torch's gloo
  in NCCL's place (CONVSERVE_SHARD_COMM=test-gloo, tests/gloo_shards.py): the leader
  connects to the follower, joins it, hands it its band and joins the pixel rows.
The NCCL group of real GPUs is tests/gpu/test_service_shards_gpu.py's.

- shards=2 on REST and in KServe's parameters equals diffusers' AutoencoderKL decode of the same
  saved weights, and the unsharded decode of the same server;
- a Wan 2.1 clip decoded with shards=2 equals its unsharded decode (the sharded Wan decoder's own
  parity against diffusers is tests/test_sharded_wan_decode_emulated.py's), and so do FLUX.2,
  Qwen-Image and Wan 2.2 decodes;
- what cannot be sharded is a 422 naming why, and the server goes on serving;
- a shard that fails (CONVSERVE_FAULT_SHARD_FAIL_RANK) fails its request with 503 and
  Retry-After: emulated, counted in convserve_faults_total while unsharded requests go on being
  served; in a group, both workers are started again and, once the fault is gone, a sharded
  request is served by a new group.
"""
from __future__ import annotations

import io
import json
import os
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import metric, npy, scrape, wait_until_every_device_is_ready
from reference_checks import INFORMATIVE_STD, assert_informative, cross_process_atol
from service_parity import rel_l2, save_models, vae_decode_ref

NPY = {"content-type": "application/x-npy"}
TESTS = Path(__file__).resolve().parent


def group_settings(comm: str) -> dict:
    """The server settings of one form (see the module docstring)."""
    if comm == "emulated":
        return {}
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH")) if p)
    return {"shard_comm": "test-gloo", "env_extra": {"PYTHONPATH": path}}


def decode(url: str, model: str, x: np.ndarray, **params) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/{model}/decode", content=npy(x), headers=NPY,
                      params={"format": "npy", **params}, timeout=120)


def pixels(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text[:400]
    return np.load(io.BytesIO(r.content))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    pytest.importorskip("diffusers")
    return save_models(tmp_path_factory.mktemp("shards"))


@pytest.fixture(scope="module", params=["emulated", "gloo"])
def two_devices(request, server_factory, saved, tmp_path_factory):
    """The server of one form. Its rank 1 fails every sharded decode while the file `srv.gate`
    exists (CONVSERVE_FAULT_SHARD_FAIL_FILE): the failure tests, last of each form, create it and
    take it away again; until then the fault is armed, never triggered."""
    if request.param == "gloo":
        pytest.importorskip("torch.distributed")
    gate = tmp_path_factory.mktemp(f"shard-fault-{request.param}") / "failing"
    srv = server_factory(models=f"vae=tiny-vae:{saved.root / 'vae'},wan=tiny-wan-vae,taesd=tiny-taesd,"
                                "flux2=tiny-flux2-vae,qwen=tiny-qwen-image-vae,wan22=tiny-wan2.2-vae,"
                                "hy=tiny-hunyuanimage-vae,ltx=tiny-ltx2-vae,q21=tiny-qwen-image2.1-vae,"
                                "hv=tiny-hunyuanvideo1.5-vae,dc=tiny-dc-ae",
                         devices="0,1", max_queue_delay_ms=0, fault_shard_fail_rank=1, fault_shard_fail_file=str(gate),
                         **group_settings(request.param))
    srv.form, srv.gate = request.param, gate
    wait_until_every_device_is_ready(srv.url, "vae")
    return srv


def test_two_shards_equal_diffusers_and_the_unsharded_decode(two_devices, saved):
    rng = np.random.default_rng()
    lat = rng.standard_normal((2, 4, 9, 13)).astype(np.float32)  # odd rows: unequal bands
    ref = vae_decode_ref(saved.vae, lat)
    sharded = pixels(decode(two_devices.url, "vae", lat, shards="2"))
    whole = pixels(decode(two_devices.url, "vae", lat))
    assert_informative(ref, "the sharded decode's reference")
    assert rel_l2(sharded, ref) < 1e-4, rel_l2(sharded, ref)
    assert rel_l2(sharded, whole) < 1e-5, rel_l2(sharded, whole)
    # KServe v2: the option in the request's parameters
    doc = {"inputs": [{"name": "latents", "datatype": "FP32", "shape": list(lat.shape),
                       "data": lat.reshape(-1).tolist()}], "parameters": {"shards": 2}}
    r = httpx.post(f"{two_devices.url}/v2/models/vae/infer", json=doc, timeout=120)
    assert r.status_code == 200, r.text[:400]
    out = r.json()["outputs"][0]
    kserve = np.asarray(out["data"], np.float32).reshape(out["shape"])
    assert rel_l2(kserve, ref) < 1e-4
    # auto on a small image stays on one device (AUTO_RULES start at 4096x4096): the same pixels,
    # to float32 summation order (either device's worker may run it, with conv paths of its own)
    np.testing.assert_allclose(pixels(decode(two_devices.url, "vae", lat, shards="auto")), whole, rtol=0,
                               atol=cross_process_atol(whole))


def test_the_cli_sends_shards_to_a_server(two_devices, tmp_path):
    from typer.testing import CliRunner

    from service.cli.main import app

    lat = np.random.default_rng().standard_normal((1, 4, 6, 7)).astype(np.float32)
    np.save(tmp_path / "lat.npy", lat)
    for shards in ("1", "2"):
        r = CliRunner().invoke(app, ["decode", str(tmp_path / "lat.npy"), "-o", str(tmp_path / f"{shards}.npy"),
                                     "--url", two_devices.url, "--model", "vae", "--shards", shards])
        assert r.exit_code == 0, r.output
    assert rel_l2(np.load(tmp_path / "2.npy"), np.load(tmp_path / "1.npy")) < 1e-5


def test_a_wan_clip_over_two_shards_equals_its_unsharded_decode(two_devices):
    lat = np.random.default_rng().standard_normal((1, 4, 3, 7, 9)).astype(np.float32)
    whole = pixels(decode(two_devices.url, "wan", lat))
    sharded = pixels(decode(two_devices.url, "wan", lat, shards="2"))
    assert sharded.shape == whole.shape == (1, 9, 56, 72, 3)
    assert rel_l2(sharded, whole) < 1e-5, rel_l2(sharded, whole)


@pytest.mark.parametrize("model,shape", [
    ("flux2", (1, 128, 5, 3)),         # FLUX.2's patched grid: each row two of the decoder's
    ("qwen", (2, 16, 5, 3)),           # Qwen-Image: the Wan 2.1 decoder on one frame
    ("qwen", (1, 16, 1, 5, 3)),        # ... its N,C,1,h,w form
    ("wan22", (1, 12, 3, 5, 3)),       # Wan 2.2: DupUp3D shortcuts, 2x2 output patches
    ("taesd", (1, 4, 7, 5)),           # TAESD: plain convs, its upsamplers' halo
    ("hy", (1, 16, 5, 3)),             # HunyuanImage 2.1: channel-repeating shortcuts, channel-to-space
    ("ltx", (1, 8, 2, 5, 3)),          # LTX-2: reflect-padded 3-D convs, depth-to-space, whole-clip decode
    ("q21", (2, 8, 5, 3)),             # Qwen-Image 2.1: Wan 2.2's residual blocks with 2-D frame convs, 16x
    ("hv", (2, 8, 3, 5, 3)),           # HunyuanVideo 1.5: replicate-padded causal convs, frame-causal attention
    ("dc", (1, 8, 5, 3)),              # SANA's DC-AE: depthwise convs' halos, linear attention's all-reduced sums
])
def test_the_2026_families_over_two_shards_equal_their_unsharded_decode(two_devices, model, shape):
    """Their parity against diffusers is tests/test_sharded_families_emulated.py's; here, the
    served route: split, decoded by both devices, joined (the Qwen-Image 2.1 VAE's RGBA, alpha and all)."""
    lat = np.random.default_rng().standard_normal(shape).astype(np.float32)
    whole = pixels(decode(two_devices.url, model, lat))
    sharded = pixels(decode(two_devices.url, model, lat, shards="2"))
    assert sharded.shape == whole.shape and whole.std() > INFORMATIVE_STD
    assert whole.shape[-1] == (4 if model == "q21" else 3)
    assert rel_l2(sharded, whole) < 1e-5, rel_l2(sharded, whole)


def test_a_streamed_clip_over_two_shards_sends_every_group_as_the_shards_complete_it(two_devices):
    """/decode/stream with shards=2: the clip's frame groups, one record each, joined from both
    shards' rows, equal to the unsharded decode."""
    from test_streaming import read_records

    lat = np.random.default_rng().standard_normal((1, 4, 4, 9, 7)).astype(np.float32)
    whole = pixels(decode(two_devices.url, "wan", lat))
    r = httpx.post(f"{two_devices.url}/v1/models/wan/decode/stream", content=npy(lat), headers=NPY,
                   params={"format": "npy", "shards": "2"}, timeout=120)
    assert r.status_code == 200 and r.headers["x-frame-groups"] == "4", r.text[:300]
    groups, ended = read_records(r.content)
    assert ended and [g.shape[1] for g in groups] == [1, 4, 4, 4]
    assert rel_l2(np.concatenate(groups, axis=1), whole) < 1e-5


def test_a_streamed_mp4_over_two_shards_shows_the_unsharded_frames(two_devices):
    """format=mp4 with shards=2: each shard hands its rows over as uint8 (converted by its backend,
    as the unsharded stream's are), the leader joins them into the MP4's frames: decoded, they are
    the unsharded decode's pixels within the codec's error, and no frame is another's."""
    av = pytest.importorskip("av")
    lat = np.random.default_rng().standard_normal((1, 4, 3, 9, 7)).astype(np.float32)
    whole = pixels(decode(two_devices.url, "wan", lat))
    r = httpx.post(f"{two_devices.url}/v1/models/wan/decode/stream", content=npy(lat), headers=NPY,
                   params={"format": "mp4", "shards": "2", "fps": 8}, timeout=120)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4", r.text[:300]
    with av.open(io.BytesIO(r.content)) as container:
        rgb = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.float64)
    assert rgb.shape == whole.shape[1:], rgb.shape
    luma = np.array([0.299, 0.587, 0.114])
    y, y_ref = rgb @ luma, (np.clip(whole[0], 0, 1) * 255) @ luma
    err = np.abs(y - y_ref).mean()
    assert err < 2.5 and err < np.abs(y - y_ref[::-1]).mean() / 4, err


@pytest.mark.parametrize("model,shape,params,kind", [
    ("vae", (1, 4, 9, 13), {"shards": "3"}, "too-many-shards"),
    ("vae", (1, 4, 9, 13), {"shards": "two"}, "bad-shards"),
    ("vae", (1, 4, 9, 13), {"shards": "0"}, "bad-shards"),
    ("vae", (1, 4, 9, 13), {"shards": "2", "tiled": "on"}, "tiled-and-sharded"),
    ("vae", (1, 4, 1, 13), {"shards": "2"}, "too-many-shards"),
])
def test_what_cannot_be_sharded_is_a_422_naming_why(two_devices, model, shape, params, kind):
    lat = np.random.default_rng().standard_normal(shape).astype(np.float32)
    r = decode(two_devices.url, model, lat, **params)
    assert r.status_code == 422 and r.json()["type"].endswith(kind), (r.status_code, r.text[:300])
    assert decode(two_devices.url, model, lat).status_code == 200  # still serving


def test_a_failing_shard_fails_its_request_with_503_and_the_server_goes_on(two_devices):
    """Emulated shards: the failing shard fails its request, counted in convserve_faults_total,
    while unsharded requests go on being served."""
    if two_devices.form != "emulated":
        pytest.skip("a failing rank of a group: the next test")
    srv = two_devices
    lat = np.random.default_rng().standard_normal((1, 4, 9, 13)).astype(np.float32)
    s0 = scrape(srv.url)
    srv.gate.write_text("rank 1 fails while this file exists")
    try:
        r = decode(srv.url, "vae", lat, shards="2")
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text[:300])
        assert "shard 1" in json.loads(r.text)["detail"]
        assert decode(srv.url, "vae", lat).status_code == 200
        assert httpx.get(f"{srv.url}/readyz", timeout=5).status_code == 200
    finally:
        srv.gate.unlink()
    s1 = scrape(srv.url)
    assert metric(s1, "convserve_faults_total", model="vae", fault="shard_failed", outcome="failed") - \
        metric(s0, "convserve_faults_total", model="vae", fault="shard_failed", outcome="failed") == 1
    assert pixels(decode(srv.url, "vae", lat, shards="2")).shape == (1, 72, 104, 3)  # the fault is gone


def test_a_failing_rank_ends_its_group_and_a_new_group_serves_once_it_is_back(two_devices):
    """The multi-process group (gloo): rank 1 fails mid-decode while the gate file exists. Both
    workers exit and are started again; the request gets 503 with Retry-After; once the fault is
    gone, a sharded request is served by a new group and equals the unsharded decode. (Last of
    the gloo tests: its workers are new ones after it.)"""
    if two_devices.form != "gloo":
        pytest.skip("emulated shards have no group to end: the previous test")
    srv = two_devices
    lat = np.random.default_rng().standard_normal((1, 4, 9, 13)).astype(np.float32)
    s0 = scrape(srv.url)
    srv.gate.write_text("rank 1 fails while this file exists")
    try:
        r = decode(srv.url, "vae", lat, shards="2")
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text[:300], srv.log())
    finally:
        srv.gate.unlink()
    deadline = time.monotonic() + 120
    while True:
        r = decode(srv.url, "vae", lat, shards="2")
        if r.status_code == 200:
            break
        assert r.status_code == 503 and r.headers.get("retry-after"), (r.status_code, r.text[:300], srv.log())
        assert time.monotonic() < deadline, f"no new group in 120 s:\n{srv.log()}"
        time.sleep(0.2)
    assert rel_l2(pixels(r), pixels(decode(srv.url, "vae", lat))) < 1e-5
    s1 = scrape(srv.url)
    for device in ("cpu:0", "cpu:1"):
        assert metric(s1, "convserve_worker_restarts_total", device=device) - \
            metric(s0, "convserve_worker_restarts_total", device=device) >= 1, device
