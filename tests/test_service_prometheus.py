"""A real Prometheus server scrapes a real convserve and answers PromQL over its HTTP API with
the kernel and service series."""
from __future__ import annotations

import shutil
import subprocess
import time

import httpx
import numpy as np
import pytest

from live_server import free_port, npy

PROMETHEUS = shutil.which("prometheus")


@pytest.mark.skipif(PROMETHEUS is None, reason="no prometheus binary (Debian package 'prometheus'; .ci/run installs it)")
def test_prometheus_scrapes_kernel_and_service_series(live_server, tmp_path):
    lat = np.random.default_rng().standard_normal((1, 4, 5, 6)).astype(np.float32)
    r = httpx.post(f"{live_server.url}/v1/models/tiny-vae/decode", content=npy(lat),
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200
    port = free_port()
    (tmp_path / "prometheus.yml").write_text(
        "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\n"
        "scrape_configs:\n  - job_name: convserve\n    metrics_path: /metrics\n"
        f"    static_configs:\n      - targets: ['127.0.0.1:{live_server.port}']\n")
    log = open(tmp_path / "prometheus.log", "wb")
    proc = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}"],
                            stdout=log, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1/query"

    def query(q: str) -> list:
        try:
            doc = httpx.get(api, params={"query": q}, timeout=5).json()
        except (httpx.TransportError, ValueError):
            return []
        assert doc.get("status") == "success", doc
        return doc["data"]["result"]

    try:
        deadline = time.monotonic() + 45
        conv = []
        while not conv:
            assert proc.poll() is None, (tmp_path / "prometheus.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "prometheus never returned convkernels_conv_total"
            time.sleep(0.5)
            conv = query('convkernels_conv_total{job="convserve",backend="numpy"}')
        assert all(float(s["value"][1]) > 0 for s in conv)
        assert {s["metric"]["op"] for s in conv} >= {"conv2d"}
        reqs = query('sum by (model) (convserve_requests_total{endpoint="decode",status="200"})')
        assert any(s["metric"]["model"] == "tiny-vae" and float(s["value"][1]) >= 1 for s in reqs)
        assert query('up{job="convserve"} == 1')
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()
