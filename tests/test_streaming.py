"""Streamed video decode (POST /v1/models/{name}/decode/stream) on a real uvicorn convserve:
frames arrive before the clip is done, match diffusers' AutoencoderKLWan (same random weights) and
the non-streaming /decode exactly; the fragmented MP4 plays in PyAV; a slow reader pauses the
decode; a disconnect stops it and frees the request; a full queue answers 429 before any frame."""
from __future__ import annotations

import asyncio
import io
import os
import signal
import socket
import struct
import threading
import time
import weakref

import httpx
import numpy as np
import pytest

from live_server import from_npy, metric, metric_sum, npy, scrape

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

NPY = {"content-type": "application/x-npy"}
MODEL = "wan"
WAN_SMALL = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                 temperal_downsample=[False, True, True])
TOL = 1e-4  # rel L2, fp32 (as the other diffusers comparisons over HTTP)


def fresh_seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def rel_l2(ours, ref) -> float:
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"shape {ours.shape} != reference {ref.shape}"
    return float(np.linalg.norm(ours - ref) / max(np.linalg.norm(ref), 1e-30))


def make_wan(seed: int):
    """diffusers' AutoencoderKLWan, tiny, every parameter perturbed away from its init."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    z = WAN_SMALL["z_dim"]
    cfg = {**WAN_SMALL, "latents_mean": rng.normal(0, 0.5, z).round(4).tolist(),
           "latents_std": rng.uniform(0.5, 3.0, z).round(4).tolist()}
    vae = diffusers.AutoencoderKLWan(**cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            p.add_(0.1 * torch.randn_like(p)) if name.endswith("bias") else p.mul_(1.0 + 0.1 * torch.randn_like(p))
    return vae


class Srv:
    def __init__(self, live, vae, folder=None):
        self.live, self.vae, self.folder = live, vae, folder
        self.url = live.url
        self.stream_url = f"{live.url}/v1/models/{MODEL}/decode/stream"

    def reference(self, lat: np.ndarray) -> np.ndarray:
        """diffusers' decode of normalised latents as frames N,F,H,W,3 in [0,1]."""
        cfg = self.vae.config
        mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
        std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # the server has the other core
        try:
            with torch.no_grad():
                sample = self.vae.decode(torch.from_numpy(lat) * std + mean).sample
        finally:
            torch.set_num_threads(before)
        return (sample.permute(0, 2, 3, 4, 1).numpy() / 2 + 0.5).astype(np.float32)

    def rss(self) -> int:
        with open(f"/proc/{self.live.proc.pid}/status") as fh:
            return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("VmRSS:"))

    def steps(self) -> float:
        """Model calls run by the worker (each streamed frame group is one)."""
        return metric_sum(scrape(self.url), "convserve_batch_size_count", model=MODEL)


@pytest.fixture(scope="module")
def srv(server_factory, tmp_path_factory):
    seed = fresh_seed()
    print(f"seed {seed}")
    vae = make_wan(seed)
    folder = tmp_path_factory.mktemp("stream_wan") / "wan"
    vae.save_pretrained(folder)
    live = server_factory(models=f"{MODEL}=tiny-wan-vae:{folder}", max_queue=1, log_level="info")
    return Srv(live, vae, folder)


def latents(*shape) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def read_records(data: bytes, partial: bool = False) -> tuple[list[np.ndarray], bool]:
    """Parse the .npy-stream framing: (arrays, ended with the zero-length record). partial: data
    is a prefix of the stream, a last incomplete record is left out."""
    out, i = [], 0
    while i + 8 <= len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        i += 8
        if n == 0:
            assert i == len(data), "bytes after the end record"
            return out, True
        if partial and i + n > len(data):
            break
        assert i + n <= len(data), "truncated record"
        out.append(from_npy(data[i:i + n]))
        i += n
    return out, False


