"""Kubernetes manifests: both overlays rendered with kustomize (kubectl's built-in one where no
kustomize binary exists; deploy/checks.py's Python subset where neither does, checked against
the real one here whenever it is installed), alone and with the optional ServiceMonitor component
(components/servicemonitor: the Prometheus Operator's CRD, which the overlays leave out so that a
cluster without the operator takes them), every built-in object validated against the Kubernetes
OpenAPI schemas of the oldest and newest supported versions (kubernetes-validate ships them;
strict, so unknown fields fail), the ServiceMonitor CRD structurally, and the cross-references no
schema sees (selectors, named ports, probe paths, drain vs grace period, settings)."""
from __future__ import annotations

import copy
import importlib.util
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def load_checks():
    if "deploy_checks" not in sys.modules:
        spec = importlib.util.spec_from_file_location("deploy_checks", REPO / "deploy" / "checks.py")
        mod = importlib.util.module_from_spec(spec)
        sys.modules["deploy_checks"] = mod
        spec.loader.exec_module(mod)
    return sys.modules["deploy_checks"]


checks = load_checks()
kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the test extra")
pytest.importorskip("yaml")

OVERLAYS = ("cpu", "gpu")
K8S = REPO / "deploy" / "k8s"
SERVICEMONITOR = K8S / "components" / "servicemonitor"
BUILT_IN = {"ConfigMap", "PersistentVolumeClaim", "Deployment", "Service", "HorizontalPodAutoscaler",
            "PodDisruptionBudget"}
#: oldest Kubernetes minor still in upstream support when written, and the newest schema shipped
K8S_VERSIONS = ("1.30", kv.latest_version())
SETTINGS_ENV = checks.settings_env_names()


@pytest.fixture(scope="module")
def rendered() -> dict[str, list[dict]]:
    return {ov: checks.render_kustomize(K8S / "overlays" / ov) for ov in OVERLAYS}


@pytest.fixture(scope="module")
def monitored() -> dict[str, list[dict]]:
    """Each overlay with the ServiceMonitor component, as an overlay that opts into it renders."""
    return {ov: checks.render_with_components(K8S / "overlays" / ov, [SERVICEMONITOR]) for ov in OVERLAYS}


def test_python_rendering_matches_kustomize():
    if checks.kustomize_command() is None:
        pytest.skip("no kustomize or kubectl: the Python rendering is the only one here")
    for overlay in OVERLAYS:
        path = K8S / "overlays" / overlay
        for what, real_docs, our_docs in (
                (overlay, checks.render_kustomize(path), checks.render_kustomize_py(path)),
                (f"{overlay}+servicemonitor", checks.render_with_components(path, [SERVICEMONITOR]),
                 checks.render_with_components(path, [SERVICEMONITOR], python=True))):
            real = {(d["kind"], d["metadata"]["name"]): d for d in real_docs}
            ours = {(d["kind"], d["metadata"]["name"]): d for d in our_docs}
            assert ours.keys() == real.keys(), what
            for key, doc in real.items():
                assert ours[key] == doc, (what, key)


def by_kind(docs: list[dict], kind: str) -> dict:
    found = [d for d in docs if d["kind"] == kind]
    assert len(found) == 1, f"{len(found)} {kind} objects"
    return found[0]


def container(docs: list[dict]) -> dict:
    return by_kind(docs, "Deployment")["spec"]["template"]["spec"]["containers"][0]


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_schemas(rendered, monitored, overlay, version):
    # the overlays hold built-in kinds only: a cluster without the Prometheus Operator takes them
    docs = rendered[overlay]
    assert {d["kind"] for d in docs} == BUILT_IN
    assert all(d["apiVersion"].split("/")[0] in ("v1", "apps", "autoscaling", "policy") for d in docs)
    assert checks.schema_problems(docs, version) == []
    # the component adds the ServiceMonitor, and only it
    with_sm = monitored[overlay]
    assert {d["kind"] for d in with_sm} == BUILT_IN | {"ServiceMonitor"} and len(with_sm) == len(docs) + 1
    sm = by_kind(with_sm, "ServiceMonitor")
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert sm["metadata"]["labels"]["app.kubernetes.io/name"] == "convserve"
    assert checks.schema_problems(with_sm, version) == []


