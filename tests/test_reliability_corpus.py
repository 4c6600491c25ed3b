"""The bad-input corpus (tests/corpus/): every hostile or broken input gets its specific 4xx as
application/problem+json, the server's memory stays bounded, and the next good request is
answered correctly (the same output as before the corpus). Plus what lives below the app, sent
on raw sockets: lying or non-numeric Content-Length, a client that leaves mid-body, a body that
trickles in (slow-loris: 408 at the request timeout), headers that trickle in or never come (408
at the header timeout, connection closed), idle half-sent requests that must not block anyone
else, oversized headers."""
from __future__ import annotations

import json
import socket
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import REPO, from_npy, metric_sum, npy, scrape

sys.path.insert(0, str(REPO / "tests" / "corpus"))
import make_corpus  # noqa: E402

KEY = "corpus-key"
AUTH = {"authorization": f"Bearer {KEY}"}
TIMEOUT_S = 3.0
HEADER_TIMEOUT_S = 2.0
SERVER_SETTINGS = dict(models="tiny-vae,tiny-convnext,tiny-wan-vae", api_key=KEY, max_pixels=make_corpus.MAX_PIXELS,
                       max_body_bytes=make_corpus.MAX_BODY_BYTES, max_frames=9, max_batch=4,
                       request_timeout_s=TIMEOUT_S, header_timeout_s=HEADER_TIMEOUT_S)
MANIFEST = json.loads((REPO / "tests" / "corpus" / "manifest.json").read_text())
GOOD = np.random.default_rng(7).standard_normal((1, 4, 5, 3)).astype(np.float32)
#: RSS growth allowed over the whole corpus (the real bomb alone would inflate to 432 MB)
RSS_BUDGET_MIB = 150
SEEN: dict[str, int] = {}


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


@pytest.fixture(scope="module")
def srv(server_factory):
    s = server_factory(**SERVER_SETTINGS)
    s.good_out = good_decode(s)
    s.rss0 = rss_kib(s.proc.pid)
    s.rss_max = s.rss0
    return s


def good_decode(s) -> np.ndarray:
    r = httpx.post(f"{s.url}/v1/models/tiny-vae/decode", content=npy(GOOD), params={"format": "npy"},
                   headers={"content-type": "application/x-npy", **AUTH}, timeout=60)
    assert r.status_code == 200, r.text
    return from_npy(r.content)


def send(s, case: dict, data: bytes) -> httpx.Response:
    url = s.url + make_corpus.ROUTES[case["route"]].format(model=case["model"])
    headers = {"content-type": case["content_type"], **AUTH, **case["headers"]}
    return httpx.post(url, content=data, params=case["query"], headers=headers, timeout=60)


def check(s, case: dict, data: bytes) -> None:
    r = send(s, case, data)
    assert r.status_code == case["status"], f"{case['name']} ({case['why']}): {r.status_code} {r.text[:300]}"
    assert r.headers["content-type"] == "application/problem+json", case["name"]
    body = r.json()
    assert body["status"] == case["status"] and body["type"].endswith("#" + case["kind"]), (case["name"], body)
    assert body["title"] and body["detail"], case["name"]
    SEEN[case["name"]] = r.status_code
    s.rss_max = max(s.rss_max, rss_kib(s.proc.pid))
    # the next good request is answered, and answered correctly
    np.testing.assert_allclose(good_decode(s), s.good_out, rtol=0, atol=1e-6, err_msg=case["name"])


@pytest.mark.parametrize("case", MANIFEST, ids=[c["name"] for c in MANIFEST])
def test_corpus_input(srv, case):
    check(srv, case, (REPO / "tests" / "corpus" / case["file"]).read_bytes())


def test_large_generated_inputs(srv, tmp_path):
    for case in make_corpus.large_cases(tmp_path):
        check(srv, case, Path(case["file"]).read_bytes())


# ---- below the app: raw sockets -------------------------------------------------------------------
def raw(srv, head: bytes, body: bytes = b"", timeout: float = 10.0) -> bytes:
    with socket.create_connection(("127.0.0.1", srv.port), timeout=timeout) as sock:
        sock.sendall(head + body)
        return read_all(sock)


def read_all(sock) -> bytes:
    chunks = []
    try:
        while True:
            c = sock.recv(65536)
            if not c:
                break
            chunks.append(c)
    except (socket.timeout, ConnectionResetError):
        pass
    return b"".join(chunks)


