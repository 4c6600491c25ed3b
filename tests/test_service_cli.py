"""`convserve decode | encode | bench` (local, tiny presets) and the console script."""
from __future__ import annotations

import json
import shutil
import subprocess

import numpy as np
import pytest
from PIL import Image
import typer
from typer.testing import CliRunner

from reference_checks import cross_process_atol
from service.cli.main import app

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


def test_local_decode_takes_the_servers_tiles_and_oom_recovery(tmp_path, monkeypatch):
    """A local decode runs as a model worker's does (service/worker/oom_recovery.py): the tile size is the
    server's setting (--tile-size or CONVSERVE_TILE_SIZE), and a decode that runs out of memory is
    retried in those tiles; the result is the model's own tiled decode."""
    from convkernels import get_backend
    from models import ModelOptions, load_model
    from models.autoencoder_kl import AutoencoderKLModel

    lat = np.random.default_rng().standard_normal((1, 4, 20, 12)).astype(np.float32)
    np.save(tmp_path / "lat.npy", lat)
    real, calls = AutoencoderKLModel.decode, []

    def decode(self, latents, tiled=None, clamp=True, *, uint8=False):
        calls.append((tiled, self.tiling.tile_px))
        if tiled is not True:
            raise MemoryError("injected: only tiles fit")
        return real(self, latents, tiled, clamp, uint8=uint8)

    monkeypatch.setattr(AutoencoderKLModel, "decode", decode)
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "flag.npy", "--backend", "numpy", "--tile-size", 64)
    assert calls == [(None, 64), (True, 64)]
    monkeypatch.setenv("CONVSERVE_TILE_SIZE", "64")
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "env.npy", "--backend", "numpy")
    assert calls[2:] == [(None, 64), (True, 64)]
    monkeypatch.undo()
    ref = load_model("ref", "tiny-vae", get_backend("numpy"), options=ModelOptions(tile_size=64)).decode(lat, tiled=True)
    np.testing.assert_array_equal(np.load(tmp_path / "flag.npy"), ref)
    np.testing.assert_array_equal(np.load(tmp_path / "env.npy"), ref)


def test_flags_build_the_settings_over_the_environment_without_writing_it(monkeypatch):
    import os

    from service.cli.main import settings_from_flags

    monkeypatch.setenv("CONVSERVE_MAX_BATCH", "3")
    monkeypatch.setenv("CONVSERVE_PORT", "9000")
    monkeypatch.delenv("CONVSERVE_MAX_QUEUE", raising=False)
    s = settings_from_flags(max_batch=5, port=None, max_queue=7)
    assert (s.max_batch, s.port, s.max_queue) == (5, 9000, 7)  # a flag wins, an absent one leaves the variable
    assert os.environ["CONVSERVE_MAX_BATCH"] == "3" and "CONVSERVE_MAX_QUEUE" not in os.environ
    with pytest.raises(typer.Exit):  # an invalid value is one line, not a traceback
        settings_from_flags(max_batch=0)


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
    local = np.load(tmp_path / "local.npy")  # this process's decode; the server's worker is another process
    np.testing.assert_allclose(np.load(tmp_path / "remote.npy"), local, rtol=0, atol=cross_process_atol(local))
    invoke("decode", tmp_path / "lat.npy", "-o", tmp_path / "r.png", "--url", live_server.url)
    assert Image.open(tmp_path / "r_001.png").size == (24, 40)
    p = tmp_path / "a.png"
    Image.fromarray(np.random.default_rng().integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(p)
    remote = json.loads(invoke("encode", p, "--url", live_server.url, "--model", "tiny-convnext", "--top-k", 2))
    local = json.loads(invoke("encode", p, "--backend", "numpy", "--top-k", 2))
    assert np.isclose(remote["norm"], local["norm"], rtol=1e-5)
    assert [t["index"] for t in remote["top_k"]] == [t["index"] for t in local["top_k"]]


# ---- first-run errors: one line on stderr, never a traceback ------------------------------------------
def fails_in_one_line(*args, code: int | None = None) -> str:
    r = runner.invoke(app, [str(a) for a in args])
    assert r.exit_code != 0, r.output
    if code is not None:
        assert r.exit_code == code, (r.exit_code, r.output)
    assert isinstance(r.exception, SystemExit), repr(r.exception)  # typer.Exit, not an error escaping
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convserve: error: "), r.stderr
    assert "Traceback" not in r.output
    return lines[0]


def test_check_model_entries():
    from service.cli.main import check_model_entries
    from service.settings import ModelEntry, parse_models

    check_model_entries(parse_models("tiny-vae,enc=tiny-convnext,hub=sd-vae:org/name/vae@main"))
    check_model_entries([ModelEntry("org/name", "", "org/name")])  # a bare reference for `pull`
    with pytest.raises(typer.Exit):
        check_model_entries(parse_models("sd=sd-vea:foo/bar"))


@pytest.mark.parametrize("spec,wants", [
    ("sd=sd-vea:foo/bar", ["unknown preset 'sd-vea'", "did you mean sd-vae", "known presets:", "tiny-convnext"]),
    ("x=tiny-convnxt", ["did you mean tiny-convnext"]),
    ("x=zzz", ["unknown preset 'zzz'", "known presets: ", "sd-vae"]),
    ("sd=sd-vae:./x", ["weights './x': no such file or folder"]),
    ("sd=sd-vae:/x", ["weights '/x': no such file or folder"]),
    ("sd=sd-vae:missing.safetensors", ["weights 'missing.safetensors': no such file or folder"]),
    ("a=zzz,b=tiny-vae:./nope", ["unknown preset 'zzz'", "weights './nope'"]),
])
def test_check_model_entries_names_the_problem_in_one_line(spec, wants, capsys):
    from service.cli.main import check_model_entries
    from service.settings import parse_models

    with pytest.raises(typer.Exit) as info:
        check_model_entries(parse_models(spec))
    assert info.value.exit_code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("convserve: error: "), err
    for want in wants:
        assert want in err, err
    assert "Hub" not in err  # a typo or a missing path, not a failed download


def test_pull_reports_a_preset_typo_before_the_hub(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path))
    line = fails_in_one_line("pull", "sd=sd-vea:foo/bar", code=2)
    assert "did you mean sd-vae" in line and "foo/bar" not in line
    line = fails_in_one_line("pull", "sd=sd-vae:./x", code=2)
    assert "'./x': no such file or folder" in line


