"""A front end loads the video encoder before its first MP4 answer where a served model is a video
decoder, and only there (service/frontend/codec_warmup.py); without PyAV it still starts and serves.
Real servers with two front ends each; what each front-end process has loaded is read from its
memory map (PyAV's FFmpeg libraries)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import npy, start_server

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
av = pytest.importorskip("av")


def _front_ends(srv) -> list[int]:
    """The server process (front end 0) and its children that listen on the server's port."""
    listening = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for row in Path(table).read_text().splitlines()[1:]:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == srv.port:
                listening.add(f[9])
    kids = [int(c) for task in Path(f"/proc/{srv.proc.pid}/task").iterdir()
            for c in (task / "children").read_text().split()]
    out = []
    for pid in [srv.proc.pid, *kids]:
        sockets = set()
        for fd in Path(f"/proc/{pid}/fd").iterdir():
            try:
                link = fd.readlink()
            except OSError:
                continue
            sockets.add(str(link)[8:-1])
        if sockets & listening:
            out.append(pid)
    return out


def _has_ffmpeg(pid: int) -> bool:
    return "libavcodec" in Path(f"/proc/{pid}/maps").read_text()


def _every_front_end(srv, front_ends: int = 2, timeout: float = 60.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while len(pids := _front_ends(srv)) < front_ends:
        assert time.monotonic() < deadline, f"{len(pids)} of {front_ends} front ends listen"
        time.sleep(0.1)
    return pids


def test_front_ends_of_a_video_decoder_load_the_encoder_before_any_request(tmp_path):
    srv = start_server(tmp_path, models="wan=tiny-wan-vae", cli_args=("--workers", "2"))
    try:
        pids = _every_front_end(srv)
        # the first front end loads it beside its first requests; the others before they listen
        deadline = time.monotonic() + 60
        while not all(_has_ffmpeg(pid) for pid in pids):
            assert time.monotonic() < deadline, [(pid, _has_ffmpeg(pid)) for pid in pids]
            time.sleep(0.1)
    finally:
        srv.stop()


def test_front_ends_of_image_models_leave_it_unloaded(tmp_path):
    srv = start_server(tmp_path, models="tiny-vae", cli_args=("--workers", "2"))
    try:
        pids = _every_front_end(srv)
        time.sleep(1.0)  # as long as a warm-up would have had
        assert not any(_has_ffmpeg(pid) for pid in pids), "an image-only server's front end mapped FFmpeg"
    finally:
        srv.stop()


def test_without_pyav_a_video_server_starts_serves_npy_and_answers_mp4_with_501(tmp_path):
    """PyAV made absent in every process of the server (None in sys.modules, as Python reads a
    module that is not there: find_spec gives None, import raises): the warm-up is only a warning."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text('import sys\nsys.modules["av"] = None\n')
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    srv = start_server(tmp_path, models="wan=tiny-wan-vae", cli_args=("--workers", "2"), env_extra={"PYTHONPATH": path})
    try:
        url = f"{srv.url}/v1/models/wan/decode"
        body = npy(np.random.default_rng(0).standard_normal((1, 4, 2, 3, 3)).astype(np.float32))
        head = {"content-type": "application/x-npy"}
        for _ in range(4):  # over both front ends, most likely
            r = httpx.post(url, content=body, headers=head, params={"format": "npy"}, timeout=60)
            assert r.status_code == 200 and r.headers["X-Output-Shape"] == "1,5,24,24,3", r.text
            r = httpx.post(url, content=body, headers=head, params={"format": "mp4"}, timeout=60)
            assert r.status_code == 501 and r.json()["type"].endswith("video-extra-missing"), r.text
        assert httpx.get(f"{srv.url}/readyz", timeout=10).status_code == 200
        deadline = time.monotonic() + 30
        while srv.log().count("did not load ahead") < 2:  # each front end said why, once
            assert time.monotonic() < deadline, srv.log()
            time.sleep(0.1)
    finally:
        srv.stop()
