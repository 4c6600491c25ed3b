"""No request can exhaust the server, on a real server over real sockets:

- the memory budget: a body larger than a front end's budget gets 413 before a byte of it is read;
  bodies that do not fit beside the ones admitted get 503 with Retry-After; everything taken is
  given back once the responses are out (the budget gauge returns to 0);
- the compute cap: a decode whose output is past the backend's pixel cap gets 413 up front, a
  streamed video is capped per frame group;
- abandoned work: a tiled decode whose client leaves while it runs stops at its next tile (the
  worker is free again without computing the rest);
- the minimum body rate: an upload trickling after its grace period gets 408 and gives its queue
  place back.
"""
from __future__ import annotations

import select
import socket
import threading

import httpx
import numpy as np

from live_server import metric, npy, scrape, wait_for

NPY = {"content-type": "application/x-npy"}
HOLD = 4242.0  # latents holding this value keep the worker busy until the release file exists


def latents(h: int = 5, w: int = 7, hold: bool = False) -> np.ndarray:
    x = np.random.default_rng(1).standard_normal((1, 4, h, w)).astype(np.float32)
    if hold:
        x[0, 0, 0, 0] = HOLD
    return x


def decode(url: str, x: np.ndarray, **params) -> httpx.Response:
    return httpx.post(f"{url}/v1/models/tiny-vae/decode", content=npy(x), headers=NPY,
                      params={"format": "npy", **params}, timeout=60)


def raw_request(port: int, path: str, body: bytes, send_body: bool = True) -> socket.socket:
    """A request on its own socket (the test decides when it closes)."""
    sock = socket.create_connection(("127.0.0.1", port))
    head = (f"POST {path} HTTP/1.1\r\nhost: x\r\ncontent-type: application/x-npy\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode()
    sock.sendall(head + (body if send_body else b""))
    return sock


def test_bodies_past_the_memory_budget_get_413_or_503_and_it_all_comes_back(server_factory, tmp_path):
    release = tmp_path / "release"
    budget = 3 << 20
    srv = server_factory(models="tiny-vae", memory_budget_bytes=budget, max_batch=1, max_queue_delay_ms=0,
                         fault_hold_value=HOLD, fault_hold_release_file=release)
    s = scrape(srv.url)
    assert metric(s, "convserve_memory_budget_bytes") == budget and metric(s, "convserve_memory_budget_used_bytes") == 0
    # larger than the whole budget: refused from its Content-Length, before the body is read
    r = httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=b"\0" * (4 << 20), headers=NPY, timeout=30)
    assert r.status_code == 413 and r.json()["type"].endswith("#over-memory-budget"), r.text
    # one request held on the worker with 1 MiB of body and its arrays taken ...
    held = latents(1, 1, hold=True)
    filler = np.zeros((1, 4, 64, 96), np.float32)  # 96 KiB of latents, 4.5 MiB of pixels out
    held_body = npy(held)
    pool_result = {}

    def send_held():
        pool_result["r"] = httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=held_body, headers=NPY,
                                      params={"format": "npy"}, timeout=60)

    t = threading.Thread(target=send_held)
    t.start()
    wait_for(lambda: release.with_name("release.holding").exists(), what="the held request on the worker")
    used = metric(scrape(srv.url), "convserve_memory_budget_used_bytes")
    assert used > 0
    # ... one whose output (4.5 MiB of float32 pixels) could never fit: 413;
    r = decode(srv.url, filler)
    assert r.status_code == 413 and "memory budget" in r.json()["detail"], r.text
    # a body that fits the budget alone but not beside what is held: 503 with Retry-After
    r = httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=b"\0" * (budget - int(used) + 1), headers=NPY,
                   params={"format": "npy"}, timeout=30)
    assert r.status_code == 503 and r.json()["type"].endswith("#memory-budget-full"), r.text
    assert int(r.headers["retry-after"]) >= 1
    release.touch()
    t.join(60)
    assert pool_result["r"].status_code == 200, pool_result["r"].text
    assert decode(srv.url, latents()).status_code == 200  # the server is fine
    s = scrape(srv.url)
    assert metric(s, "convserve_memory_budget_used_bytes") == 0  # everything given back
    assert metric(s, "convserve_rejected_total", model="tiny-vae", reason="memory_budget") == 3


def test_a_chunked_body_is_counted_as_it_arrives(server_factory):
    srv = server_factory(models="tiny-vae", memory_budget_bytes=2 << 20)

    def chunks():
        for _ in range(3):
            yield b"\0" * (1 << 20)

    r = httpx.post(f"{srv.url}/v1/models/tiny-vae/decode", content=chunks(), headers=NPY, timeout=30)
    assert r.status_code == 413 and r.json()["type"].endswith("#over-memory-budget"), r.text
    assert metric(scrape(srv.url), "convserve_memory_budget_used_bytes") == 0


