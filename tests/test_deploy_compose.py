"""compose.yaml, the Prometheus config and the Grafana provisioning: compose against the
Compose Specification schema (vendored by check-jsonschema; no compose plugin here, so
`docker compose config` cannot run), then all of them checked against each other, the
Dockerfiles and the service settings."""
from __future__ import annotations

import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
SETTINGS_ENV = checks.settings_env_names()
COMPOSE = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
SERVERS = {"convserve-cpu": ("cpu", "cpu"), "convserve-gpu": ("gpu", "cuda")}


def _seconds(value: str) -> float:
    return sum(float(n) * {"ms": 1e-3, "s": 1, "m": 60, "h": 3600}[u]
               for n, u in re.findall(r"(\d+(?:\.\d+)?)(ms|s|m|h)", value))


def _default(value: str) -> str:
    """`${VAR:-default}` -> default, as compose interpolates with VAR unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", r"\1", str(value))


def _mounts(service: dict) -> dict[str, str]:
    """container path -> source (bind path or volume name)."""
    out = {}
    for v in service.get("volumes", []):
        parts = v.split(":") if isinstance(v, str) else [v["source"], v["target"]]
        out[parts[1]] = parts[0]
    return out


def test_compose_spec_schema():
    problems = checks.compose_schema_problems(COMPOSE)
    if problems is None:
        pytest.skip("check-jsonschema (vendors the compose-spec schema) not installed; it is in the test extra")
    assert problems == []
    bad = yaml.safe_load((DEPLOY / "compose.yaml").read_text())
    bad["services"]["prometheus"]["stop_grace_periods"] = "10s"
    bad["services"]["grafana"]["ports"] = "3000:3000"
    found = "\n".join(checks.compose_schema_problems(bad))
    assert "stop_grace_periods" in found and "services/grafana/ports" in found


def test_services_and_profiles():
    services = COMPOSE["services"]
    assert set(services) == {"convserve-cpu", "convserve-gpu", "prometheus", "grafana"}
    for name, (profile, _) in SERVERS.items():
        assert services[name]["profiles"] == [profile]
    # the monitoring stack starts with either profile
    assert "profiles" not in services["prometheus"] and "profiles" not in services["grafana"]
    for name, svc in services.items():
        image = svc["image"]
        assert ":" in image and not image.endswith(":latest"), f"{name}: unpinned image {image}"


@pytest.mark.parametrize("name", sorted(SERVERS))
def test_server_service(name):
    svc = COMPOSE["services"][name]
    _, flavour = SERVERS[name]
    dockerfile = checks.DOCKERFILES[flavour]
    build = svc["build"]
    assert (DEPLOY / build["context"]).resolve() == REPO
    assert (DEPLOY / build["context"] / build["dockerfile"]).resolve() == dockerfile

    argv, image_env = checks.container_command(dockerfile.read_text())
    env = {k: _default(v) for k, v in svc["environment"].items()}
    unknown = {k for k in set(env) - SETTINGS_ENV if not checks.HUB_ENV.match(k)}
    assert not unknown, f"not service settings: {unknown}"
    assert env["CONVSERVE_BACKEND"] == image_env["CONVSERVE_BACKEND"]

    published = [str(p) for p in svc["ports"]]
    assert any(_default(p).endswith(f":{image_env['CONVSERVE_PORT']}") for p in published), published

    mounts = _mounts(svc)
    plan_dir = env.get("CONVSERVE_PLAN_CACHE_DIR", image_env["CONVSERVE_PLAN_CACHE_DIR"])
    assert mounts.get(plan_dir) in COMPOSE["volumes"], "plan cache must live on a named volume"
    assert "/models" in mounts
    assert mounts.get(image_env["HF_HOME"]) in COMPOSE["volumes"], "Hub downloads must live on a named volume"

    hc = svc["healthcheck"]["test"]
    image_hc = [i.args for i in checks.parse_dockerfile(dockerfile.read_text())[1][-1].instructions
                if i.cmd == "HEALTHCHECK"][0]
    assert hc[0] == "CMD" and hc[1:] == checks.exec_form(image_hc[image_hc.index("CMD") + 3:].strip())

    grace = float(env.get("CONVSERVE_SHUTDOWN_GRACE_S", image_env["CONVSERVE_SHUTDOWN_GRACE_S"]))
    assert _seconds(svc["stop_grace_period"]) > grace, "docker stop would SIGKILL mid-drain"
    assert "convserve" in svc["networks"]["default"]["aliases"]


def test_gpu_reservation():
    devices = COMPOSE["services"]["convserve-gpu"]["deploy"]["resources"]["reservations"]["devices"]
    assert devices == [{"driver": "nvidia", "count": 1, "capabilities": ["gpu"]}]
    assert "deploy" not in COMPOSE["services"]["convserve-cpu"]
    # NCCL's shared memory for shard groups, once the service gets several GPUs
    assert COMPOSE["services"]["convserve-gpu"]["shm_size"] == "1gb"


def test_every_mount_exists_and_every_volume_is_declared():
    declared = set(COMPOSE["volumes"])
    used = set()
    for name, svc in COMPOSE["services"].items():
        assert "healthcheck" in svc, f"{name} has no healthcheck"
        for target, source in _mounts(svc).items():
            if source.startswith("."):
                # ./models is the operator's weights folder (docker creates it when absent)
                if target != "/models":
                    assert (DEPLOY / source).exists(), f"{name}: {source} does not exist"
            else:
                assert source in declared, f"{name}: volume {source} not declared"
                used.add(source)
    assert used == declared


def test_prometheus_scrapes_the_service():
    cfg = yaml.safe_load((DEPLOY / "prometheus" / "prometheus.yml").read_text())
    job = next(j for j in cfg["scrape_configs"] if j["job_name"] == "convserve")
    assert job.get("metrics_path", "/metrics") == "/metrics"
    targets = [t for sc in job["static_configs"] for t in sc["targets"]]
    _, image_env = checks.container_command(checks.DOCKERFILES["cpu"].read_text())
    assert targets == [f"convserve:{image_env['CONVSERVE_PORT']}"]
    prom = COMPOSE["services"]["prometheus"]
    assert _mounts(prom)["/etc/prometheus/prometheus.yml"] == "./prometheus/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prom["command"]


def test_promtool_accepts_the_prometheus_config():
    promtool = shutil.which("promtool")
    if promtool is None:
        pytest.skip("promtool not installed (Debian package prometheus)")
    proc = subprocess.run([promtool, "check", "config", str(DEPLOY / "prometheus" / "prometheus.yml")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_grafana_provisioning():
    graf = COMPOSE["services"]["grafana"]
    mounts = _mounts(graf)
    assert mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    ds = yaml.safe_load((DEPLOY / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"]
    assert len(ds) == 1 and ds[0]["type"] == "prometheus"
    host, port = re.match(r"http://([\w-]+):(\d+)$", ds[0]["url"]).groups()
    assert host in COMPOSE["services"] and any(str(p).endswith(f":{port}") for p in COMPOSE["services"][host]["ports"])
    providers = yaml.safe_load((DEPLOY / "grafana/provisioning/dashboards/convserve.yml").read_text())["providers"]
    path = providers[0]["options"]["path"]
    assert mounts[path] == "./grafana/dashboards"
    dashboard = json.loads((DEPLOY / "grafana/dashboards/convserve.json").read_text())
    ds_var = next(v for v in dashboard["templating"]["list"] if v["type"] == "datasource")
    assert ds_var["query"] == "prometheus" and ds_var["current"]["value"] == ds[0]["uid"]
    assert graf["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"] == f"{path}/convserve.json"


def test_secrets_have_no_default_and_grafana_requires_its_password():
    """No password, secret, token or key gets a non-empty default (CONVSERVE_API_KEY and HF_TOKEN
    default to empty: no auth, no token); Grafana's admin password has none at all: compose refuses
    to start without GRAFANA_ADMIN_PASSWORD (`${VAR:?message}`) rather than publish admin/admin."""
    text = (DEPLOY / "compose.yaml").read_text()
    defaults = re.findall(r"\$\{(\w*(?:PASSWORD|SECRET|TOKEN|KEY)\w*):?-([^}]*)\}", text)
    assert [(name, value) for name, value in defaults if value] == []
    password = COMPOSE["services"]["grafana"]["environment"]["GF_SECURITY_ADMIN_PASSWORD"]
    assert re.fullmatch(r"\$\{GRAFANA_ADMIN_PASSWORD:\?[^}]+\}", password), password
    assert "GRAFANA_ADMIN_PASSWORD" in (DEPLOY / "README.md").read_text()


def test_dashboard_layout_and_topics():
    dashboard = json.loads((DEPLOY / "grafana/dashboards/convserve.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for p in dashboard["panels"]:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
        for t in p.get("targets", []):
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
    exprs = " ".join(e for _, e in checks.dashboard_targets(dashboard))
    # what the dashboard must show: request rate, latency percentiles, queue depth and
    # wait, batch sizes, path mix per op, conv latency by path, plan-cache hit rate
    for needle in ("rate(convserve_requests_total", "histogram_quantile(0.99, sum by (le, model, endpoint) "
                   "(rate(convserve_request_seconds_bucket", "convserve_queue_depth", "convserve_queue_wait_seconds_bucket",
                   "convserve_batch_size_bucket", "sum by (op, path) (rate(convkernels_conv_total",
                   "sum by (le, backend, op, path) (rate(convkernels_conv_seconds_bucket",
                   'event="hit"'):
        assert needle in exprs, needle


def test_dashboard_names_against_the_registries():
    """Static form of the live check in test_deploy_live: names against the metric families the
    service and kernel registries declare in-process (labelled families without samples are
    declared all the same; their labels come from docs/interfaces.md)."""
    from service import metrics
    contract = checks.contract_labels((REPO / "docs" / "interfaces.md").read_text())
    exported = checks.exported_series(metrics.exposition().decode(), contract)
    dashboard = json.loads((DEPLOY / "grafana/dashboards/convserve.json").read_text())
    assert checks.dashboard_problems(dashboard, exported) == []


def test_dashboard_check_can_fail():
    from service import metrics
    exported = checks.exported_series(metrics.exposition().decode())
    bad = {"panels": [{"title": "typo", "targets": [
        {"expr": 'sum by (model) (rate(convserve_request_total{model=~"$model"}[$__rate_interval]))'},
        {"expr": "histogram_quantile(0.9, sum by (le, device) (rate(convserve_queue_wait_seconds_bucket[5m])))"},
        {"expr": "rat(convserve_queue_depth[5m])"}]}]}
    problems = "\n".join(checks.dashboard_problems(bad, {**exported, "convserve_queue_wait_seconds_bucket": {"model"}}))
    assert "convserve_request_total is not exported" in problems
    assert "label 'device'" in problems
    assert "unknown function 'rat'" in problems
