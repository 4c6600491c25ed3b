"""The CUDA backend's service proof: `convserve serve` with CONVSERVE_BACKEND=cuda (float16) on the GPU answers decode
and encode requests over HTTP that match diffusers / transformers run by PyTorch in float32 on the
CPU (rel L2 < 1e-2), with every conv counted under backend="cuda" in /metrics.
The checks live in tests/service_parity.py, shared with the MLX test. Skipped without a CUDA GPU +
CuPy + cuDNN frontend (CI).

Device run 2026-11-23, H100 80GB HBM3 (driver 580.159.04), seed 1731925541: decode 2x4x9x13 rel L2
7.0e-4, VAE encode 2x3x37x53 1.8e-3, ConvNeXt embedding 1.6e-3, class probabilities 9.4e-4; all 121
convs on the `cudnn` path; 35.6 s in all, 31 s of it the server's start (imports, plan builds)."""
from __future__ import annotations

import os

import pytest

from gpu_support import cuda_or_skip

pytestmark = pytest.mark.gpu
TOL = 1e-2
DTYPE = "float16"


def report(lines: list[str]) -> None:
    """Errors of passing runs too: appended to $OUT/service_parity.txt when $OUT names an output folder."""
    print("\n".join(lines))
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        with open(os.path.join(out, "service_parity.txt"), "a") as f:
            f.write("\n".join(lines) + "\n")


@pytest.fixture(scope="module")
def cuda_server(tmp_path_factory):
    cuda_or_skip()
    for mod in ("torch", "diffusers", "transformers", "httpx"):
        pytest.importorskip(mod)
    import service_parity as parity
    from live_server import start_server

    saved = parity.save_models(tmp_path_factory.mktemp("service_cuda"))
    # first start builds a cuDNN plan per conv key during warm-up: allow for it
    server = start_server(tmp_path_factory.mktemp("servers"), ready_timeout=150, backend="cuda", dtype=DTYPE,
                          models=saved.models_setting())
    yield server, saved
    server.stop()
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        with open(os.path.join(out, "service_server.log"), "w") as f:
            f.write(server.log())


def test_service_on_cuda_matches_references(cuda_server):
    import service_parity as parity
    from live_server import scrape

    server, saved = cuda_server
    rep = parity.run_all(server.url, saved, backend="cuda", dtype=DTYPE, tol=TOL)
    snap = scrape(server.url)
    paths = sorted(f"{dict(lab)['op']}/{dict(lab)['path']}={int(v)}" for (n, lab), v in snap.items()
                   if n == "convkernels_conv_total" and v > 0)
    report([f"seed {saved.seed}", *rep.lines(), "conv paths: " + " ".join(paths)])
    graphs = {dict(lab).get("outcome", "replays"): int(v) for (n, lab), v in snap.items()
              if n in ("convkernels_cuda_graph_captures_total", "convkernels_cuda_graph_replays_total")}
    report([f"CUDA graphs (on by default): {graphs}"])
    assert graphs.get("failed", 0) == 0, f"a served forward could not be captured as a CUDA graph: {graphs}"


def test_warmup_sizes_capture_graphs_so_the_first_request_replays(tmp_path_factory):
    """With CONVSERVE_WARMUP_SIZES the warm-up calls each size twice on CUDA (the second call
    records the graph), so the first request of that size is already a replay."""
    cuda_or_skip()
    import httpx
    import numpy as np
    from live_server import metric, npy, scrape, start_server

    server = start_server(tmp_path_factory.mktemp("servers_warm"), ready_timeout=150, backend="cuda",
                          dtype=DTYPE, models="tiny-vae", warmup_sizes="72x88")
    try:
        s0 = scrape(server.url)
        assert metric(s0, "convkernels_cuda_graph_captures_total", backend="cuda", outcome="captured") >= 1
        replays0 = metric(s0, "convkernels_cuda_graph_replays_total", backend="cuda")
        lat = np.random.default_rng().standard_normal((1, 4, 9, 11)).astype(np.float32)
        r = httpx.post(f"{server.url}/v1/models/tiny-vae/decode", content=npy(lat),
                       headers={"content-type": "application/x-npy"}, params={"format": "npy"}, timeout=60)
        assert r.status_code == 200, r.text
        s1 = scrape(server.url)
        assert metric(s1, "convkernels_cuda_graph_replays_total", backend="cuda") - replays0 == 1
    finally:
        server.stop()