def test_work_past_the_compute_cap_is_refused_up_front(server_factory):
    srv = server_factory(models="tiny-vae,tiny-wan-vae", max_request_pixels=64 * 64)
    r = decode(srv.url, latents(8, 9))  # 64x72 output pixels: one row of pixels too many
    assert r.status_code == 413 and r.json()["type"].endswith("#too-much-work"), r.text
    assert "CONVSERVE_MAX_REQUEST_PIXELS" in r.json()["detail"]
    assert decode(srv.url, latents(8, 8)).status_code == 200  # at the cap: served
    # a streamed video is capped per frame group (4 frames of 8x8 latents: 4 x 64 x 64 > cap)
    video = np.zeros((1, 4, 3, 8, 8), np.float32)
    r = httpx.post(f"{srv.url}/v1/models/tiny-wan-vae/decode/stream", content=npy(video), headers=NPY,
                   params={"format": "npy"}, timeout=30)
    assert r.status_code == 413 and r.json()["type"].endswith("#too-much-work"), r.text
    assert metric(scrape(srv.url), "convserve_rejected_total", model="tiny-vae", reason="too_much_work") == 1


def test_the_cpu_default_cap_refuses_a_4096_square_decode(live_server):
    r = decode(live_server.url, np.zeros((1, 4, 512, 512), np.float32))
    assert r.status_code == 413 and r.json()["type"].endswith("#too-much-work"), r.text


def test_a_tiled_decode_whose_client_left_stops_at_the_next_tile(server_factory, tmp_path):
    release = tmp_path / "release"
    srv = server_factory(models="tiny-vae", max_batch=1, max_queue_delay_ms=0, tile_size=64,
                         fault_hold_value=HOLD, fault_hold_release_file=release)
    s0 = scrape(srv.url)
    x = latents(40, 40, hold=True)  # 320x320 pixels in 64-pixel tiles: dozens of tiles
    sock = raw_request(srv.port, "/v1/models/tiny-vae/decode?format=npy&tiled=on", npy(x))
    wait_for(lambda: release.with_name("release.holding").exists(), what="the decode on the worker")
    sock.close()  # the client leaves while its decode runs
    wait_for(lambda: metric(scrape(srv.url), "convserve_rejected_total", model="tiny-vae", reason="client_gone")
             - metric(s0, "convserve_rejected_total", model="tiny-vae", reason="client_gone") == 1,
             what="the front end noticing the client gone")
    # a query down the same link, answered after the worker has read the cancel sent before it
    assert httpx.get(f"{srv.url}/v1/kernels", timeout=30).status_code == 200
    release.touch()
    wait_for(lambda: metric(scrape(srv.url), "convserve_abandoned_batches_total", model="tiny-vae") == 1,
             what="the decode stopping at a tile")
    r = decode(srv.url, latents())
    assert r.status_code == 200, r.text


def test_a_trickling_body_loses_its_place_after_the_grace(server_factory):
    srv = server_factory(models="tiny-vae", min_body_rate=1000, min_body_rate_grace_s=0.2, max_queue=1)
    body = npy(latents())
    sock = raw_request(srv.port, "/v1/models/tiny-vae/decode?format=npy", body, send_body=False)
    sock.sendall(body[:10])  # then nothing: under 1000 bytes/s once the grace is over
    sock.settimeout(30)
    answer = b""
    while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
        chunk = sock.recv(65536)
        if not chunk:
            break
        answer += chunk
    sock.close()
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"body-too-slow" in answer and b"CONVSERVE_MIN_BODY_RATE" in answer
    # the only queue place is free again
    assert decode(srv.url, latents()).status_code == 200


def test_a_full_queue_takes_the_place_of_the_slowest_upload(server_factory):
    """Tricklers that fill the queue within their grace period lose their places to new requests
    (the slowest first, once it has run long enough to judge), so steady traffic is served."""
    srv = server_factory(models="tiny-vae", min_body_rate=1000, min_body_rate_grace_s=60, max_queue=2)
    body = npy(latents())
    tricklers = [raw_request(srv.port, "/v1/models/tiny-vae/decode?format=npy", body, send_body=False)
                 for _ in range(2)]
    for sock in tricklers:
        sock.sendall(body[:1])
    wait_for(lambda: metric(scrape(srv.url), "convserve_inflight_requests", model="tiny-vae") == 2,
             what="both tricklers admitted")
    codes = []
    wait_for(lambda: codes.append(decode(srv.url, latents()).status_code) or codes[-1] == 200,
             what="a normal request served beside the tricklers")
    assert set(codes) <= {200, 429}, codes
    # one place was needed: one trickler got 408 (the other still holds its place)
    readable, _, _ = select.select(tricklers, [], [], 30)
    assert readable, "no trickler was answered"
    answer = readable[0].recv(65536)
    for sock in tricklers:
        sock.close()
    assert answer.startswith(b"HTTP/1.1 408") and b"gave its place" in answer, answer[:300]