def stream(url: str, lat: np.ndarray, **params) -> tuple[httpx.Response, list[tuple[float, bytes]], float]:
    """POST and read the body as it comes: (response, [(seconds since request, chunk)], total s)."""
    t0 = time.perf_counter()
    chunks = []
    with httpx.stream("POST", url, content=npy(lat), headers=NPY, params=params, timeout=120) as r:
        for chunk in r.iter_raw():
            chunks.append((time.perf_counter() - t0, chunk))
    return r, chunks, time.perf_counter() - t0


def wait_for(pred, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def settled_steps(srv: Srv, quiet_s: float = 1.5, timeout: float = 60.0) -> float:
    """The worker's call count once it has not moved for quiet_s."""
    deadline = time.monotonic() + timeout
    last, since = srv.steps(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.25)
        now = srv.steps()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            return now
    pytest.fail("the worker never went quiet")


@pytest.fixture(scope="module")
def clip(srv):
    """9 latent frames (33 output frames, 72x88): latents, diffusers' frames, /decode's npy."""
    lat = latents(1, 4, 9, 9, 11)
    r = httpx.post(f"{srv.url}/v1/models/{MODEL}/decode", content=npy(lat), headers=NPY,
                   params={"format": "npy"}, timeout=120)
    assert r.status_code == 200, r.text
    return lat, srv.reference(lat), from_npy(r.content)


# ---- tests ------------------------------------------------------------------------------------------
def test_npy_stream_first_frame_early_and_exact(srv, clip):
    lat, ref, whole = clip
    assert rel_l2(whole, ref) < TOL
    s0 = scrape(srv.url)
    r, chunks, total = stream(srv.stream_url, lat, format="npy")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy-stream"
    assert r.headers["transfer-encoding"] == "chunked" and "content-length" not in r.headers
    assert r.headers["x-output-shape"] == "1,33,72,88,3" and r.headers["x-frame-groups"] == "9"
    groups, ended = read_records(b"".join(c for _, c in chunks))
    assert ended and [g.shape[1] for g in groups] == [1] + [4] * 8
    got = np.concatenate(groups, axis=1)
    assert np.array_equal(got, whole), "stream differs from /decode"
    err = rel_l2(got, ref)
    print(f"stream vs diffusers rel L2 {err:.2e}; first chunk {chunks[0][0]:.2f}s of {total:.2f}s")
    assert err < TOL
    # 1 of 9 decode steps is done when the first bytes leave: well under half the clip's time
    assert chunks[0][0] < 0.5 * total, (chunks[0][0], total)
    s1 = scrape(srv.url)
    for name in ("convserve_time_to_first_frame_seconds_count", "convserve_stream_frames_per_second_count"):
        assert metric(s1, name, model=MODEL, backend="numpy") - metric(s0, name, model=MODEL, backend="numpy") == 1
    ttff = metric(s1, "convserve_time_to_first_frame_seconds_sum", model=MODEL, backend="numpy") - \
        metric(s0, "convserve_time_to_first_frame_seconds_sum", model=MODEL, backend="numpy")
    assert 0 < ttff < total
    # where that time went, stage by stage: they add up to it, and the decode is in first_group
    stage = "convserve_stream_first_frame_stage_seconds_sum"
    stages = {st: metric(s1, stage, model=MODEL, backend="numpy", stage=st)
              - metric(s0, stage, model=MODEL, backend="numpy", stage=st) for st in ("body", "open", "first_group", "send")}
    assert all(v >= 0 for v in stages.values()) and stages["first_group"] > 0, stages
    assert abs(sum(stages.values()) - ttff) < 1e-6, (stages, ttff)
    # each group's own stages: every group encoded and sent, each after the first waited for
    group_count = "convserve_stream_group_stage_seconds_count"
    counts = {st: metric(s1, group_count, model=MODEL, backend="numpy", format="npy", stage=st)
              - metric(s0, group_count, model=MODEL, backend="numpy", format="npy", stage=st)
              for st in ("wait", "encode", "send")}
    assert counts == {"wait": 8, "encode": 9, "send": 9}, counts
    assert metric(s1, "convserve_requests_total", model=MODEL, endpoint="decode_stream", status=200) - \
        metric(s0, "convserve_requests_total", model=MODEL, endpoint="decode_stream", status=200) == 1


def test_npy_stream_of_a_batch(srv):
    lat = latents(2, 4, 3, 5, 7)
    r, chunks, _ = stream(srv.stream_url, lat, format="npy")
    groups, ended = read_records(b"".join(c for _, c in chunks))
    assert r.status_code == 200 and ended and [g.shape for g in groups] == [(2, 1, 40, 56, 3)] + [(2, 4, 40, 56, 3)] * 2
    assert rel_l2(np.concatenate(groups, axis=1), srv.reference(lat)) < TOL


def test_fragmented_mp4_plays_in_pyav(srv, clip):
    av = pytest.importorskip("av")
    from service.codecs.fmp4 import top_level_boxes

    lat, ref, _ = clip
    r, chunks, total = stream(srv.stream_url, lat, format="mp4", fps=12)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    data = b"".join(c for _, c in chunks)
    kinds = [k for k, _ in top_level_boxes(data)]
    assert kinds[:2] == ["ftyp", "moov"] and kinds[2:] == ["moof", "mdat"] * 9, kinds
    assert chunks[0][0] < 0.5 * total, (chunks[0][0], total)
    with av.open(io.BytesIO(data)) as container:
        vs = container.streams.video[0]
        frames = [f for f in container.decode(video=0)]
        assert vs.average_rate == 12
    assert len(frames) == 33 and (frames[0].width, frames[0].height) == (88, 72)
    assert all(f.pts is not None for f in frames) and [f.pts for f in frames] == sorted(f.pts for f in frames)
    rgb = np.stack([f.to_ndarray(format="rgb24") for f in frames]).astype(np.float64)
    luma = np.array([0.299, 0.587, 0.114])
    y, y_ref = rgb @ luma, (np.clip(ref[0], 0, 1) * 255) @ luma
    err = np.abs(y - y_ref).mean()
    print(f"mp4 luma mean abs error {err:.2f} levels")
    assert err < 2.5 and err < np.abs(y - y_ref[::-1]).mean() / 4, err


def test_the_writer_takes_another_preset_and_thread_count():
    """The settings benchmarks/service/video_encoder.py compares: ultrafast on one thread still
    gives one playable fragment per group, its frames those written"""
    av = pytest.importorskip("av")
    from service.codecs.fmp4 import FragmentedMP4Writer, top_level_boxes

    y, x = np.mgrid[0:48, 0:64]
    clip = np.stack([np.stack([(x * 3 + t * 5) % 256, (y * 4) % 256, (x + y + t) % 256], -1)
                     for t in range(9)]).astype(np.uint8)
    writer = FragmentedMP4Writer(64, 48, 8.0, 90, preset="ultrafast", threads=1)
    data = b"".join(writer.add_group(clip[a:b], last=b == 9) for a, b in ((0, 1), (1, 5), (5, 9)))
    assert [k for k, _ in top_level_boxes(data)] == ["ftyp", "moov"] + ["moof", "mdat"] * 3
    with av.open(io.BytesIO(data)) as container:
        got = np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)]).astype(np.float64)
    assert got.shape == clip.shape and np.abs(got - clip).mean() < 6


