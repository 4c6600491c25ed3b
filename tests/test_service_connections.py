"""What happens on the connection around a request, tested on raw sockets against a real server:
kept-alive connections reused after any idle time short of the keep-alive timeout are served
(no unsolicited 408, no close), a response sent before the body was read closes the connection
(a client trickling a rejected body cannot hold it open), and a full queue is answered 429
before the body is read. Every test runs under both of uvicorn's HTTP/1.1 parsers
(CONVSERVE_HTTP=h11 and httptools, service/frontend/http/http_protocol.py)."""
from __future__ import annotations

import asyncio
import select
import socket
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from live_server import HTTP_PROTOCOLS, from_npy, metric, npy, scrape

KEY = "conn-key"
AUTH = {"authorization": f"Bearer {KEY}"}
HEADER_TIMEOUT_S = 1.5
MAX_BODY = 4096
MAX_QUEUE = 2
WRITE_TIMEOUT_S = 1.0


@pytest.fixture(scope="module", params=HTTP_PROTOCOLS)
def http(request):
    return request.param


@pytest.fixture(scope="module")
def srv(server_factory, http):
    return server_factory(models="tiny-vae", api_key=KEY, header_timeout_s=HEADER_TIMEOUT_S, max_body_bytes=MAX_BODY,
                          http=http)


@pytest.fixture(scope="module")
def stall_srv(server_factory, http):
    return server_factory(models="tiny-vae", write_timeout_s=WRITE_TIMEOUT_S, http=http)


@pytest.fixture(scope="module")
def small_queue_srv(server_factory, http):
    # the held bodies' grace (5 s by default) past anything the test takes: on a loaded box the holders
    # were once dropped as slow bodies before the burst, their places freed, and a burst request admitted
    return server_factory(models="tiny-vae", api_key=KEY, max_body_bytes=MAX_BODY, max_queue=MAX_QUEUE, max_batch=1,
                          http=http, min_body_rate_grace_s=300)


def latents() -> bytes:
    return npy(np.random.default_rng().standard_normal((1, 4, 3, 5)).astype(np.float32))


