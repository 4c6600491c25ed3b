"""`convserve decode | encode | bench` (local, tiny presets) and the console script."""
from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
from typer.testing import CliRunner

from service.cli import app

runner = CliRunner()


def invoke(*args):
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code == 0, (r.output, r.exception)
    return r.stdout


def test_console_script_help():
    exe = shutil.which("convserve")
    if exe is None:
        pytest.skip("console script not installed (pip install -e .)")
    out = subprocess.run([exe, "--help"], capture_output=True, text=True, timeout=60).stdout
    for cmd in ("serve", "decode", "encode", "bench"):
        assert cmd in out


def test_decode_image_outputs(tmp_path):
    lat = np.random.default_rng().standard_normal((2, 4, 5, 3)).astype(np.float32)
    np.save(tmp_path / "lat.npy", lat)
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "out.npy", "--backend", "numpy")
    ref = np.load(tmp_path / "out.npy")
    assert ref.shape == (2, 40, 24, 3)
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "out.png", "--backend", "numpy")
    for i in range(2):  # several latents -> out_000.png, out_001.png
        got = np.asarray(Image.open(tmp_path / f"out_{i:03d}.png")).astype(int)
        assert np.abs(got - np.clip(ref[i] * 255 + 0.5, 0, 255).astype(int)).max() <= 1
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "frames", "--backend", "numpy")
    assert sorted(p.name for p in (tmp_path / "frames").iterdir()) == ["000_frame_0000.png", "001_frame_0000.png"]
    r = runner.invoke(app, ["decode", str(tmp_path / "lat.npy"), "-o", str(tmp_path / "x.mp4"), "--backend", "numpy"])
    assert r.exit_code != 0  # an image decoder gives no video


def test_decode_video_to_mp4_and_frames(tmp_path):
    av = pytest.importorskip("av")
    lat = np.random.default_rng().standard_normal((1, 4, 2, 4, 5)).astype(np.float32)
    np.save(tmp_path / "v.npy", lat)
    out = invoke("decode", tmp_path / "v.npy", "-o", tmp_path / "v.mp4", "--backend", "numpy")
    assert "[1, 5, 32, 40, 3]" in out
    with av.open(str(tmp_path / "v.mp4")) as c:
        assert sum(1 for _ in c.decode(video=0)) == 5
    invoke("decode", tmp_path / "v.npy", "-o", tmp_path / "frames", "--backend", "numpy")
    assert len(list((tmp_path / "frames").glob("frame_*.png"))) == 5


def test_encode_and_top_k(tmp_path):
    paths = []
    for i in range(2):
        p = tmp_path / f"im{i}.png"
        Image.fromarray(np.random.default_rng().integers(0, 256, (50 + i, 70, 3), dtype=np.uint8)).save(p)
        paths.append(p)
    out = invoke("encode", *paths, "--top-k", 3, "--backend", "numpy", "-o", tmp_path / "emb.npy")
    lines = [json.loads(line) for line in out.strip().splitlines()]
    assert len(lines) == 2 and all(len(line["top_k"]) == 3 for line in lines)
    scores = [t["score"] for t in lines[0]["top_k"]]
    assert scores == sorted(scores, reverse=True) and 0 < sum(scores) <= 1 + 1e-6
    emb = np.load(tmp_path / "emb.npy")
    assert emb.shape[0] == 2 and np.isclose(np.linalg.norm(emb[1]), lines[1]["norm"], rtol=1e-4)


def test_bench_prints_throughput():
    out = invoke("bench", "--preset", "tiny-convnext", "--batch", "1,2", "--seconds", "0.2", "--backend", "numpy")
    assert "items/s" in out and "batch   2" in out and "machine" in out


def test_decode_and_encode_against_a_server(live_server, tmp_path):
    lat = np.random.default_rng().standard_normal((2, 4, 5, 3)).astype(np.float32)
    np.save(tmp_path / "lat.npy", lat)
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "local.npy", "--backend", "numpy")
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "remote.npy", "--url", live_server.url)
    np.testing.assert_allclose(np.load(tmp_path / "remote.npy"), np.load(tmp_path / "local.npy"), atol=2e-5)
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "r.png", "--url", live_server.url)
    assert Image.open(tmp_path / "r_001.png").size == (24, 40)
    p = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng().integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(p)
    remote = json.loads(invoke("encode", p, "--url", live_server.url, "--model", "tiny-convnext", "--top-k", 2))
    local = json.loads(invoke("encode", p, "--backend", "numpy", "--top-k", 2))
    assert np.isclose(remote["norm"], local["norm"], rtol=1e-5)
    assert [t["index"] for t in remote["top_k"]] == [t["index"] for t in local["top_k"]]