def test_decode_of_one_clip_is_a_whole_file_sent_as_it_decodes(srv, clip):
    """/decode of one video (not the stream route) answers one .npy file of the declared length,
    equal to the stream's frames, in float32 (as the clip fixture got it), uint8 (rounded on the
    device) and float16; its MP4 is a whole playable file; a batch takes the one-piece path."""
    lat, _, whole = clip
    url = f"{srv.url}/v1/models/{MODEL}/decode"
    head_len = len(__import__("service.codecs", fromlist=["x"]).npy_header(whole.shape, np.float32))
    r = httpx.post(url, content=npy(lat), headers=NPY, params={"format": "npy"}, timeout=120)
    assert int(r.headers["content-length"]) == len(r.content) == head_len + whole.nbytes
    assert np.array_equal(from_npy(r.content), whole)
    u8 = from_npy(httpx.post(url, content=npy(lat), headers=NPY, params={"format": "npy", "dtype": "uint8"},
                             timeout=120).content)
    assert u8.dtype == np.uint8 and np.array_equal(u8, np.floor(np.clip(whole, 0, 1) * 255 + 0.5).astype(np.uint8))
    half = from_npy(httpx.post(url, content=npy(lat), headers=NPY, params={"format": "npy", "dtype": "float16"},
                               timeout=120).content)
    assert np.array_equal(half, whole.astype(np.float16))
    av = pytest.importorskip("av")
    mp4 = httpx.post(url, content=npy(lat), headers=NPY, params={"format": "mp4", "fps": 12}, timeout=120)
    assert mp4.status_code == 200 and mp4.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(mp4.content)) as container:
        assert len(list(container.decode(video=0))) == whole.shape[1]
    two = latents(2, 4, 3, 5, 7)  # two clips: decoded whole, then sent (a zip of MP4s / one .npy)
    both = from_npy(httpx.post(url, content=npy(two), headers=NPY, params={"format": "npy"}, timeout=120).content)
    one = from_npy(httpx.post(url, content=npy(two[1:]), headers=NPY, params={"format": "npy"}, timeout=120).content)
    assert both.shape == (2, 9, 40, 56, 3) and np.allclose(both[1], one[0], atol=2e-5)