def head(path: str, content_length: str | int, extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
            f"Content-Type: application/x-npy\r\nContent-Length: {content_length}\r\nConnection: close\r\n{extra}\r\n").encode()


DECODE = "/v1/models/tiny-vae/decode?format=npy"


def status_of(reply: bytes) -> int:
    return int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else -1


def test_lying_and_broken_content_length(srv):
    body = npy(GOOD)
    # not a number: the HTTP parser refuses it before the app sees it (a plain 400, no problem body)
    assert status_of(raw(srv, head(DECODE, "abc"), body)) == 400
    # shorter than the body: the app reads what was declared (a cut .npy); the rest is not a request
    reply = raw(srv, head(DECODE, len(body) - 20), body)
    assert status_of(reply) == 400 and b"bad-npy" in reply
    # longer than the body, then the client leaves: nothing is answered, nothing counted as a 5xx
    s0 = scrape(srv.url)
    with socket.create_connection(("127.0.0.1", srv.port)) as sock:
        sock.sendall(head(DECODE, len(body) + 1000) + body)
        time.sleep(0.3)
    time.sleep(0.5)
    s1 = scrape(srv.url)
    fives = lambda s: sum(v for (n, lab), v in s.items() if n == "convserve_requests_total"  # noqa: E731
                          and dict(lab).get("status", "").startswith("5"))
    assert fives(s1) == fives(s0)
    assert metric_sum(s1, "convserve_requests_total", status=499) > metric_sum(s0, "convserve_requests_total", status=499)
    np.testing.assert_allclose(good_decode(srv), srv.good_out, atol=1e-6)


def test_oversized_headers(srv):
    reply = raw(srv, head(DECODE, 0, extra="X-Big: " + "a" * 200_000 + "\r\n"))
    assert 400 <= status_of(reply) < 500 or reply == b""  # refused (h11: 431/400) or the connection is cut
    np.testing.assert_allclose(good_decode(srv), srv.good_out, atol=1e-6)


def test_slow_loris_body_gets_408_and_others_are_served(srv):
    """Bodies trickling in a byte at a time are cut at the request timeout with 408 (the minimum
    body rate's grace outlasts this server's short timeout), while good
    requests on other connections are answered at once; idle half-sent headers block no one."""
    body = npy(GOOD)

    def trickle() -> tuple[int, bytes, float]:
        t0 = time.monotonic()
        with socket.create_connection(("127.0.0.1", srv.port), timeout=TIMEOUT_S + 10) as sock:
            sock.sendall(head(DECODE, len(body)))
            try:
                for i in range(len(body)):
                    sock.sendall(body[i:i + 1])
                    time.sleep(0.2)
                    if time.monotonic() - t0 > TIMEOUT_S + 5:
                        break
            except (BrokenPipeError, ConnectionResetError):
                pass  # the server answered and closed: read what it said
            reply = read_all(sock)
        return status_of(reply), reply, time.monotonic() - t0

    idle = []
    for _ in range(20):  # half-sent request lines, never finished
        sock = socket.create_connection(("127.0.0.1", srv.port))
        sock.sendall(b"POST /v1/models/tiny-vae/decode HTTP/1.1\r\nHost: x\r\n")
        idle.append(sock)
    try:
        with ThreadPoolExecutor(4) as pool:
            slow = [pool.submit(trickle) for _ in range(3)]
            time.sleep(0.5)
            t0 = time.monotonic()
            for _ in range(3):
                np.testing.assert_allclose(good_decode(srv), srv.good_out, atol=1e-6)
            fast = time.monotonic() - t0
            results = [f.result() for f in slow]
    finally:
        for sock in idle:
            sock.close()
    from service.frontend.http.http_protocol import LINGER_MAX_S
    for status, reply, secs in results:
        assert status == 408 and b"body-timeout" in reply, reply[:300]
        # the 408 at the timeout, then a lingering close (bounded) while the client still trickles
        assert TIMEOUT_S - 0.5 <= secs <= TIMEOUT_S + LINGER_MAX_S + 3, secs
    assert fast < TIMEOUT_S, f"good requests took {fast:.1f}s beside slow clients"
    print(f"RELIABILITY slow_loris bodies=3 status=408 idle_half_requests=20 good_requests_meanwhile=3 in {fast:.2f}s")


