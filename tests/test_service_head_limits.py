"""A request's head is bounded under both of uvicorn's HTTP/1.1 parsers (service/frontend/http/http_heads.py),
on raw sockets against a real server: too many header fields, one huge header line, and a huge
header line that never ends each get 431 problem+json at once and the connection closes, while
/healthz on other connections answers at once and the server's memory stays put. Before, httptools
(the default parser) served 100,000 headers and a 16 MB header line with 200, and buffered
unterminated lines until its loop stalled; h11 had no limit on fields and answered 400 past 16 KiB."""
from __future__ import annotations

import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from live_server import HTTP_PROTOCOLS, metric, scrape

MAX_HEADER_BYTES = 64 * 1024  # the defaults
MAX_HEADERS = 100
#: an answer past a limit comes this soon; the header timeout (10 s) would be far later
PROMPT_S = 5.0
GET = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"


@pytest.fixture(scope="module", params=HTTP_PROTOCOLS)
def srv(server_factory, request):
    return server_factory(models="tiny-vae", http=request.param)


def send_and_answer(port: int, head: bytes, then: bytes = b"", repeat: int = 0,
                    keep_sending: bool = False) -> tuple[bytes, float, bool]:
    """Send `head`, then `then` up to `repeat` times (until the server answers, or with
    keep_sending, on regardless, as an attacker would); return the answer, the seconds until it
    could be read, and whether the server closed the connection after it."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        t0 = time.monotonic()
        answered_at = None
        try:
            sock.sendall(head)
            for _ in range(repeat):
                if answered_at is None and select.select([sock], [], [], 0)[0]:
                    answered_at = time.monotonic()
                    if not keep_sending:
                        break
                if time.monotonic() - t0 > 20:
                    break
                sock.sendall(then)
        except OSError:  # the server closed (after its lingering close), or stopped reading
            pass
        answer = b""
        closed = False
        while time.monotonic() - t0 < 40:
            if answered_at is None and select.select([sock], [], [], 30)[0]:
                answered_at = time.monotonic()
            try:
                chunk = sock.recv(65536)
            except OSError:
                closed = True
                break
            if not chunk:
                closed = True
                break
            answer += chunk
            if b"\r\n\r\n" in answer and answer.rstrip().endswith(b"}"):
                try:
                    closed = bool(select.select([sock], [], [], 10)[0]) and sock.recv(1) == b""
                except OSError:
                    closed = True
                break
        return answer, (answered_at or time.monotonic()) - t0, closed


def assert_431(answer: bytes, secs: float, closed: bool, names: str) -> None:
    assert answer.startswith(b"HTTP/1.1 431 "), answer[:300]
    assert b"application/problem+json" in answer and b"headers-too-large" in answer and names.encode() in answer
    assert b"connection: close" in answer.lower() and closed, "the connection stayed open"
    assert secs < PROMPT_S, f"answered after {secs:.1f}s"


def test_too_many_header_fields_get_431(srv):
    """1000 short fields, 12 kB in all: under the byte limit, over the count."""
    s0 = scrape(srv.url)
    head = GET + b"".join(b"X-F%d: v\r\n" % i for i in range(1000)) + b"\r\n"
    assert len(head) < MAX_HEADER_BYTES
    assert_431(*send_and_answer(srv.port, head), "CONVSERVE_MAX_HEADERS")
    # at the limit (Host, 98 more and Connection) is served
    head = GET + b"".join(b"X-F%d: v\r\n" % i for i in range(MAX_HEADERS - 2)) + b"Connection: close\r\n\r\n"
    answer, _, _ = send_and_answer(srv.port, head)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]
    assert metric(scrape(srv.url), "convserve_rejected_total", model="", reason="headers_too_large") == \
        metric(s0, "convserve_rejected_total", model="", reason="headers_too_large") + 1


def test_one_huge_header_line_gets_431(srv):
    """A 16 MB header line, complete: refused after the first 64 KiB, not parsed to its end."""
    head = GET + b"X-Big: " + b"a" * (16 << 20) + b"\r\n\r\n"
    assert_431(*send_and_answer(srv.port, head), "CONVSERVE_MAX_HEADER_BYTES")
    # a head just under the limit is served
    head = GET + b"Connection: close\r\nX-Big: " + b"a" * (MAX_HEADER_BYTES - 200) + b"\r\n\r\n"
    answer, _, _ = send_and_answer(srv.port, head)
    assert answer.startswith(b"HTTP/1.1 200 "), answer[:300]


def rss_kib(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))


def test_unterminated_huge_header_lines_are_cut_and_healthz_answers(srv):
    """8 connections each sending a header line that never ends, 60 MB each whatever the server
    says: each gets its 431 at once, /healthz on other connections keeps answering within a second, and the server's
    memory does not grow by what the lines would have buffered."""
    rss0 = peak = rss_kib(srv.proc.pid)
    done = threading.Event()
    healthz: list[tuple[int, float]] = []

    def watch() -> None:
        nonlocal peak
        with httpx.Client(timeout=30) as client:
            while not done.is_set():
                t0 = time.monotonic()
                healthz.append((client.get(f"{srv.url}/healthz").status_code, time.monotonic() - t0))
                peak = max(peak, rss_kib(srv.proc.pid))
                time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        while not healthz and watcher.is_alive():  # the watcher is answered before the attack begins
            time.sleep(0.01)
        n0 = len(healthz)
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda _: send_and_answer(srv.port, GET + b"X-Endless: ", b"a" * 65536, 60 * 16,
                                                              keep_sending=True), range(8)))
        while len(healthz) < n0 + 3 and watcher.is_alive():  # and after it
            time.sleep(0.01)
    finally:
        done.set()
        watcher.join()
    for answer, secs, closed in results:
        assert_431(answer, secs, closed, "CONVSERVE_MAX_HEADER_BYTES")
    assert healthz and {status for status, _ in healthz} == {200}, healthz
    slowest = max(secs for _, secs in healthz)
    assert slowest < 1.0, f"/healthz took up to {slowest:.2f}s"
    grown_mib = (peak - rss0) / 1024
    assert grown_mib < 64, f"server memory grew {grown_mib:.0f} MiB"
    print(f"HEADS 8 unterminated header lines: 431 after {max(r[1] for r in results):.2f}s at most; /healthz "
          f"{len(healthz)} answers, slowest {slowest * 1000:.0f} ms; server RSS +{grown_mib:.1f} MiB")