def test_disconnect_stops_the_decode(srv):
    t = 16
    lat = latents(1, 4, t, 9, 11)
    before = settled_steps(srv)
    s0 = scrape(srv.url)
    got = b""
    with httpx.stream("POST", srv.stream_url, content=npy(lat), headers=NPY, params={"format": "npy"},
                      timeout=120) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            got += chunk
            if len(read_records(got, partial=True)[0]) >= 2:
                break  # leaving the block closes the connection mid-stream
    wait_for(lambda: metric(scrape(srv.url), "convserve_inflight_requests", model=MODEL) == 0,
             what="in-flight gauge back to 0")
    steps = settled_steps(srv) - before
    assert steps <= 5, f"{steps} of {t} frame groups decoded after a disconnect at 2"
    s1 = scrape(srv.url)
    assert metric(s1, "convserve_requests_total", model=MODEL, endpoint="decode_stream", status=499) - \
        metric(s0, "convserve_requests_total", model=MODEL, endpoint="decode_stream", status=499) == 1
    assert f"ended after 2/{t} frame groups" in wait_for(
        lambda: srv.live.log() if f"/{t} frame groups" in srv.live.log() else "", 10, "the stream's end log")


def test_slow_reader_pauses_the_decode_and_a_disconnect_frees_it(srv):
    """A reader that stops reading holds back the decode (no further frame group is made, so
    memory cannot grow); when it then goes away, the paused decode is dropped: in-flight back to
    0, no further group decoded. 128x128 frames: 0.8 MB a group, so the kernel's socket buffers
    (at most a few MB on localhost) fill well before the 16th group. RSS is printed, not checked:
    the allocator keeps freed pages, so the freed cache is checked in-process below."""
    t = 16
    lat = latents(1, 4, t, 16, 16)
    before = settled_steps(srv)
    rss_idle = srv.rss()
    s0 = scrape(srv.url)
    body = npy(lat)
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.live.port))
    try:
        sock.sendall(b"POST /v1/models/%s/decode/stream?format=npy HTTP/1.1\r\nHost: localhost\r\n"
                     b"Content-Type: application/x-npy\r\nContent-Length: %d\r\n\r\n" % (MODEL.encode(), len(body))
                     + body)
        head = sock.recv(4096)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        paused = settled_steps(srv, quiet_s=2.0) - before
        rss_paused = srv.rss()
        assert metric(scrape(srv.url), "convserve_inflight_requests", model=MODEL) == 1
    finally:
        sock.close()
    wait_for(lambda: metric(scrape(srv.url), "convserve_inflight_requests", model=MODEL) == 0,
             what="in-flight gauge back to 0")
    after = settled_steps(srv) - before
    rss_after = srv.rss()
    print(f"decode paused after {paused:.0f}/{t} groups ({after:.0f} after the disconnect); "
          f"RSS idle {rss_idle / 2**20:.0f} MiB, paused {rss_paused / 2**20:.0f} MiB, gone {rss_after / 2**20:.0f} MiB")
    assert paused >= 1 and paused < t - 1, f"{paused} of {t} groups decoded while the reader did not read"
    assert after <= paused + 1, "the decode went on after the client left"
    s1 = scrape(srv.url)
    assert metric(s1, "convserve_requests_total", model=MODEL, endpoint="decode_stream", status=499) - \
        metric(s0, "convserve_requests_total", model=MODEL, endpoint="decode_stream", status=499) == 1