def test_local_errors_are_one_line(tmp_path, monkeypatch):
    lat = tmp_path / "lat.npy"
    np.save(lat, np.zeros((1, 4, 3, 3), np.float32))
    assert "no such file" in fails_in_one_line("decode", tmp_path / "nope.npy", "-o", tmp_path / "o.png")
    assert "no such file" in fails_in_one_line("encode", tmp_path / "nope.png")
    assert "did you mean tiny-vae" in fails_in_one_line("decode", lat, "-o", tmp_path / "o.png", "--preset", "tiny-vea")
    assert "unknown backend" in fails_in_one_line("decode", lat, "-o", tmp_path / "o.png", "--backend", "nope")
    assert "cannot write .gif" in fails_in_one_line("decode", lat, "-o", tmp_path / "o.gif", "--backend", "numpy")
    assert "image decoder" in fails_in_one_line("decode", lat, "-o", tmp_path / "o.mp4", "--backend", "numpy")
    assert "does not exist" in fails_in_one_line("decode", lat, "-o", tmp_path / "no" / "o.png")
    (tmp_path / "bad.npy").write_bytes(b"\x93NUMPY garbage")
    assert "npy" in fails_in_one_line("decode", tmp_path / "bad.npy", "-o", tmp_path / "o.png")
    (tmp_path / "text.png").write_text("not an image")
    assert "text.png" in fails_in_one_line("encode", tmp_path / "text.png", "--backend", "numpy")
    assert "weights './x'" in fails_in_one_line("encode", tmp_path / "text.png", "--weights", "./x")
    # MP4 without PyAV: the fix, before any decoding
    vid = tmp_path / "v.npy"
    np.save(vid, np.zeros((1, 4, 2, 4, 5), np.float32))
    monkeypatch.setitem(__import__("sys").modules, "av", None)
    assert "PyAV" in fails_in_one_line("decode", vid, "-o", tmp_path / "v.mp4", "--backend", "numpy")


def test_sharded_decode_refusals_are_one_line_and_come_first(tmp_path, live_server):
    """--shards N: what cannot run sharded is refused before any model loads (the GPU run itself:
    tests/gpu/test_sharded_decode_gpus.py); with --url, the server's refusal is the line."""
    lat = tmp_path / "lat.npy"
    np.save(lat, np.zeros((1, 4, 6, 6), np.float32))
    out = tmp_path / "o.png"
    assert "cuda backend" in fails_in_one_line("decode", lat, "-o", out, "--shards", "2", "--backend", "numpy")
    assert "has no sharded decode" in fails_in_one_line("decode", lat, "-o", out, "--shards", "2", "--preset",
                                                        "tiny-convnext")
    assert "whole number of GPUs" in fails_in_one_line("decode", lat, "-o", out, "--shards", "auto")
    line = fails_in_one_line("decode", lat, "-o", out, "--shards", "2", "--url", live_server.url, code=1)
    assert "422" in line and "runs 1 device" in line, line
    vid = tmp_path / "v.npy"
    np.save(vid, np.zeros((1, 4, 2, 4, 5), np.float32))
    assert "decodes image latents" in fails_in_one_line("decode", vid, "-o", tmp_path / "v.npy", "--shards", "2",
                                                        "--preset", "tiny-vae")