def test_schema_check_can_fail(monitored):
    docs = copy.deepcopy(monitored["cpu"])
    dep = by_kind(docs, "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"httpGet": {"path": "/readyz"}}  # typo
    hpa = by_kind(docs, "HorizontalPodAutoscaler")
    hpa["spec"]["maxReplicas"] = "ten"
    sm = by_kind(docs, "ServiceMonitor")
    sm["spec"]["endpoints"][0]["interval"] = "5 seconds"
    problems = "\n".join(checks.schema_problems(docs, K8S_VERSIONS[0]))
    assert "readinesProbe" in problems
    assert "'ten'" in problems
    assert "not a Prometheus duration" in problems


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_cross_references(rendered, monitored, overlay):
    assert checks.manifest_problems(rendered[overlay], SETTINGS_ENV) == []
    assert checks.manifest_problems(monitored[overlay], SETTINGS_ENV) == []


def _mutate(docs, kind, fn):
    docs = copy.deepcopy(docs)
    fn(by_kind(docs, kind))
    return checks.manifest_problems(docs, SETTINGS_ENV)


def _pod(dep):
    return dep["spec"]["template"]["spec"]


CROSS_MUTATIONS = {
    "service selects nothing": ("Service", lambda s: s["spec"]["selector"].update(
        {"app.kubernetes.io/component": "worker"}), "Service selector"),
    "grace below drain": ("Deployment", lambda d: _pod(d).update(terminationGracePeriodSeconds=30),
                          "terminationGracePeriodSeconds"),
    "unknown setting": ("ConfigMap", lambda c: c["data"].update(CONVSERVE_MAX_BATCHES="8"), "CONVSERVE_MAX_BATCHES"),
    "readiness on healthz": ("Deployment", lambda d: _pod(d)["containers"][0]["readinessProbe"]["httpGet"].update(
        path="/healthz"), "readinessProbe"),
    "probe on unnamed port": ("Deployment", lambda d: _pod(d)["containers"][0]["livenessProbe"]["httpGet"].update(
        port="web"), "livenessProbe port"),
    "plan cache not persisted": ("Deployment", lambda d: _pod(d)["volumes"].__setitem__(
        1, {"name": "plan-cache", "emptyDir": {}}), "/var/cache/convserve/plans"),
    "hpa on a statefulset": ("HorizontalPodAutoscaler", lambda h: h["spec"]["scaleTargetRef"].update(
        kind="StatefulSet"), "HPA targets"),
    "hpa without cpu fallback": ("HorizontalPodAutoscaler", lambda h: h["spec"].update(
        metrics=[m for m in h["spec"]["metrics"] if m["type"] != "Resource"]), "CPU fallback"),
    "servicemonitor wrong port": ("ServiceMonitor", lambda s: s["spec"]["endpoints"][0].update(port="metrics"),
                                  "not a Service port name"),
    "root pod": ("Deployment", lambda d: _pod(d)["securityContext"].update(runAsNonRoot=False), "non-root"),
    "replicas pinned": ("Deployment", lambda d: d["spec"].update(replicas=3), "replicas"),
}


@pytest.mark.parametrize("mutation", sorted(CROSS_MUTATIONS))
def test_cross_reference_checks_catch(monitored, mutation):
    kind, fn, expect = CROSS_MUTATIONS[mutation]
    problems = _mutate(monitored["cpu"], kind, fn)
    assert any(expect in p for p in problems), (mutation, problems)


def test_gpu_overlay_requests_one_gpu_and_cuda(rendered):
    gpu, cpu = rendered["gpu"], rendered["cpu"]
    res = container(gpu)["resources"]
    assert res["limits"]["nvidia.com/gpu"] == 1 and res["requests"]["nvidia.com/gpu"] == 1
    tolerations = _pod(by_kind(gpu, "Deployment")).get("tolerations", [])
    assert any(t["key"] == "nvidia.com/gpu" for t in tolerations)
    assert by_kind(gpu, "ConfigMap")["data"]["CONVSERVE_BACKEND"] == "cuda"
    assert container(gpu)["image"].endswith(":cuda")
    # the overlay replaced, not appended to, the HPA's metric list
    assert len(by_kind(gpu, "HorizontalPodAutoscaler")["spec"]["metrics"]) == 3

    assert "nvidia.com/gpu" not in str(container(cpu)["resources"])
    assert by_kind(cpu, "ConfigMap")["data"]["CONVSERVE_BACKEND"] == "numpy"
    assert container(cpu)["image"].endswith(":cpu")
    # base settings survive the gpu overlay's ConfigMap patch
    assert by_kind(gpu, "ConfigMap")["data"]["CONVSERVE_HOST"] == "0.0.0.0"
    # NCCL's shared memory for shard groups: /dev/shm in memory, beside the base's mounts (merged)
    mounts = {m["mountPath"]: m["name"] for m in container(gpu)["volumeMounts"]}
    volumes = {v["name"]: v for v in _pod(by_kind(gpu, "Deployment"))["volumes"]}
    assert {"/models", "/var/cache/convserve/plans", "/tmp", "/dev/shm"} <= set(mounts), mounts
    assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"
    assert "/dev/shm" not in {m["mountPath"] for m in container(cpu)["volumeMounts"]}


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_pod_matches_the_image(rendered, overlay):
    """uid, port and volume paths agree with the Dockerfile the overlay's image is built from."""
    flavour = {"cpu": "cpu", "gpu": "cuda"}[overlay]
    text = checks.DOCKERFILES[flavour].read_text()
    _, stages = checks.parse_dockerfile(text)
    user = [i.args for i in stages[-1].instructions if i.cmd == "USER"][-1]
    pod = _pod(by_kind(rendered[overlay], "Deployment"))
    assert str(pod["securityContext"]["runAsUser"]) == user.split(":")[0]
    argv, env = checks.container_command(text)
    assert container(rendered[overlay]).get("args", argv[1:]) == argv[1:]
    settings = by_kind(rendered[overlay], "ConfigMap")["data"]
    assert settings["CONVSERVE_PORT"] == env["CONVSERVE_PORT"]
    assert settings["CONVSERVE_PLAN_CACHE_DIR"] == env["CONVSERVE_PLAN_CACHE_DIR"]
    assert settings["CONVSERVE_BACKEND"] == env["CONVSERVE_BACKEND"]
    mounts = {m["mountPath"] for m in container(rendered[overlay])["volumeMounts"]}
    volumes = set(re.findall(r'"(/[^"]+)"', [i.args for i in stages[-1].instructions if i.cmd == "VOLUME"][0]))
    assert volumes <= mounts


def test_autoscaling_metrics_are_served_by_the_adapter(rendered):
    """Every Pods metric of the HPA has a prometheus-adapter rule, computed from a gauge the
    service contract defines (the live scrape checks the export itself: test_deploy_live)."""
    rules = checks.adapter_rules()
    contract = (REPO / "docs" / "interfaces.md").read_text()
    for overlay in OVERLAYS:
        for name in checks.hpa_pod_metrics(rendered[overlay]):
            assert name in rules, f"no adapter rule serves {name}"
            assert re.search(rf"`{rules[name]}\{{model\}}` gauge", contract), rules[name]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_init_container_pulls_hub_weights_the_server_reads_offline(rendered, overlay):
    """`convserve pull` runs first, from the server's image and settings, with the Hub reachable and
    the models PVC writable; the server finds the same HF_HOME on that PVC, read-only, offline."""
    pod = _pod(by_kind(rendered[overlay], "Deployment"))
    server = container(rendered[overlay])
    (init,) = pod["initContainers"]
    assert init["image"] == server["image"] and init["args"] == ["pull"]
    assert init["envFrom"] == server["envFrom"]
    settings = by_kind(rendered[overlay], "ConfigMap")["data"]
    assert settings["HF_HUB_OFFLINE"] == "1"
    assert {e["name"]: e.get("value") for e in init["env"]}["HF_HUB_OFFLINE"] == "0"
    hf_home = settings["HF_HOME"]
    volumes = {v["name"]: v for v in pod["volumes"]}

    def mount_of(c):
        (m,) = [m for m in c["volumeMounts"] if hf_home.startswith(m["mountPath"].rstrip("/") + "/")]
        return m

    assert mount_of(init)["name"] == mount_of(server)["name"]
    assert "persistentVolumeClaim" in volumes[mount_of(init)["name"]]
    assert not mount_of(init).get("readOnly") and mount_of(server).get("readOnly") is True
    assert not volumes[mount_of(init)["name"]]["persistentVolumeClaim"].get("readOnly")
    assert init["securityContext"]["readOnlyRootFilesystem"] is True