def test_full_queue_answers_429_before_any_frame(srv):
    """max_queue=1: one decode running, one queued -> a stream is refused with Retry-After."""
    s0 = scrape(srv.url)
    codes = {}

    def plain(tag, lat):
        r = httpx.post(f"{srv.url}/v1/models/{MODEL}/decode", content=npy(lat), headers=NPY,
                       params={"format": "npy"}, timeout=120)
        codes[tag] = r.status_code

    # two clips: one model call for the lot (a single clip's /decode goes group by group, letting
    # other work in between its steps)
    running = threading.Thread(target=plain, args=("running", latents(2, 4, 5, 16, 16)))
    running.start()

    def first_running() -> bool:
        """Its model call begun (the queue-wait histogram counts a request as its batch starts),
        and the queue-depth gauge, which lags its queue by up to the worker's publish interval,
        back to 0: else the running decode's stale 1 would read as the next one queued."""
        snap = scrape(srv.url)
        return (metric(snap, "convserve_queue_wait_seconds_count", model=MODEL)
                - metric(s0, "convserve_queue_wait_seconds_count", model=MODEL) == 1
                and metric(snap, "convserve_queue_depth", model=MODEL) == 0)

    wait_for(first_running, what="the first decode to start")
    queued = threading.Thread(target=plain, args=("queued", latents(1, 4, 1, 5, 7)))
    queued.start()
    wait_for(lambda: metric(scrape(srv.url), "convserve_queue_depth", model=MODEL) == 1, what="a queued decode")
    r = httpx.post(srv.stream_url, content=npy(latents(1, 4, 3, 5, 7)), headers=NPY, timeout=30)
    running.join(120)
    queued.join(120)
    assert codes == {"running": 200, "queued": 200}
    assert r.status_code == 429 and r.headers["retry-after"] and \
        r.headers["content-type"] == "application/problem+json", (r.status_code, r.text)
    assert r.json()["type"].endswith("#queue-full")
    s1 = scrape(srv.url)
    assert metric(s1, "convserve_requests_total", model=MODEL, endpoint="decode_stream", status=429) - \
        metric(s0, "convserve_requests_total", model=MODEL, endpoint="decode_stream", status=429) == 1


def test_errors_are_problems_before_the_stream(srv):
    r = httpx.post(srv.stream_url, content=npy(latents(1, 3, 2, 5, 7)), headers=NPY, timeout=30)
    assert r.status_code == 422 and r.json()["type"].endswith("#wrong-channels")
    r = httpx.post(srv.stream_url, content=npy(latents(2, 4, 2, 5, 7)), headers=NPY, params={"format": "mp4"},
                   timeout=30)
    assert r.status_code == 422 and r.json()["type"].endswith("#batch-not-streamable")
    r = httpx.post(f"{srv.url}/v1/models/nope/decode/stream", content=npy(latents(1, 4, 2, 5, 7)), headers=NPY)
    assert r.status_code == 404
    spec = httpx.get(f"{srv.url}/openapi.json").json()
    op = spec["paths"]["/v1/models/{name}/decode/stream"]["post"]
    assert set(op["responses"]["200"]["content"]) == {"video/mp4", "application/x-npy-stream"}
    assert "8-byte little-endian" in op["description"] and "429" in op["responses"]
    assert metric(scrape(srv.url), "convserve_inflight_requests", model=MODEL) == 0