def test_server_errors_are_one_line(live_server, tmp_path):
    lat = tmp_path / "lat.npy"
    np.save(lat, np.zeros((1, 4, 3, 3), np.float32))
    line = fails_in_one_line("decode", lat, "-o", tmp_path / "o.png", "--url", live_server.url, "--model", "tiny-convnext",
                             code=1)
    assert line.startswith("convserve: error: server answered 409") and "tiny-convnext" in line
    line = fails_in_one_line("decode", lat, "-o", tmp_path / "o.png", "--url", live_server.url, "--model", "nope", code=1)
    assert "server answered 404" in line
    line = fails_in_one_line("encode", lat, "--url", live_server.url, "--model", "tiny-convnext", code=1)
    assert "server answered 4" in line
    from live_server import free_port
    line = fails_in_one_line("decode", lat, "-o", tmp_path / "o.png", "--url", f"http://127.0.0.1:{free_port()}", code=1)
    assert "no answer from" in line


def test_server_without_pyav_answers_mp4_requests_in_one_line(server_factory, tmp_path, monkeypatch):
    """A server whose environment lacks PyAV (sys.modules['av'] = None at start-up) answers 501
    with the fix; the CLI prints it as one line."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['av'] = None\n")
    import os
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), *filter(None, [os.environ.get("PYTHONPATH")])]))
    srv = server_factory(models="tiny-wan-vae")
    vid = tmp_path / "v.npy"
    np.save(vid, np.zeros((1, 4, 2, 4, 5), np.float32))
    line = fails_in_one_line("decode", vid, "-o", tmp_path / "v.mp4", "--url", srv.url, code=1)
    assert "server answered 501" in line and "PyAV" in line
    invoke("decode", vid, "-o", tmp_path / "v.npy.npy", "--url", srv.url)  # npy frames need no PyAV
    assert np.load(tmp_path / "v.npy.npy").shape == (1, 5, 32, 40, 3)


# ---- start-up: a server that cannot serve exits 2 with one line, never serves on half-started -------
def serve_fails(tmp_path, *args, env: dict | None = None, timeout: float = 120) -> str:
    """`convserve serve ARGS` in a process of its own (as an orchestrator starts it), which must
    exit 2 with exactly one line on stderr and no traceback; returns that line."""
    import os
    import sys

    from live_server import REPO, free_port

    run_env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    run_env.update({"CONVSERVE_BACKEND": "numpy", "CONVSERVE_PORT": str(free_port()), **(env or {})})
    r = subprocess.run([sys.executable, "-m", "service.cli", "serve", *map(str, args)], cwd=REPO, env=run_env,
                       capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 2, (r.returncode, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("convserve: error: "), r.stderr[-3000:]
    return lines[0]


def test_serve_start_up_problems_are_one_line_and_exit_2(tmp_path):
    from convkernels.registry import cuda_status

    if not cuda_status()[0]:  # no CuPy (or no GPU): --backend cuda cannot run here
        line = serve_fails(tmp_path, "--backend", "cuda")
        assert "backend 'cuda'" in line and "--backend auto or numpy" in line, line
    line = serve_fails(tmp_path, "--dtype", "float99")
    assert "--dtype 'float99'" in line and "'bfloat16', 'float32' or 'float64'" in line, line
    line = serve_fails(tmp_path, "--backend", "gpu")  # any bad value: the setting and its choices
    assert "--backend 'gpu'" in line and "'auto', 'numpy', 'mlx' or 'cuda'" in line, line
    line = serve_fails(tmp_path, env={"CONVSERVE_MAX_BATCH": "0"})  # from the environment: its variable
    assert "CONVSERVE_MAX_BATCH='0'" in line and "greater than or equal to 1" in line, line
    import socket
    with socket.socket() as taken:  # a port in use: named, with the flag that changes it
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = serve_fails(tmp_path, "--port", port)
    assert f"port {port} on 127.0.0.1 is in use" in line and "--port" in line and "Errno" not in line, line


def test_a_model_that_fails_to_load_at_start_fails_start_up(tmp_path):
    """Weights that do not parse are found by the model worker, after the front end is up: the
    server exits 2 with the worker's reason as its one line (before: a traceback, then /healthz
    200 and /readyz 503 for ever, which no orchestrator restarts)."""
    bad = tmp_path / "vae.safetensors"
    bad.write_bytes(b"\xff" * 64)  # a header length past the end of the file
    line = serve_fails(tmp_path, "--models", f"v=tiny-vae:{bad}", env={"CONVSERVE_LOG_LEVEL": "warning"})
    assert "model worker cpu failed to load its models" in line and "WeightsError" in line, line
    assert "vae.safetensors" in line, line


def test_a_restarted_worker_that_fails_to_load_is_served_as_503(tmp_path):
    """Only the first start's load ends start-up: a worker restarted later whose load fails
    leaves the server up, not ready, its requests 503 (docs/reliability.md)."""
    import os
    import signal

    import httpx

    from live_server import REPO, start_server, wait_for

    weights = tmp_path / "vae.safetensors"
    shutil.copy(REPO / "tests" / "golden" / "tiny_vae_decoder.safetensors", weights)
    srv = start_server(tmp_path, models=f"v=tiny-vae:{weights}")
    try:
        pid = httpx.get(f"{srv.url}/v1/models/v", timeout=10).json()["devices"][0]["pid"]
        weights.write_bytes(b"\xff" * 64)  # the next load fails
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda: "WeightsError" in httpx.get(f"{srv.url}/readyz", timeout=10).text,
                 what="the restarted worker's failed load")
        assert srv.proc.poll() is None and httpx.get(f"{srv.url}/healthz", timeout=10).status_code == 200
        r = httpx.post(f"{srv.url}/v1/models/v/decode", content=b"", timeout=10)
        assert r.status_code == 503 and int(r.headers["retry-after"]) >= 1, r.text
    finally:
        srv.stop()


def test_help_at_80_columns_says_the_key_facts():
    """Each command's summary on one line (docstrings broke mid-sentence), serve's options with
    their variable and the settings' own defaults, the dtypes to choose from, bench --size."""
    import re

    from typer.main import get_command

    from service.cli.main import DEFAULT_MODELS
    from service.settings import DEFAULT_MODELS as SETTINGS_DEFAULT_MODELS, Settings

    def rendered(*args) -> str:
        r = runner.invoke(app, [*args, "--help"], env={"COLUMNS": "80"})
        assert r.exit_code == 0, r.output
        assert max(len(line) for line in r.output.splitlines()) <= 80, r.output
        return r.output

    top = rendered()
    for summary in ("Run the HTTP server (CPU default: tiny presets on NumPy).",
                    "Decode latents to images, MP4 or .npy (local or --url).",
                    "A quick local throughput number for one preset (no HTTP)."):
        assert any(summary in line for line in top.splitlines()), top

    def flat(text: str) -> str:  # the panels' text as one line: wrapped words joined again
        return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())

    serve = flat(rendered("serve"))
    assert DEFAULT_MODELS == SETTINGS_DEFAULT_MODELS and f"default {DEFAULT_MODELS}" in serve, serve
    assert ("float32|float64 on numpy (and bfloat16 on CPUs with AVX-512 BF16: its matrix products), "
            "float16|bfloat16|float32 on mlx and cuda") in serve, serve
    for param in get_command(app).commands["serve"].params:
        field = Settings.model_fields.get(param.name)
        if field is None or param.name == "dtype":  # --help; dtype's default is the backend's
            continue
        default = field.default
        shown = "none" if default in (None, "") else f"{default:g}" if isinstance(default, float) else str(default)
        assert f"[CONVSERVE_{param.name.upper()}; default {shown}]" in param.help, (param.name, param.help)
    bench = flat(rendered("bench"))
    assert "decoders: the latents' side (the images are 8x that for most VAEs)" in bench, bench
    assert "model preset (default tiny-vae; tiny-wan-vae for 5-D latents)" in flat(rendered("decode"))


def test_deploy_checks_without_the_test_extra_name_it_in_one_line(tmp_path):
    """`python deploy/checks.py` after the plain install: the packages it needs, in one line."""
    import os
    import sys

    from live_server import REPO

    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text("import sys\nsys.modules['yaml'] = None\n")  # as if not installed
    env = {**os.environ, "PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, str(REPO / "deploy" / "checks.py")], cwd=tmp_path, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "pyyaml" in lines[0] and "pip install -e '.[test]'" in lines[0], r.stderr
