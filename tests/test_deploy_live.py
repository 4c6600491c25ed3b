"""The CPU image's entrypoint, run on this machine without Docker. The image's build stage is
replayed (build context as .dockerignore leaves it, `pip install .` into a venv standing in for
/opt/venv), then the ENV and ENTRYPOINT/CMD parsed out of deploy/docker/Dockerfile.cpu start a
real server (port moved to a free one, the volumes to temporary folders), which must become
ready, pass the image's HEALTHCHECK command and serve a decode and an encode. Its live /metrics
scrape then decides whether every PromQL expression of the Grafana dashboard and every
autoscaling metric names something the service really exports; where Prometheus is installed,
a real Prometheus scrapes the server and runs every dashboard query."""
from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from prometheus_client.parser import text_string_to_metric_families

from fresh_venv import make_venv, pip_install

httpx = pytest.importorskip("httpx")
yaml = pytest.importorskip("yaml")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"


def load_checks():
    if "deploy_checks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("deploy_checks", REPO / "deploy" / "checks.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["deploy_checks"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["deploy_checks"]


checks = load_checks()
DASHBOARD = json.loads((DEPLOY / "grafana" / "dashboards" / "convserve.json").read_text())
READY_TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(fn, timeout: float, what: str, proc: subprocess.Popen | None = None, log: Path | None = None):
    deadline = time.monotonic() + timeout
    last = None
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            pytest.fail(f"{what}: process exited {proc.returncode}\n{log.read_text()[-4000:] if log else ''}")
        try:
            last = fn()
            if last:
                return last
        except (httpx.HTTPError, OSError) as exc:
            last = exc
        time.sleep(0.2)
    pytest.fail(f"{what}: not within {timeout}s (last: {last})\n{log.read_text()[-4000:] if log else ''}")


class Server:
    def __init__(self, proc, url, env, log):
        self.proc, self.url, self.env, self.log = proc, url, env, log
        self.healthcheck: list[str] = []


def build_image_venv(root: Path) -> dict[str, Path]:
    """The Dockerfile's build stage without Docker: the build context as .dockerignore leaves
    it, then `pip install .` into a venv made from nothing (standing in for /opt/venv), so the
    server runs on the project's declared dependencies as pip resolves them, not on whatever
    this machine's Python holds; and the healthcheck COPY. Returns image path -> local path."""
    context = root / "context"
    patterns = checks.dockerignore_patterns()
    for src in REPO.rglob("*"):
        rel = src.relative_to(REPO).as_posix()
        if src.is_file() and ".git" not in src.parts and checks.in_build_context(rel, patterns):
            (context / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, context / rel)
    venv = root / "opt-venv"
    pip_install(make_venv(venv), str(context))
    return {"/opt/venv": venv, "/usr/local/bin/convserve-healthcheck": context / "deploy/docker/healthcheck.py"}


def remap(value: str, paths: dict[str, Path]) -> str:
    for image_path, local in sorted(paths.items(), key=lambda kv: -len(kv[0])):
        value = value.replace(image_path, str(local))
    return value


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    text = checks.DOCKERFILES["cpu"].read_text()
    # the base image's PATH is this machine's; the image puts its venv in front of it
    argv, image_env = checks.container_command(text, base_env={"PATH": os.environ["PATH"]})
    assert argv[:2] == ["convserve", "serve"]
    root = tmp_path_factory.mktemp("container")
    paths = build_image_venv(root)
    # What `docker run -v` would mount: the image's VOLUMEs, here temporary folders.
    for vol in ("/models", image_env["CONVSERVE_PLAN_CACHE_DIR"]):
        paths[vol] = root / vol.strip("/").replace("/", "-")
        paths[vol].mkdir()
    # The image's environment on top of the base image's (HOME, locale: this machine's).
    # (no PYTHONPATH: a container does not see this checkout)
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_") and k != "PYTHONPATH"}
    env.update({key: remap(value, paths) for key, value in image_env.items()})
    port = free_port()
    # The image binds 0.0.0.0 inside its own network namespace; on a shared machine, loopback.
    env.update(CONVSERVE_PORT=str(port), CONVSERVE_HOST="127.0.0.1")
    exe = shutil.which(argv[0], path=env["PATH"])
    assert exe == str(paths["/opt/venv"] / "bin" / argv[0]), f"ENTRYPOINT resolves to {exe}, not the image venv's"
    home = root / "home"  # the image's WORKDIR: nothing may depend on the repo checkout
    home.mkdir()
    log = root / "server.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([exe, *argv[1:]], cwd=home, env=env, stdout=out, stderr=subprocess.STDOUT)
    srv = Server(proc, f"http://127.0.0.1:{port}", env, log)
    srv.healthcheck = healthcheck_argv(text, paths)
    try:
        wait_for(lambda: httpx.get(f"{srv.url}/readyz", timeout=2).status_code == 200, READY_TIMEOUT_S,
                 "server ready", proc, log)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def healthcheck_argv(dockerfile_text: str, paths: dict[str, Path]) -> list[str]:
    _, stages = checks.parse_dockerfile(dockerfile_text)
    hc = [i.args for i in stages[-1].instructions if i.cmd == "HEALTHCHECK"][-1]
    argv = checks.exec_form(hc[hc.index("CMD") + 3:].strip())
    return [remap(a, paths) for a in argv]


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def png(arr: np.ndarray) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def send_traffic(url: str, rng: np.random.Generator) -> None:
    """One decode and one encode, odd sizes, fresh random inputs."""
    h, w = int(rng.integers(3, 8)), int(rng.integers(3, 8))
    r = httpx.post(f"{url}/v1/models/tiny-vae/decode", content=npy(rng.standard_normal((1, 4, h, w), np.float32)),
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "image/png" and r.content[:8] == b"\x89PNG\r\n\x1a\n"
    assert r.headers["x-output-shape"] == f"1,{8 * h},{8 * w},3"
    image = rng.integers(0, 256, (int(rng.integers(20, 50)), int(rng.integers(20, 50)), 3), dtype=np.uint8)
    r = httpx.post(f"{url}/v1/models/tiny-convnext/encode", content=png(image),
                   headers={"content-type": "image/png"}, timeout=60)
    assert r.status_code == 200, r.text
    doc = r.json()
    assert len(doc["embeddings"]) == 1 and len(doc["embeddings"][0]) == doc["embedding_dim"]
    assert np.isfinite(doc["embeddings"]).all()


@pytest.fixture(scope="module")
def scrape(server) -> str:
    send_traffic(server.url, np.random.default_rng())
    r = httpx.get(f"{server.url}/metrics", timeout=10)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    return r.text


def test_container_entrypoint_serves(server):
    cards = httpx.get(f"{server.url}/v1/models", timeout=10)
    assert cards.status_code == 200
    # the image's HEALTHCHECK command ("python" from the image's PATH), with the image's environment
    argv = [shutil.which(server.healthcheck[0], path=server.env["PATH"]), *server.healthcheck[1:]]
    assert argv[0].startswith(server.env["PATH"].split(os.pathsep)[0])
    hc = subprocess.run(argv, env=server.env, capture_output=True, text=True, timeout=30)
    assert hc.returncode == 0, hc.stderr
    # the server ran the package installed from the build context, not this checkout
    where = subprocess.run([argv[0], "-c", "import convkernels, models, service; "
                            "print(convkernels.__file__, models.__file__, service.__file__)"],
                           env=server.env, cwd=server.log.parent / "home",
                           capture_output=True, text=True, timeout=60)
    files = where.stdout.split()
    assert len(files) == 3 and all(f.startswith(server.env["PATH"].split(os.pathsep)[0].removesuffix("/bin"))
                                   for f in files), where.stdout + where.stderr
    send_traffic(server.url, np.random.default_rng())


def test_request_series_exist_after_traffic(scrape):
    sampled = checks.sampled_series(scrape)
    for name in ("convserve_requests_total", "convserve_request_seconds_bucket", "convserve_queue_wait_seconds_bucket",
                 "convserve_batch_size_bucket", "convserve_queue_depth", "convserve_inflight_requests",
                 "convkernels_conv_total", "convkernels_conv_seconds_bucket", "convkernels_plan_cache_events_total"):
        assert name in sampled, name
    assert 'endpoint="decode"' in scrape and 'endpoint="encode"' in scrape


def test_dashboard_refers_only_to_exported_metrics(scrape):
    contract = checks.contract_labels((REPO / "docs" / "interfaces.md").read_text())
    exported = checks.exported_series(scrape, contract)
    assert checks.dashboard_problems(DASHBOARD, exported) == []


def test_autoscaling_metrics_are_exported_gauges(scrape):
    types = {f.name: f.type for f in text_string_to_metric_families(scrape)}
    sampled = checks.sampled_series(scrape)
    for metric, series in checks.adapter_rules().items():
        assert types.get(series) == "gauge", (metric, series, types.get(series))
        assert series in sampled
    hpa = yaml.safe_load((DEPLOY / "k8s" / "base" / "hpa.yaml").read_text())
    for m in hpa["spec"]["metrics"]:
        if m["type"] == "Pods":
            assert m["pods"]["metric"]["name"] in checks.adapter_rules()


#: panels that must show data once a decode and an encode have run (streaming, rejections, errors
#: and plan building need traffic of their own)
EXPECT_DATA = {
    "Request rate by model, endpoint, status", "Request latency p50 / p95 / p99", "Queue depth and in-flight requests",
    "Queue wait p50 / p95 / p99", "Batch size (mean, p50, p95)", "Model calls per second",
    "Kernel path mix per op (share of conv calls)", "Conv calls per second by backend, op, path",
    "Conv latency by path p50 / p95", "Mean conv time by path", "Plan-cache hit rate", "Plan-cache events",
    "Plan build time p50 / p95", "Model load and warm-up seconds", "variable model", "variable backend",
}


def test_dashboard_queries_run_in_prometheus(server, scrape, tmp_path):
    exe = shutil.which("prometheus")
    if exe is None:
        pytest.skip("prometheus not installed (Debian package prometheus; .ci/run installs it)")
    port = free_port()
    host = server.url.removeprefix("http://")
    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(yaml.safe_dump({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "convserve", "metrics_path": "/metrics",
                            "static_configs": [{"targets": [host]}]}]}))
    log = tmp_path / "prometheus.log"
    with open(log, "wb") as out:
        prom = subprocess.Popen([exe, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'data'}",
                                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                                cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT)
    api = f"http://127.0.0.1:{port}/api/v1"

    def query(expr: str) -> list:
        r = httpx.get(f"{api}/query", params={"query": expr}, timeout=10)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        return body["data"]["result"]

    try:
        wait_for(lambda: httpx.get(f"http://127.0.0.1:{port}/-/ready", timeout=2).status_code == 200, 30,
                 "prometheus ready", prom, log)
        wait_for(lambda: query('count_over_time(up{job="convserve"}[1m]) >= 2'), 30, "two scrapes", prom, log)
        send_traffic(server.url, np.random.default_rng())  # so rates between scrapes are > 0
        served = sum(s.value for f in text_string_to_metric_families(httpx.get(f"{server.url}/metrics").text)
                     if f.name == "convserve_requests" for s in f.samples if s.name.endswith("_total"))
        wait_for(lambda: query(f"sum(convserve_requests_total) >= {served}"), 30, "a scrape after the traffic",
                 prom, log)
        assert query('up{job="convserve"}')[0]["value"][1] == "1"

        has_data: dict[str, bool] = {}
        for title, expr in checks.dashboard_targets(DASHBOARD):
            # a syntax error or an unknown function fails inside query(); a wrong name gives no data
            has_data[title] = bool(query(checks.substitute_grafana(expr))) or has_data.get(title, False)
        assert EXPECT_DATA <= set(has_data), sorted(EXPECT_DATA - set(has_data))
        print("panels without data:", sorted(t for t, ok in has_data.items() if not ok))
        missing = sorted(t for t in EXPECT_DATA if not has_data[t])
        assert not missing, f"no data in: {missing}"
        rate = query('sum by (endpoint) (rate(convserve_requests_total{status="200"}[1m]))')
        assert {r["metric"]["endpoint"] for r in rate if float(r["value"][1]) > 0} >= {"decode", "encode"}
    finally:
        prom.send_signal(signal.SIGTERM)
        try:
            prom.wait(timeout=20)
        except subprocess.TimeoutExpired:
            prom.kill()
            prom.wait()


def test_sigterm_drains_and_exits_0_within_the_pod_grace(server):
    """Last in this module: it stops the server. The k8s pod gives it terminationGracePeriodSeconds
    minus the preStop sleep; with nothing in flight it must be done well inside that."""
    dep = yaml.safe_load((DEPLOY / "k8s" / "base" / "deployment.yaml").read_text())
    pod = dep["spec"]["template"]["spec"]
    budget = pod["terminationGracePeriodSeconds"] - float(pod["containers"][0]["lifecycle"]["preStop"]["exec"]["command"][1])
    t0 = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)
    try:
        code = server.proc.wait(timeout=budget)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running {budget}s after SIGTERM\n{server.log.read_text()[-3000:]}")
    assert code == 0, server.log.read_text()[-3000:]
    assert time.monotonic() - t0 < budget
