"""The README's run command, literally, on a fresh machine: a copy of the checkout, a venv made
from nothing, then the Quick start's `pip install -e . && convserve serve` in a shell that
activated it. The server must become ready on its CPU defaults and serve one decode and one
encode. (The test command beside it is what `.ci/run` runs, in a fresh venv of its own.)"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from fresh_venv import INSTALL_TIMEOUT_S, make_venv, venv_env

REPO = Path(__file__).resolve().parents[1]
COPY_IGNORED = shutil.ignore_patterns(".git", "__pycache__", "*.so", "build", "*.egg-info", ".pytest_cache",
                                      ".venv", ".whl", ".gl", ".gpuextra", "out")


def readme_run_command() -> str:
    """The first shell block of the Quick start: the one that installs and runs the service."""
    text = (REPO / "README.md").read_text()
    quick = text[text.index("## Quick start"):]
    return re.search(r"```bash\n(.+?)\n```", quick, re.S).group(1).strip()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr)
    return buf.getvalue()


def cli_against_the_server(bin_dir: Path, env: dict, url: str, work: Path, rng) -> None:
    """The fresh venv's own `convserve` (never this environment's) against the server that venv
    runs: decode --url to PNG and to the video default MP4, encode --url, and a server's 4xx as
    one line. Each would fail on a dependency the install left out (httpx, PyAV)."""
    from PIL import Image

    work.mkdir()
    exe = str(bin_dir / "convserve")

    def cli(*args, ok: bool = True) -> subprocess.CompletedProcess:
        run = subprocess.run([exe, *map(str, args)], cwd=work, env=env, capture_output=True, text=True, timeout=300)
        if ok:
            assert run.returncode == 0, f"convserve {' '.join(map(str, args))}:\n{run.stdout}{run.stderr}"
        return run

    np.save(work / "lat.npy", rng.standard_normal((1, 4, 4, 5), np.float32))
    cli("decode", "lat.npy", "-o", "out.png", "--url", url)
    assert (work / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert Image.open(work / "out.png").size == (40, 32)
    np.save(work / "video.npy", rng.standard_normal((1, 4, 2, 4, 5), np.float32))
    cli("decode", "video.npy", "-o", "out.mp4", "--url", url, "--model", "tiny-wan-vae")
    assert (work / "out.mp4").read_bytes()[4:8] == b"ftyp"
    Image.fromarray(rng.integers(0, 256, (48, 64, 3), dtype=np.uint8)).save(work / "a.png")
    line = json.loads(cli("encode", "a.png", "--url", url, "--model", "tiny-convnext").stdout)
    assert line["image"] == "a.png" and line["embedding_dim"] > 0 and np.isfinite(line["norm"])
    bad = cli("decode", "lat.npy", "-o", "x.png", "--url", url, "--model", "tiny-convnext", ok=False)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr, bad.stderr
    assert bad.stderr.strip().splitlines() == [bad.stderr.strip()] and "server answered 409" in bad.stderr


def test_readme_names_the_install_and_serve_command():
    assert readme_run_command() == "pip install -e . && convserve serve"


def test_readme_run_command_serves_on_a_fresh_venv(tmp_path):
    checkout = tmp_path / "convserve"
    shutil.copytree(REPO, checkout, ignore=COPY_IGNORED)
    bin_dir = make_venv(tmp_path / "venv")
    port = free_port()
    env = venv_env(bin_dir)
    env.update(CONVSERVE_PORT=str(port), CONVSERVE_LOG_LEVEL="warning")
    log = tmp_path / "run.log"
    t0 = time.monotonic()
    with open(log, "wb") as out:
        proc = subprocess.Popen(["bash", "-c", readme_run_command()], cwd=checkout, env=env, stdout=out,
                                stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + INSTALL_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"the run command exited {proc.returncode}:\n{log.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, f"not ready within {INSTALL_TIMEOUT_S}s:\n{log.read_text()[-4000:]}"
            time.sleep(0.25)
        print(f"install + start + warm-up: {time.monotonic() - t0:.1f}s")
        rng = np.random.default_rng()
        h, w = int(rng.integers(3, 9)), int(rng.integers(3, 9))
        r = httpx.post(f"{url}/v1/models/tiny-vae/decode", content=npy(rng.standard_normal((1, 4, h, w), np.float32)),
                       headers={"content-type": "application/x-npy"}, timeout=120)
        assert r.status_code == 200, r.text
        assert r.content[:8] == b"\x89PNG\r\n\x1a\n" and r.headers["x-output-shape"] == f"1,{8 * h},{8 * w},3"
        pixels = rng.integers(0, 256, (1, int(rng.integers(20, 60)), int(rng.integers(20, 60)), 3), dtype=np.uint8)
        r = httpx.post(f"{url}/v1/models/tiny-convnext/encode", content=npy(pixels),
                       headers={"content-type": "application/x-npy"}, timeout=120)
        assert r.status_code == 200, r.text
        doc = r.json()
        assert len(doc["embeddings"]) == 1 and len(doc["embeddings"][0]) == doc["embedding_dim"]
        assert np.isfinite(doc["embeddings"]).all()
        cli_against_the_server(bin_dir, env, url, tmp_path / "cli", rng)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
