"""The exhaustion probe, run by hand against a real `convserve serve` on the CPU
default: each check prints one line with what it measured and the bound it is held to.

  python benchmarks/service/hostile_probe.py            # every check (~4 minutes on 2 cores)
  python benchmarks/service/hostile_probe.py rss slow   # some of them

Checks: `kinds` (each request kind alone at its largest default size: peak server memory),
`rss` (64 concurrent 48 MiB uint8 .npy encodes: peak and residual memory of the whole
server, PSS over its processes), `abandon` (large decodes whose clients give up, then a small
request), `stall` (a client that never reads its responses), `slow` (70 uploads trickling a byte
every 2 s beside normal traffic), `early` (async httpx uploading 7.7 MB bodies that are refused
before they are read), `models` (a mistyped --models entry), `npy` (a 128-byte .npy declaring
an impossible shape, and one declaring 149 GiB in 64 bytes, on every route that reads .npy: status,
time and peak server memory), `heads` (100,000 headers, a 16 MB header line, 24 connections
sending 60 MB header lines that never end: answers, /healthz latency and server memory
meanwhile; under httptools, the default, and h11), `uploads` (200 concurrent 7.7 MB uploads sent
as fast as the server reads, to the one front end: status codes, no 408), `hang` (the model
worker stopped 20 s and 85 s under traffic, then past a 30 s hang limit) and `frontkill` (a front
end killed with SIGKILL three times), both in benchmarks/service/process_faults.py. Every check counts 5xx
answers.
"""
from __future__ import annotations

import asyncio
import io
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import numpy as np

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[2])]  # this group; the repo
from benchmarks.machine import describe_machine  # noqa: E402
from server_process import REPO, ServerProcess  # noqa: E402
from process_faults import check_frontend_kill, check_hang  # noqa: E402

NPY = {"content-type": "application/x-npy"}
GIB = 1 << 30
five_xx = 0


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a)
    return buf.getvalue()