def test_a_draining_server_finishes_the_stream_then_exits(srv):
    """SIGTERM mid-stream: the admitted stream still gets every frame group (its later steps pass
    the closed queue), newcomers get 503, then the server exits 0. Stops the module's server: last."""
    t = 6
    lat = latents(1, 4, t, 9, 11)
    got, signalled = b"", False
    with httpx.stream("POST", srv.stream_url, content=npy(lat), headers=NPY, params={"format": "npy"},
                      timeout=120) as r:
        assert r.status_code == 200
        for chunk in r.iter_raw():
            got += chunk
            if not signalled and read_records(got, partial=True)[0]:
                signalled = True
                srv.live.proc.send_signal(signal.SIGTERM)
                wait_for(lambda: httpx.get(f"{srv.url}/readyz").status_code == 503, 10, "draining")
                late = httpx.post(srv.stream_url, content=npy(latents(1, 4, 2, 5, 7)), headers=NPY, timeout=30)
                assert late.status_code == 503, late.text
    groups, ended = read_records(got)
    assert ended and len(groups) == t
    assert srv.live.proc.wait(30) == 0


# ---- the pieces under the route, without HTTP ------------------------------------------------------
def test_solo_items_run_alone():
    from service.worker.batcher import Batcher

    async def main():
        gate = threading.Event()
        b = Batcher(max_batch=8, max_queue_delay_ms=1000)
        try:
            t0 = time.perf_counter()
            solo = b.submit("m", "s", np.ones((1, 1)), lambda x: (gate.wait(10), x * 5)[1], solo=True)
            while not solo.started:  # no batching wait for a solo item
                await asyncio.sleep(0.01)
            started_after = time.perf_counter() - t0
            queued = b.submit("m", "k", np.zeros((1, 1)), lambda x: x + 1)
            cont = b.submit("m", "s", np.ones((1, 1)), lambda x: x * 7, solo=True)
            gate.set()
            loop = asyncio.get_running_loop()
            out = await asyncio.gather(*(loop.run_in_executor(None, i.outcome.result, 10) for i in (solo, queued, cont)))
            return out, started_after
        finally:
            b.stop()

    (a, b, c), started_after = asyncio.run(main())
    assert started_after < 0.5, started_after
    assert (a.tolist(), b.tolist(), c.tolist()) == ([[5.0]], [[1.0]], [[7.0]])


def test_generator_closed_after_a_running_step_when_the_stream_ends():
    from service.worker.stream_steps import GeneratorSteps, StreamClosed

    closed, release = threading.Event(), threading.Event()

    def frames():
        try:
            for k in range(100):
                if k == 1:
                    release.wait(10)
                yield k
        finally:
            closed.set()

    steps = GeneratorSteps(frames())
    assert steps.step() == 0
    worker = threading.Thread(target=steps.step)
    worker.start()
    time.sleep(0.1)
    steps.close()  # the step is running: close must not wait for it, nor close a running generator
    assert not closed.is_set()
    release.set()
    worker.join(10)
    assert closed.wait(5) and steps.released and steps.steps == 2
    with pytest.raises(StreamClosed):
        steps.step()