def decode_request(body: bytes, *, auth: bool = True, length: int | None = None) -> bytes:
    head = (f"POST /v1/models/tiny-vae/decode?format=npy HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            f"Content-Type: application/x-npy\r\nContent-Length: {len(body) if length is None else length}\r\n")
    if auth:
        head += f"Authorization: Bearer {KEY}\r\n"
    return head.encode() + b"\r\n" + body


def read_response(sock: socket.socket) -> tuple[int, dict[str, str], bytes]:
    """One HTTP/1.1 response with a Content-Length body; (status, lower-case headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed before a response: {data[:200]!r}")
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    length = int(headers.get("content-length", 0))
    while len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed mid-body")
        rest += chunk
    return int(lines[0].split()[1]), headers, rest[:length]


def closed_by_server(sock: socket.socket, within_s: float) -> bool:
    """True when the server closes (EOF or reset) within `within_s`; unread data is drained."""
    deadline = time.monotonic() + within_s
    while (left := deadline - time.monotonic()) > 0:
        readable, _, _ = select.select([sock], [], [], left)
        if readable:
            try:
                if not sock.recv(65536):
                    return True
            except ConnectionResetError:
                return True
    return False


def test_kept_alive_connections_reused_after_idle_are_served(srv):
    """A connection reused after idling just under and just over the header timeout and httpx's
    5 s pool expiry (the old keep-alive timeout) gets its response: the server sends nothing
    while the connection idles (no unsolicited 408, no close) and serves the next request."""
    idles = [HEADER_TIMEOUT_S - 0.2, HEADER_TIMEOUT_S + 0.3, 4.95, 5.05, 5.5]

    def reuse_after(idle_s: float) -> tuple[float, list[int], bool, list[bytes]]:
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            body = latents()
            sock.sendall(decode_request(body))
            status, _, first = read_response(sock)
            # anything readable during the idle time is an unsolicited response or a close
            readable, _, _ = select.select([sock], [], [], idle_s)
            try:
                sock.sendall(decode_request(body))
                second_status, _, second = read_response(sock)
            except (ConnectionError, OSError) as exc:
                second_status, second = repr(exc), b""
            return idle_s, [status, second_status], bool(readable), [first, second]

    with ThreadPoolExecutor(len(idles)) as pool:
        results = list(pool.map(reuse_after, idles))
    for idle_s, statuses, spoke, outs in results:
        assert statuses == [200, 200] and not spoke, (idle_s, statuses, spoke, outs[1][:200])
        np.testing.assert_allclose(from_npy(outs[0]), from_npy(outs[1]), atol=1e-5)
    print(f"CONNECTIONS kept-alive reuse after {', '.join(f'{r[0]:g}' for r in results)} s idle: all 200, "
          f"nothing unsolicited (header timeout {HEADER_TIMEOUT_S:g} s, keep-alive default)")


def test_header_deadline_on_a_kept_alive_connection_starts_at_the_first_byte(srv):
    """Idle time before the next request does not count against its headers: after idling longer
    than the header timeout, the next request's headers trickle in; the 408 comes the header
    timeout after their first byte, not at once."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        time.sleep(HEADER_TIMEOUT_S + 0.5)
        t0 = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\n")
        status, headers, body = read_response(sock)
        secs = time.monotonic() - t0
    assert status == 408 and b"header-timeout" in body and headers.get("connection") == "close", (status, body)
    assert HEADER_TIMEOUT_S - 0.3 <= secs <= HEADER_TIMEOUT_S + 3, secs


def test_trickled_headers_are_cut_off_at_the_deadline(srv):
    """Slowloris: headers sent a byte at a time, each byte well inside the deadline, still get the
    408 the header timeout after the connection opened, and the connection closes."""
    request = b"GET /healthz HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 200
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        t0 = time.monotonic()
        for byte in request:
            sock.sendall(bytes([byte]))
            if closed_by_server(sock, 0.1) or time.monotonic() - t0 > HEADER_TIMEOUT_S + 3:
                break
        secs = time.monotonic() - t0
    assert HEADER_TIMEOUT_S - 0.3 <= secs <= HEADER_TIMEOUT_S + 3, secs


def test_a_next_request_begun_during_a_response_has_its_deadline(srv):
    """A complete request and the first bytes of the next one in one packet: the first is served,
    and the unfinished second gets its 408 the header timeout later (its clock started while the
    first was being answered), not never."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        t0 = time.monotonic()
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\nGET /healthz HTTP/1.1\r\nHo")
        assert read_response(sock)[0] == 200
        status, headers, body = read_response(sock)
        secs = time.monotonic() - t0
        assert closed_by_server(sock, 3)
    assert status == 408 and b"header-timeout" in body and headers.get("connection") == "close", (status, body)
    assert HEADER_TIMEOUT_S - 0.3 <= secs <= HEADER_TIMEOUT_S + 3, secs


def test_blank_lines_on_a_kept_alive_connection_do_not_hold_it(srv):
    """Bytes that begin no request (the blank lines HTTP lets precede one) stop the keep-alive
    timer like any byte; the header deadline still closes the connection."""
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n")
        assert read_response(sock)[0] == 200
        t0 = time.monotonic()
        closed = False
        while not closed and time.monotonic() - t0 < HEADER_TIMEOUT_S + 3:
            try:
                sock.sendall(b"\r\n")
            except (BrokenPipeError, ConnectionResetError):
                closed = True
                break
            closed = closed_by_server(sock, 0.2)
        secs = time.monotonic() - t0
    assert closed and secs <= HEADER_TIMEOUT_S + 3, secs


@pytest.mark.parametrize("case", ["413", "401", "404"])
def test_a_response_before_the_body_closes_the_connection(srv, case):
    """413 by Content-Length, 401 and 404 are answered before the body is read, with
    `Connection: close`, and the connection is closed: a client trickling the declared body
    is cut off instead of being read (and discarded) for as long as it keeps sending."""
    declared = MAX_BODY * 4
    if case == "413":
        head = decode_request(b"", length=declared)
    elif case == "401":
        head = decode_request(b"", auth=False, length=declared)
    else:
        head = (f"POST /v1/nowhere HTTP/1.1\r\nHost: x\r\nContent-Length: {declared}\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(head)
        status, headers, _ = read_response(sock)
        assert status == int(case) and headers.get("connection") == "close", (status, headers)
        cut_off = False
        for _ in range(100):  # trickle the body: the server must close long before it is all sent
            try:
                sock.sendall(b"x" * 16)
            except (BrokenPipeError, ConnectionResetError):
                cut_off = True
                break
            if closed_by_server(sock, 0.1):
                cut_off = True
                break
        assert cut_off, "the server kept reading a body it had already answered"
    assert httpx.get(f"{srv.url}/readyz", timeout=10).status_code == 200


def test_an_early_answer_reaches_clients_still_uploading(srv):
    """A 413 sent while the client still uploads is read by the client, not lost to a reset: the
    server shuts its side after the answer and drops the rest of the body for a bounded time
    before it closes (a plain close with unread bytes resets the connection, and async httpx
    then raised ReadError instead of returning the 413)."""
    body = b"\0" * (7 << 20)

    async def post_all():
        async with httpx.AsyncClient(timeout=30) as client:
            return await asyncio.gather(*[client.post(f"{srv.url}/v1/models/tiny-vae/decode", content=body,
                                                      headers={"content-type": "application/x-npy", **AUTH})
                                          for _ in range(8)], return_exceptions=True)

    results = asyncio.run(post_all())
    assert [getattr(r, "status_code", r) for r in results] == [413] * 8, results
    assert httpx.get(f"{srv.url}/readyz", timeout=10).status_code == 200


def test_a_lingering_close_ends_while_the_client_still_trickles(srv):
    """The linger after an early answer is bounded: a client that keeps trickling the body it
    was refused for is closed on within LINGER_MAX_S."""
    from service.frontend.http.http_protocol import LINGER_MAX_S

    with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
        sock.sendall(decode_request(b"", length=MAX_BODY * 1000))
        status, _, _ = read_response(sock)
        assert status == 413
        t0 = time.monotonic()
        with pytest.raises((BrokenPipeError, ConnectionResetError)):
            while time.monotonic() - t0 < LINGER_MAX_S + 10:
                sock.sendall(b"x" * 16)
                time.sleep(0.05)
        assert time.monotonic() - t0 < LINGER_MAX_S + 5


def test_a_client_that_never_reads_its_response_is_dropped(stall_srv):
    """A client that stops reading its responses loses its connection after
    CONVSERVE_WRITE_TIMEOUT_S without progress, and the response bytes queued for it go. Four
    pipelined 512x512 float32 .npy decodes (3 MB each) outgrow what the kernel's socket buffers
    take, so the server's own buffer fills and stays full."""
    srv = stall_srv
    s0 = metric(scrape(srv.url), "convserve_write_stalls_total")
    body = npy(np.zeros((1, 4, 64, 64), np.float32))
    request = (f"POST /v1/models/tiny-vae/decode?format=npy HTTP/1.1\r\nHost: x\r\n"
               f"Content-Type: application/x-npy\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a small window: little in flight
    sock.connect(("127.0.0.1", srv.port))
    try:
        sock.sendall(request * 4)  # then never read
        deadline = time.monotonic() + 120
        while metric(scrape(srv.url), "convserve_write_stalls_total") == s0:
            assert time.monotonic() < deadline, "the stalled responses were not dropped"
            time.sleep(0.1)
        got = 0
        sock.settimeout(30)
        try:
            while chunk := sock.recv(1 << 20):
                got += len(chunk)
        except ConnectionResetError:
            pass
        assert got < 4 * 512 * 512 * 3 * 4  # cut off before all four responses
    finally:
        sock.close()
    assert httpx.get(f"{srv.url}/readyz", timeout=10).status_code == 200


def test_full_queue_is_answered_429_before_the_body(small_queue_srv):
    """Admitted requests hold their queue places while their bodies arrive; with every place held,
    a request is answered 429 + Retry-After from its headers alone (its body is never sent, so a
    server that read bodies before admission could not answer). A burst then gets only 429s; the
    held requests, once their bodies come, are served."""
    srv = small_queue_srv
    holders = []
    try:
        for _ in range(MAX_QUEUE):  # headers only: admitted, now waiting for their bodies
            sock = socket.create_connection(("127.0.0.1", srv.port), timeout=30)
            body = latents()
            sock.sendall(decode_request(b"", length=len(body)))
            holders.append((sock, body))
        deadline = time.monotonic() + 30
        while metric(scrape(srv.url), "convserve_inflight_requests", model="tiny-vae") < MAX_QUEUE:
            assert time.monotonic() < deadline, "the holders were not admitted"
            time.sleep(0.05)
        with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as sock:
            sock.sendall(decode_request(b"", length=1000))  # its body never comes
            status, headers, body = read_response(sock)
        assert status == 429 and int(headers["retry-after"]) >= 1 and b"queue-full" in body, (status, body)
        assert headers.get("connection") == "close"

        body = latents()

        def burst_one(_) -> tuple[int, float]:
            t0 = time.perf_counter()
            r = client.post(f"{srv.url}/v1/models/tiny-vae/decode", content=body, params={"format": "npy"},
                            headers={"content-type": "application/x-npy", **AUTH})
            return r.status_code, time.perf_counter() - t0

        with httpx.Client(timeout=30) as client, ThreadPoolExecutor(16) as pool:
            burst = list(pool.map(burst_one, range(64)))
        assert {s for s, _ in burst} == {429}, burst
        lat_ms = np.sort([t * 1000 for _, t in burst])
        print(f"CONNECTIONS 64 requests against a full queue: all 429, latency p50 {np.percentile(lat_ms, 50):.1f} "
              f"ms p99 {np.percentile(lat_ms, 99):.1f} ms (client included, shared 2-core box)")
        for sock, body in holders:
            sock.sendall(body)
        for sock, _ in holders:
            status, _, out = read_response(sock)
            assert status == 200 and from_npy(out).shape[0] == 1, status
    finally:
        for sock, _ in holders:
            sock.close()


def test_http_setting_picks_the_protocol_class(monkeypatch):
    """CONVSERVE_HTTP: h11 and httptools name the header-deadline classes; auto is httptools where
    it imports (uvicorn's own "auto" rule), else h11; the header timeout lands on the class used."""
    from service.frontend.http import http_protocol as hp
    from service.settings import Settings

    monkeypatch.setenv("CONVSERVE_HTTP", "h11")
    assert hp.http_protocol_class(Settings().http) is hp.HeaderTimeoutH11Protocol
    for name in ("httptools", "auto"):
        cls = hp.http_protocol_class(name)
        assert cls is hp.HeaderTimeoutHttpToolsProtocol and issubclass(cls, hp.HttpToolsProtocol)
    monkeypatch.setattr(hp, "HeaderTimeoutHttpToolsProtocol", None)
    assert hp.http_protocol_class("auto") is hp.HeaderTimeoutH11Protocol
    with pytest.raises(ImportError):
        hp.http_protocol_class("httptools")
    with pytest.raises(ValueError):
        hp.http_protocol_class("zttp")
    monkeypatch.setenv("CONVSERVE_HTTP", "nope")
    with pytest.raises(ValueError):
        Settings()
