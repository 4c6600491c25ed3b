"""Fast uploads are never "too slow" because the server was busy (service/frontend/http/body_wait.py): the
minimum body rate and the body timeout run only while the server waits with none of the
client's bytes at hand, and a full queue evicts only uploads slow on that clock.

A real server on localhost, its front end made as busy as it gets: stopped (SIGSTOP) for a few
seconds while 16 admitted 6 MiB uploads are mid-body and 32 more arrive, all sending as fast as
the server reads. Before, the wall-time rule answered the admitted ones 408 `body-too-slow` once
the server ran again (their clock ran while it was stopped), and the newcomers took their queue
places by evicting them as "slow"; a probe of 200 such uploads to a loaded front end got 189 408s.
Now every answer is 200, or 429/503 with Retry-After."""
from __future__ import annotations

import os
import signal
import socket
import threading
import time

import numpy as np

from live_server import metric, npy, scrape, wait_for

MIB = 1 << 20
EARLY, LATE = 16, 32
STOP_S = 3.0  # the front end stopped this long: past every upload's allowance at 1 MiB/s after 0.5 s
FIRST = 1 * MIB  # what the admitted uploads send before the server stops


def read_answer(sock: socket.socket) -> tuple[int | str, dict[str, str], bytes]:
    data = b""
    try:
        while b"\r\n\r\n" not in data:
            chunk = sock.recv(65536)
            if not chunk:
                return f"closed after {data[:100]!r}", {}, b""
            data += chunk
        head, _, rest = data.partition(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        while len(rest) < int(headers.get("content-length", 0)):
            chunk = sock.recv(65536)
            if not chunk:
                break
            rest += chunk
        return int(lines[0].split()[1]), headers, rest
    except OSError as exc:
        return repr(exc), {}, b""


def upload(port: int, request: bytes, first: int, go: threading.Event | None, sent_first: threading.Event,
           out: list) -> None:
    """One client sending as fast as the server reads: `first` bytes, then (after `go`) the rest."""
    with socket.create_connection(("127.0.0.1", port), timeout=120) as sock:
        try:
            sock.sendall(request[:first])
            sent_first.set()
            if go is not None:
                go.wait(60)
            sock.sendall(request[first:])
        except OSError:  # answered early (429) and closed: read the answer
            sent_first.set()
        out.append(read_answer(sock))


def test_fast_uploads_to_a_stopped_front_end_get_no_408(server_factory):
    srv = server_factory(models="tiny-convnext", min_body_rate=MIB, min_body_rate_grace_s=0.5, max_queue=EARLY,
                         memory_budget_bytes=1 << 30)
    body = npy(np.random.default_rng(0).integers(0, 256, (1, 1448, 1448, 3), dtype=np.uint8))  # 6.0 MiB
    head = (f"POST /v1/models/tiny-convnext/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-npy\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
    request = head + body
    go = threading.Event()
    answers: list = []
    threads, sent = [], []

    def start(n: int, first: int, gate: threading.Event | None) -> None:
        for _ in range(n):
            sent.append(threading.Event())
            threads.append(threading.Thread(target=upload, args=(srv.port, request, first, gate, sent[-1], answers)))
            threads[-1].start()

    start(EARLY, len(head) + FIRST, go)
    # every admitted upload is inside its body read: its declared length is taken from the memory
    # budget as the read begins
    wait_for(lambda: all(e.is_set() for e in sent) and
             metric(scrape(srv.url), "convserve_memory_budget_used_bytes") >= EARLY * len(body),
             timeout=60, what="the admitted uploads reading their bodies")
    os.kill(srv.proc.pid, signal.SIGSTOP)
    try:
        go.set()  # the admitted uploads send the rest, the newcomers all of theirs, into the kernel's buffers
        start(LATE, len(request), None)
        time.sleep(STOP_S)
    finally:
        os.kill(srv.proc.pid, signal.SIGCONT)
    for t in threads:
        t.join(120)
    statuses = [a[0] for a in answers]
    assert len(statuses) == EARLY + LATE
    assert set(statuses) <= {200, 429, 503}, (sorted(map(str, statuses)), [a[2][:200] for a in answers if a[0] == 408][:3])
    assert all(int(h["retry-after"]) >= 1 for s, h, _ in answers if s in (429, 503))
    assert statuses.count(200) >= 1
    print(f"PACING {EARLY} admitted + {LATE} newcomer 6 MiB uploads, front end stopped {STOP_S:g}s mid-body: "
          f"{ {s: statuses.count(s) for s in sorted(set(statuses))} }")