def test_closing_the_stream_frees_the_decoders_feature_cache(monkeypatch):
    from convkernels import get_backend
    from models import load_model
    from models.wan_vae.layers import FeatureCache
    from service.worker.stream_steps import GeneratorSteps

    # each cache as it is made, not read through the generator's frame; and the generator held by
    # the steps alone, as in the worker. Why: on Python 3.12.3 (the H200 host's) a closed
    # generator's frame keeps its locals for as long as the generator object lives, so a test
    # that held the generator held the cache (3.11 and 3.12.1 clear them at close)
    made, init = [], FeatureCache.__init__

    def recorded(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append(weakref.ref(self))

    monkeypatch.setattr(FeatureCache, "__init__", recorded)
    model = load_model("w", "tiny-wan-vae", get_backend("numpy"))
    gen = model.decode_frames(latents(1, 4, 5, 3, 5))
    gen_ref = weakref.ref(gen)
    steps = GeneratorSteps(gen)
    del gen
    assert steps.step().shape == (1, 1, 24, 40, 3)
    assert len(made) == 1 and made[0]() is not None and made[0]().slots
    steps.close()
    assert gen_ref() is None, "the closed stream's steps still hold its generator"
    assert made[0]() is None, "the feature cache outlived the closed stream"


def fault_count(snap, outcome: str) -> float:
    return metric(snap, "convserve_faults_total", model=MODEL, fault="device_oom", outcome=outcome)


def test_out_of_memory_mid_stream_resumes_in_tiles(srv, server_factory):
    """With 1.5 MB of "device" (injected OOM), a 96x96 clip's first frame decodes untiled, the
    next group runs out: the decode resumes in tiles (256 and 128 px still mean one tile; 64 px
    fits), after decoding again the group it had sent. The client sees one unbroken stream: frame
    0 as diffusers decodes it untiled, the rest as diffusers decodes with 64 px tiles."""
    oom = Srv(server_factory(models=f"{MODEL}=tiny-wan-vae:{srv.folder}", fault_oom_above_bytes=1_500_000),
              srv.vae)
    lat = latents(1, 4, 3, 12, 12)
    s0 = scrape(oom.url)
    r, chunks, _ = stream(oom.stream_url, lat, format="npy")
    groups, ended = read_records(b"".join(c for _, c in chunks))
    assert r.status_code == 200 and ended and [g.shape[1] for g in groups] == [1, 4, 4]
    s1 = scrape(oom.url)
    assert fault_count(s1, "retried") - fault_count(s0, "retried") == 3
    assert fault_count(s1, "recovered") - fault_count(s0, "recovered") == 1
    assert fault_count(s1, "failed") == fault_count(s0, "failed")
    untiled = srv.reference(lat)
    srv.vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                          tile_sample_stride_height=48, tile_sample_stride_width=48)
    try:
        tiled = srv.reference(lat)
    finally:
        srv.vae.disable_tiling()
    first, rest = rel_l2(groups[0], untiled[:, :1]), rel_l2(np.concatenate(groups[1:], axis=1), tiled[:, 1:])
    print(f"RELIABILITY stream oom mid-stream: resumed in 64 px tiles; rel L2 frame 0 vs untiled {first:.1e}, "
          f"frames 1-8 vs diffusers 64 px tiles {rest:.1e}")
    assert first < TOL and rest < TOL
    assert rel_l2(tiled[:, 1:], untiled[:, 1:]) > 1e-3  # the two references differ: the tiles are real


def test_out_of_memory_in_every_tile_cuts_the_stream_and_the_server_keeps_serving(srv, server_factory):
    """150 kB: the first group still fits in small tiles, the next fits nowhere. The stream is cut
    after the first record (no end record, counted as a failed OOM); the server stays ready."""
    oom = Srv(server_factory(models=f"{MODEL}=tiny-wan-vae:{srv.folder}", fault_oom_above_bytes=150_000),
              srv.vae)
    s0 = scrape(oom.url)
    body, cut = b"", False
    with httpx.stream("POST", oom.stream_url, content=npy(latents(1, 4, 3, 12, 12)), headers=NPY,
                      params={"format": "npy"}, timeout=120) as r:
        try:
            for chunk in r.iter_raw():
                body += chunk
        except httpx.RemoteProtocolError:  # the chunked body ends without its last chunk
            cut = True
    groups, ended = read_records(body, partial=True)
    assert r.status_code == 200 and cut and not ended and [g.shape[1] for g in groups] == [1]
    s1 = scrape(oom.url)
    assert fault_count(s1, "failed") - fault_count(s0, "failed") == 1
    assert httpx.get(f"{oom.url}/readyz").status_code == 200
    r, chunks, _ = stream(oom.stream_url, latents(1, 4, 2, 2, 3), format="npy")  # what fits still streams
    assert r.status_code == 200 and read_records(b"".join(c for _, c in chunks))[1]