def tree(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        for task in Path(f"/proc/{p}/task").iterdir():
            try:
                todo += [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                pass
    return out


def pss_bytes(pid: int) -> int:
    """Proportional set size of the process and its descendants (shared pages split fairly)."""
    total = 0
    for p in tree(pid):
        try:
            for line in Path(f"/proc/{p}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def count(statuses) -> dict:
    global five_xx
    out: dict = {}
    for s in statuses:
        out[s] = out.get(s, 0) + 1
        if isinstance(s, int) and s >= 500 and s not in (503,):
            five_xx += 1
    return dict(sorted(out.items(), key=str))


def post(url: str, body: bytes, timeout: float = 120) -> int | str:
    try:
        return httpx.post(url, content=body, headers=NPY, timeout=timeout).status_code
    except httpx.TimeoutException:
        return "client-timeout"
    except httpx.HTTPError as exc:
        return type(exc).__name__


def _samples(srv: ServerProcess, name: str) -> list[tuple[tuple[str, dict], float]]:
    return [((n, dict(labels)), v) for (n, labels), v in srv.metrics().items() if n == name]


def _sample(srv: ServerProcess, name: str) -> float:
    return sum(v for _, v in _samples(srv, name))


class PeakMemory:
    """The server's PSS before a block and its peak during it, sampled on a thread."""

    def __init__(self, srv: ServerProcess, every_s: float = 0.02):
        self.pid, self.every_s = srv.proc.pid, every_s

    def __enter__(self):
        self.base = self.peak = pss_bytes(self.pid)
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()
        return self

    def _sample(self):
        while not self._done.is_set():
            self.peak = max(self.peak, pss_bytes(self.pid))
            time.sleep(self.every_s)

    def __exit__(self, *exc):
        self._done.set()
        self._thread.join()

    @property
    def growth(self) -> int:
        return self.peak - self.base


def check_rss(srv: ServerProcess) -> None:
    body = npy(np.zeros((1, 4096, 4096, 3), np.uint8))  # 48 MiB
    with PeakMemory(srv, 0.05) as mem:
        t0 = time.monotonic()
        with ThreadPoolExecutor(64) as pool:
            statuses = list(pool.map(lambda _: post(f"{srv.url}/v1/models/tiny-convnext/encode", body), range(64)))
        secs = time.monotonic() - t0
        time.sleep(3)
    after = pss_bytes(srv.proc.pid)
    print(f"rss: 64 concurrent 48 MiB encodes in {secs:.1f}s: {count(statuses)}; server PSS {mem.base / GIB:.2f} GiB "
          f"before, peak +{mem.growth / GIB:.2f} GiB (bound 2), +{(after - mem.base) / GIB:.2f} GiB 3 s after")


def _png(h: int, w: int) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, "PNG", compress_level=1)
    return buf.getvalue()


def check_kinds(srv: ServerProcess) -> None:
    """Each request kind alone at its largest default size: the peak growth of the server's memory."""
    lat = npy(np.random.default_rng(0).standard_normal((1, 4, 128, 128)).astype(np.float32))  # 1024^2 out: the CPU cap
    kinds = [
        ("image decode 1024^2 -> PNG", "/v1/models/tiny-vae/decode?format=png", lat, NPY),
        ("image decode 1024^2 -> float32 .npy (12 MiB)", "/v1/models/tiny-vae/decode?format=npy", lat, NPY),
        ("encode 4096^2 uint8 .npy (48 MiB)", "/v1/models/tiny-convnext/encode",
         npy(np.zeros((1, 4096, 4096, 3), np.uint8)), NPY),
        ("encode 4096^2 noise PNG", "/v1/models/tiny-convnext/encode", _png(4096, 4096), {"content-type": "image/png"}),
        ("remote-VAE encode 1024^2 PNG", "/v1/models/tiny-vae/vae/encode", _png(1024, 1024),
         {"content-type": "image/png"}),
        ("video stream 17 frames 512^2 -> .npy", "/v1/models/tiny-wan-vae/decode/stream?format=npy",
         npy(np.random.default_rng(0).standard_normal((1, 4, 5, 64, 64)).astype(np.float32)), NPY),
    ]
    for name, path, body, headers in kinds:
        with PeakMemory(srv) as mem:
            try:
                status = httpx.post(f"{srv.url}{path}", content=body, headers=headers, timeout=300).status_code
            except httpx.HTTPError as exc:
                status = type(exc).__name__
        count([status])
        print(f"kinds: {name}: {status}, body {len(body) / 2**20:.1f} MiB, peak server memory +{mem.growth / 2**20:.0f} MiB")


def check_abandon(srv: ServerProcess) -> None:
    big = npy(np.zeros((1, 4, 128, 128), np.float32))  # 1024x1024 out: at the CPU cap
    huge = npy(np.zeros((1, 4, 512, 512), np.float32))  # 4096x4096 out: past it
    t0 = time.monotonic()
    refused = post(f"{srv.url}/v1/models/tiny-vae/decode?format=npy", huge)
    refused_s = time.monotonic() - t0
    with ThreadPoolExecutor(8) as pool:
        gave_up = list(pool.map(lambda _: post(f"{srv.url}/v1/models/tiny-vae/decode?format=npy", big, timeout=3),
                                range(8)))
    t0 = time.monotonic()
    small = post(f"{srv.url}/v1/models/tiny-vae/decode?format=npy", npy(np.zeros((1, 4, 8, 8), np.float32)))
    print(f"abandon: 4096^2 decode answered {refused} in {refused_s:.2f}s; 8 decodes of 1024^2 abandoned by their "
          f"clients at 3 s: {count(gave_up)}; then a small decode: {small} in {time.monotonic() - t0:.1f}s (bound ~15)")


def check_stall(srv: ServerProcess) -> None:
    body = npy(np.zeros((1, 4, 64, 64), np.float32))
    req = (f"POST /v1/models/tiny-vae/decode?format=npy HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-npy\r\n"
           f"Content-Length: {len(body)}\r\n\r\n").encode() + body
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", srv.port))
    t0 = time.monotonic()
    sock.sendall(req * 4)
    while _sample(srv, "convserve_write_stalls_total") < 1 and time.monotonic() - t0 < 300:
        time.sleep(0.5)
    sock.close()
    print(f"stall: a client that never reads 4 pipelined 3 MB responses was dropped after "
          f"{time.monotonic() - t0:.0f}s (bound 75)")


def check_slow(srv: ServerProcess) -> None:
    body = npy(np.zeros((1, 4, 8, 8), np.float32))
    head = (f"POST /v1/models/tiny-vae/decode?format=npy HTTP/1.1\r\nHost: x\r\nContent-Type: application/x-npy\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    stop = threading.Event()

    def trickler():
        while not stop.is_set():
            try:
                with socket.create_connection(("127.0.0.1", srv.port), timeout=30) as s:
                    s.sendall(head)
                    for i in range(len(body)):
                        if stop.wait(2):
                            return
                        s.sendall(body[i:i + 1])
            except OSError:
                pass  # answered 408 and closed: come back, as an attacker would

    threads = [threading.Thread(target=trickler, daemon=True) for _ in range(70)]
    for t in threads:
        t.start()
    time.sleep(8)  # every trickler admitted or refused once
    statuses = []
    t0 = time.monotonic()
    with ThreadPoolExecutor(4) as pool:
        while time.monotonic() - t0 < 30:
            statuses += list(pool.map(lambda _: post(f"{srv.url}/v1/models/tiny-vae/decode?format=npy", body, 30),
                                      range(4)))
    stop.set()
    ok = sum(s == 200 for s in statuses)
    print(f"slow: 70 uploads trickling 1 byte / 2 s; normal requests over 30 s: {count(statuses)}: "
          f"{100 * ok / max(1, len(statuses)):.0f}% served (bound 80%)")


def check_early() -> None:
    srv = ServerProcess(models="tiny-vae", max_body_bytes=1 << 20)
    try:
        body = b"\0" * int(7.7e6)

        async def run():
            async with httpx.AsyncClient(timeout=60) as client:
                async def one():
                    try:
                        return (await client.post(f"{srv.url}/v1/models/tiny-vae/decode", content=body,
                                                  headers=NPY)).status_code
                    except httpx.HTTPError as exc:
                        return type(exc).__name__
                return await asyncio.gather(*[one() for _ in range(136)])

        print(f"early: 136 async httpx uploads of 7.7 MB refused by Content-Length: {count(asyncio.run(run()))} "
              "(bound: no ReadError)")
    finally:
        srv.stop()


def check_models() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    for entry in ("sd=sd-vea", "sd=sd-vae:./nonexistent", "sd=sd-vea:foo/bar"):
        p = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--models", entry, "--port", "0"], cwd=REPO,
                           env=env, capture_output=True, text=True, timeout=120)
        lines = [line for line in p.stderr.splitlines() if line.strip()]
        print(f"models: --models {entry}: exit {p.returncode}, {len(lines)} line(s): {lines[-1] if lines else ''}")


def check_npy(srv: ServerProcess) -> None:
    """.npy headers declaring what no body holds: answered 400 bad-npy from the header alone, with
    no allocation of the declared size (np.load allocated it first: 149 GiB for the second)."""
    def with_header(header: str, data: bytes = b"") -> bytes:
        h = header.encode()
        h += b" " * (63 - (10 + len(h)) % 64) + b"\n"
        return b"\x93NUMPY\x01\x00" + len(h).to_bytes(2, "little") + h + data

    bodies = {"overflow": with_header("{'descr': '<f4', 'fortran_order': False, "
                                      "'shape': (4294967296, 4294967296, 1, 0), }"),
              "149 GiB": with_header("{'descr': '<f4', 'fortran_order': True, 'shape': (4, 100000, 100000), }",
                                     b"\0" * 64)}
    routes = ["/v1/models/tiny-vae/decode", "/v1/models/tiny-wan-vae/decode/stream", "/v1/models/tiny-convnext/encode",
              "/v1/models/tiny-vae/vae/encode"]
    for name, body in bodies.items():
        with PeakMemory(srv) as mem:
            t0 = time.monotonic()
            answers = [httpx.post(f"{srv.url}{path}", content=body, headers=NPY, timeout=60) for path in routes]
            secs = time.monotonic() - t0
        statuses = count([r.status_code for r in answers])
        kinds = sorted({r.json().get("type", "").rsplit("#", 1)[-1].rsplit("/", 1)[-1] for r in answers})
        print(f"npy: {len(body)}-byte .npy ({name}) on {len(routes)} routes: {statuses} "
              f"{kinds}, {1000 * secs / len(routes):.1f} ms each, peak server memory +{mem.growth / 2**20:.0f} MiB "
              f"(bound: 400 bad-npy, < 1 s, no growth)")


def _raw_head(port: int, head: bytes, then: bytes = b"", repeat: int = 0) -> tuple[int | str, float]:
    """Send a request head (and `then` `repeat` times, whatever the server says, as an attacker
    would); its status and the seconds until it could be read."""
    import select
    with socket.create_connection(("127.0.0.1", port), timeout=120) as s:
        t0 = time.monotonic()
        answered = None
        try:
            s.sendall(head)
            for _ in range(repeat):
                if answered is None and select.select([s], [], [], 0)[0]:
                    answered = time.monotonic() - t0
                s.sendall(then)
        except OSError:
            pass
        try:
            data = s.recv(4096)
        except OSError as exc:
            return type(exc).__name__, time.monotonic() - t0
        status = int(data.split(b" ", 2)[1]) if data.startswith(b"HTTP/1.1 ") else (data[:40] or "closed")
        return status, answered if answered is not None else time.monotonic() - t0


def check_heads(srv: ServerProcess, parser: str) -> None:
    get = b"GET /healthz HTTP/1.1\r\nHost: x\r\n"
    many = get + b"".join(b"X-H%d: v\r\n" % i for i in range(100_000)) + b"\r\n"
    status, secs = _raw_head(srv.port, many)
    count([status])
    print(f"heads[{parser}]: 100,000 headers ({len(many) / 1e6:.1f} MB): {status} in {secs:.2f}s (bound: 431 at once)")
    status, secs = _raw_head(srv.port, get + b"X-Big: " + b"a" * (16 << 20) + b"\r\n\r\n")
    count([status])
    print(f"heads[{parser}]: one 16 MB header line: {status} in {secs:.2f}s (bound: 431 at once)")
    stop = threading.Event()
    lat: list[float] = []

    def watch():
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                httpx.get(f"{srv.url}/healthz", timeout=60)
            except httpx.HTTPError:
                pass
            lat.append(time.monotonic() - t0)
            time.sleep(0.05)

    watcher = threading.Thread(target=watch, daemon=True)
    with PeakMemory(srv) as mem:
        watcher.start()
        t0 = time.monotonic()
        with ThreadPoolExecutor(24) as pool:
            results = list(pool.map(lambda _: _raw_head(srv.port, get + b"X-Endless: ", b"a" * 65536, 60 * 16),
                                    range(24)))
        secs = time.monotonic() - t0
        stop.set()
        watcher.join()
    time.sleep(1)
    after = pss_bytes(srv.proc.pid)
    print(f"heads[{parser}]: 24 connections x 60 MB unterminated header lines, {secs:.1f}s: "
          f"{count([s for s, _ in results])}, answered within {max(t for _, t in results):.2f}s; /healthz "
          f"max {max(lat) * 1000:.0f} ms over {len(lat)} calls (bound 1 s); server PSS peak "
          f"+{mem.growth / 2**20:.0f} MiB, +{(after - mem.base) / 2**20:.0f} MiB 1 s after")


def check_uploads(srv: ServerProcess) -> None:
    body = npy(np.random.default_rng(0).integers(0, 256, (1, 1602, 1602, 3), dtype=np.uint8))  # 7.7 MB
    t0 = time.monotonic()

    def one(_):
        try:
            r = httpx.post(f"{srv.url}/v1/models/tiny-convnext/encode", content=body, headers=NPY, timeout=300)
        except httpx.HTTPError as exc:
            return type(exc).__name__, False
        return r.status_code, r.status_code in (429, 503) and "retry-after" in r.headers

    with ThreadPoolExecutor(200) as pool:
        results = list(pool.map(one, range(200)))
    statuses = [s for s, _ in results]
    shed = sum(1 for s in statuses if s in (429, 503))
    print(f"uploads: 200 concurrent {len(body) / 1e6:.1f} MB encode uploads to one front end in "
          f"{time.monotonic() - t0:.1f}s: {count(statuses)}; Retry-After on {sum(r for _, r in results)}/{shed} "
          f"429/503 (bound: no 408)")


def main() -> None:
    which = set(sys.argv[1:]) or {"kinds", "rss", "abandon", "stall", "slow", "early", "models", "npy", "heads",
                                  "uploads", "hang", "frontkill"}
    print(f"hostile probe on {describe_machine()}")
    if which & {"kinds", "rss", "abandon", "stall", "slow", "npy", "heads", "uploads"}:
        srv = ServerProcess()  # the CPU default: every setting at its default
        try:
            for name, check in (("kinds", check_kinds), ("rss", check_rss), ("abandon", check_abandon), ("stall", check_stall),
                                ("slow", check_slow), ("npy", check_npy),
                                ("heads", lambda s: check_heads(s, "httptools")), ("uploads", check_uploads)):
                if name in which:
                    check(srv)
            codes: dict = {}
            for (_, lab), v in _samples(srv, "convserve_requests_total"):
                if lab.get("status", "").startswith("5") and lab["status"] != "503":
                    codes[lab["status"]] = codes.get(lab["status"], 0) + v
            print(f"server: 5xx answers (503 excepted) by its own count: {codes or 0}; alive: "
                  f"{httpx.get(srv.url + '/readyz').status_code == 200}")
        finally:
            srv.stop()
    if "heads" in which:
        with ServerProcess(http="h11") as h11_srv:
            check_heads(h11_srv, "h11")
    if "early" in which:
        check_early()
    if "models" in which:
        check_models()
    if "hang" in which:
        check_hang()
    if "frontkill" in which:
        check_frontend_kill()
    print(f"client-side 5xx (503 excepted): {five_xx}")


if __name__ == "__main__":
    main()