def test_slow_loris_headers_get_408_and_the_connection_closes(srv):
    """Headers trickling in a byte at a time, on a fresh connection and on a kept-alive one after
    a served request, and a connection that sends nothing: each is answered 408 header-timeout and
    closed at the header timeout. Headers that finish in time are served."""
    get = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n"

    def dribble(sock, t0) -> tuple[int, bytes, float]:
        try:
            for ch in b"X-Slow: " + b"a" * 200:
                sock.sendall(bytes([ch]))
                time.sleep(0.1)
                if time.monotonic() - t0 > HEADER_TIMEOUT_S + 5:
                    break
        except (BrokenPipeError, ConnectionResetError):
            pass
        reply = read_all(sock)
        return status_of(reply), reply, time.monotonic() - t0

    def fresh() -> tuple[int, bytes, float]:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=HEADER_TIMEOUT_S + 10) as sock:
            t0 = time.monotonic()
            sock.sendall(get)
            return dribble(sock, t0)

    def kept_alive() -> tuple[int, bytes, float]:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=HEADER_TIMEOUT_S + 10) as sock:
            sock.sendall(get + b"\r\n")
            first = b""
            while b"\r\n\r\n" not in first or not first.endswith(b"}"):
                first += sock.recv(65536)
            assert status_of(first) == 200, first
            t0 = time.monotonic()
            sock.sendall(get)
            return dribble(sock, t0)

    def silent() -> tuple[int, bytes, float]:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=HEADER_TIMEOUT_S + 10) as sock:
            t0 = time.monotonic()
            reply = read_all(sock)
            return status_of(reply), reply, time.monotonic() - t0

    def in_time() -> int:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=10) as sock:
            sock.sendall(get)
            time.sleep(HEADER_TIMEOUT_S / 2)
            sock.sendall(b"Connection: close\r\n\r\n")
            return status_of(read_all(sock))

    with ThreadPoolExecutor(4) as pool:
        slow = [pool.submit(f) for f in (fresh, kept_alive, silent)]
        ok = pool.submit(in_time)
        time.sleep(0.3)
        np.testing.assert_allclose(good_decode(srv), srv.good_out, atol=1e-6)
        results = [f.result() for f in slow]
        assert ok.result() == 200
    for status, reply, secs in results:
        assert status == 408 and b"header-timeout" in reply and b"application/problem+json" in reply, reply[:300]
        assert HEADER_TIMEOUT_S - 0.3 <= secs <= HEADER_TIMEOUT_S + 2, secs
    assert httpx.get(f"{srv.url}/readyz").status_code == 200
    print(f"RELIABILITY slow_loris headers: fresh, kept-alive and silent connections got 408 after "
          f"{', '.join(f'{r[2]:.2f}' for r in results)} s (header timeout {HEADER_TIMEOUT_S:g} s)")


def test_corpus_summary_memory_bounded(srv):
    """After everything above (file order): all corpus inputs answered 4xx, RSS bounded, healthy."""
    grown = (srv.rss_max - srv.rss0) / 1024
    statuses = {}
    for st in SEEN.values():
        statuses[st] = statuses.get(st, 0) + 1
    print(f"RELIABILITY corpus inputs={len(SEEN)} all_4xx={all(400 <= s < 500 for s in SEEN.values())} "
          f"statuses={dict(sorted(statuses.items()))} rss_growth_max_mib={grown:.1f}")
    assert len(SEEN) == len(MANIFEST) + 2, "run the whole file: the summary needs every corpus test"
    assert all(400 <= s < 500 for s in SEEN.values())
    assert grown < RSS_BUDGET_MIB, f"server RSS grew {grown:.0f} MiB over the corpus"
    assert httpx.get(f"{srv.url}/readyz").status_code == 200
    snap = scrape(srv.url)
    assert sum(v for (n, lab), v in snap.items() if n == "convserve_requests_total"
               and dict(lab).get("status", "").startswith("5")) == 0


def test_committed_corpus_matches_its_generator():
    """tests/corpus/files are what make_corpus.py writes (rebuild them after changing it)."""
    cases = make_corpus.cases()
    assert [c["name"] for c in cases] == [m["name"] for m in MANIFEST]
    for c, m in zip(cases, MANIFEST):
        # image and pickle bytes depend on the Pillow / zlib / Python that wrote them: not compared
        exact = not c["content_type"].startswith("image/") and "pickle" not in c["name"]
        if exact:
            assert (REPO / "tests" / "corpus" / m["file"]).read_bytes() == c["data"], c["name"]
        assert {k: v for k, v in c.items() if k != "data"} == {k: v for k, v in m.items() if k != "file"}, c["name"]
    assert sum((REPO / "tests" / "corpus" / m["file"]).stat().st_size for m in MANIFEST) < 1_000_000