def test_frames_convert_to_yuv420p_side_by_side_in_order_as_the_encoder_would():
    """The MP4 writers' frames, converted on a few threads: each one the bits PyAV's own
    conversion gives it (what the encoder did with RGB frames), in the clip's order"""
    av = pytest.importorskip("av")
    from service.codecs.video import yuv420p_frames

    rng = np.random.default_rng(fresh_seed())
    clip = rng.integers(0, 256, (7, 34, 46, 3), dtype=np.uint8)
    got = yuv420p_frames(av, clip[:, ::-1])  # a strided view, as a padded group may be
    assert [f.format.name for f in got] == ["yuv420p"] * 7
    for frame, ours in zip(clip[:, ::-1], got):
        own = av.VideoFrame.from_ndarray(np.ascontiguousarray(frame), format="rgb24").reformat(format="yuv420p")
        assert np.array_equal(ours.to_ndarray(), own.to_ndarray())


def test_the_mp4_preset_setting_reaches_the_encoder():
    """MP4_PRESET is a closed choice, and the whole-file writer encodes with it (ultrafast's
    stream is another stream than veryfast's, and still plays)"""
    pytest.importorskip("av")
    from pydantic import ValidationError

    from service.codecs.video import encode_videos, read_mp4_frames
    from service.settings import Settings

    with pytest.raises(ValidationError):
        Settings(mp4_preset="placebo-ish")
    assert Settings().mp4_preset == "veryfast"
    y, x = np.mgrid[0:48, 0:64]
    clip = np.stack([np.stack([(x * 3 + t * 5) % 256, (y * 4) % 256, (x + y + t) % 256], -1)
                     for t in range(5)]).astype(np.float32)[None] / 255
    fast, media = encode_videos(clip, 8.0, 90, "ultrafast")
    default, _ = encode_videos(clip, 8.0, 90)
    assert media == "video/mp4" and fast != default
    assert read_mp4_frames(fast).shape == read_mp4_frames(default).shape == (5, 48, 64, 3)


def test_the_pump_asks_steps_ahead_in_order_and_lets_go_of_every_group_it_never_handed_over():
    """frame_groups.FrameGroups.pump keeps STEPS_AHEAD decode steps asked: groups reach the buffer in the order
    asked whatever order their answers come in, and a pump cancelled with steps asked and answered
    (the client gone) closes each of their leases; none is closed twice"""
    from service.frontend import frame_groups

    class Lease:
        def __init__(self):
            self.closed = 0

        def close(self):
            self.closed += 1

    async def scenario():
        groups = frame_groups.FrameGroups.__new__(frame_groups.FrameGroups)
        groups.total, groups.asked = 7, 1
        leases, in_flight, most = [], [0], [0]
        answers = {}

        async def next_group(disconnected=None):
            k, groups.asked = groups.asked, groups.asked + 1
            lease = Lease()
            leases.append(lease)
            in_flight[0] += 1
            most[0] = max(most[0], in_flight[0])
            try:
                await asyncio.sleep(0.01 * ((k * 5) % 3))  # answers out of order
                answers[k] = True
                return k, lease
            except BaseException:
                lease.close()
                raise
            finally:
                in_flight[0] -= 1

        groups.next = next_group
        buffer = asyncio.Queue(maxsize=1)
        pump = asyncio.create_task(groups.pump(buffer, start=1))
        order = []
        for _ in range(6):
            k, lease = await buffer.get()
            order.append(k)
            lease.close()
        await pump
        assert order == [1, 2, 3, 4, 5, 6] and most[0] == frame_groups.STEPS_AHEAD
        assert all(lease.closed == 1 for lease in leases)

        # the client goes: two groups taken, the buffer full, steps asked behind it
        groups.total, groups.asked = 40, 1
        leases.clear()
        buffer = asyncio.Queue(maxsize=1)
        pump = asyncio.create_task(groups.pump(buffer, start=1))
        for _ in range(2):
            (await buffer.get())[1].close()
        await asyncio.sleep(0.05)  # the buffer full again, the steps behind it answered
        pump.cancel()
        await asyncio.gather(pump, return_exceptions=True)
        while not buffer.empty():  # the sender's own clean-up (FrameStreamResponse)
            buffer.get_nowait()[1].close()
        assert len(leases) >= 3 and all(lease.closed == 1 for lease in leases), [x.closed for x in leases]

    asyncio.run(scenario())
