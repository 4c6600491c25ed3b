"""HTTP stack A/B on a real `convserve serve`: uvicorn's h11 parser vs httptools (both the service's
header-deadline subclasses, CONVSERVE_HTTP), on the asyncio and uvloop event loops, for
`GET /healthz` (the HTTP stack alone) and a small `POST /v1/models/tiny-convnext/encode`
(a 1x64x64x3 uint8 .npy body: parsing, the app and a model call).

The client is cheap on purpose: CLIENTS processes, each with CONNS kept-alive raw sockets (one
request in flight on each) sending a prebuilt request and reading responses by Content-Length, so
most of the machine goes to the server. Printed per run: requests/s, the server's CPU time per request (from /proc, all its
threads: the comparison that holds on a shared box), and the clients' CPU time beside the wall
time (well under CLIENTS x wall: the clients wait on the server, not the reverse).

    python benchmarks/service/http_stack.py [--seconds 5] [--clients 2] [--conns 8] [--rounds 2]
"""
from __future__ import annotations

import argparse
import io
import multiprocessing as mp
import os
import selectors
import socket
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
from server_process import ServerProcess  # noqa: E402

#: the CLI with uvicorn's loop="auto" (what `serve` passes) pointed at one loop
LAUNCHER = ("-c", "import sys, uvicorn.config as c; c.LOOP_FACTORIES['auto'] = c.LOOP_FACTORIES[sys.argv.pop(1)]; "
                  "from service.cli.main import app; app(prog_name='convserve')")
#: (http, loop); the first is the service's default where httptools and uvloop are installed
VARIANTS = [("httptools", "uvloop"), ("h11", "uvloop"), ("httptools", "asyncio"), ("h11", "asyncio")]


def requests() -> dict[str, bytes]:
    buf = io.BytesIO()
    np.save(buf, np.random.default_rng(0).integers(0, 256, (1, 64, 64, 3), dtype=np.uint8), allow_pickle=False)
    body = buf.getvalue()
    return {
        "GET /healthz": b"GET /healthz HTTP/1.1\r\nHost: bench\r\n\r\n",
        "POST encode 64x64 npy": (b"POST /v1/models/tiny-convnext/encode HTTP/1.1\r\nHost: bench\r\n"
                                  b"Content-Type: application/x-npy\r\nContent-Length: %d\r\n\r\n" % len(body)) + body,
    }


def take_response(buf: bytearray) -> int | None:
    """The status of the first whole response in `buf` (Content-Length framed), removed from it;
    None while it is incomplete."""
    end = buf.find(b"\r\n\r\n")
    if end < 0:
        return None
    head = bytes(buf[:end]).lower()
    i = head.find(b"content-length:")
    j = head.find(b"\r\n", i)
    total = end + 4 + (int(head[i + 15:j if j >= 0 else len(head)]) if i >= 0 else 0)
    if len(buf) < total:
        return None
    del buf[:total]
    return int(head[9:12])


def client(port: int, request: bytes, conns: int, start_at: float, stop_at: float, out) -> None:
    """`conns` kept-alive connections, each with one request in flight, served as they answer."""
    sel = selectors.DefaultSelector()
    for _ in range(conns):
        sock = socket.create_connection(("127.0.0.1", port))
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sel.register(sock, selectors.EVENT_READ, bytearray())
    while time.time() < start_at:
        time.sleep(0.001)
    cpu0, n, bad = time.process_time(), 0, 0
    for key in sel.get_map().values():
        key.fileobj.sendall(request)
    busy = conns
    while busy:
        for key, _ in sel.select(1.0):
            sock, buf = key.fileobj, key.data
            chunk = sock.recv(65536)
            if not chunk:
                raise ConnectionError("closed by the server")
            buf += chunk
            while (status := take_response(buf)) is not None:
                n += 1
                bad += status != 200
                if time.time() < stop_at:
                    sock.sendall(request)
                else:
                    busy -= 1
    out.put((n, bad, time.process_time() - cpu0))
    for key in list(sel.get_map().values()):
        key.fileobj.close()


def server_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all threads


def run(srv: ServerProcess, request: bytes, clients: int, conns: int, seconds: float) -> dict:
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    warm = time.time() + 1.5  # the children start (spawn) and one warm-up second passes first
    procs = [ctx.Process(target=client, args=(srv.port, request, conns, warm - 0.5, warm, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    [out.get() for _ in procs]
    [p.join() for p in procs]
    start = time.time() + 2.0  # all children spawned and connected
    procs = [ctx.Process(target=client, args=(srv.port, request, conns, start, start + seconds, out)) for _ in range(clients)]
    for p in procs:
        p.start()
    while time.time() < start:
        time.sleep(0.001)
    cpu0 = server_cpu_s(srv.proc.pid)
    results = [out.get() for _ in procs]
    cpu1 = server_cpu_s(srv.proc.pid)
    [p.join() for p in procs]
    n = sum(r[0] for r in results)
    return {"rps": n / seconds, "bad": sum(r[1] for r in results), "server_us": (cpu1 - cpu0) / n * 1e6,
            "client_cpu_s": sum(r[2] for r in results), "wall_s": seconds}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=5.0, help="measured time per run")
    ap.add_argument("--clients", type=int, default=2, help="client processes")
    ap.add_argument("--conns", type=int, default=8, help="kept-alive connections per client process")
    ap.add_argument("--rounds", type=int, default=2, help="every variant once per round, the order rotated")
    args = ap.parse_args()
    from benchmarks.machine import describe_machine

    reqs = requests()
    table: dict[tuple, list[dict]] = {}
    for rnd in range(args.rounds):
        order = VARIANTS[rnd % len(VARIANTS):] + VARIANTS[:rnd % len(VARIANTS)]
        for http, loop in order:
            with ServerProcess(launcher=LAUNCHER[:2] + (loop,), models="tiny-convnext", backend="numpy",
                               http=http, max_queue=256) as srv:
                for name, request in reqs.items():
                    r = run(srv, request, args.clients, args.conns, args.seconds)
                    table.setdefault((name, http, loop), []).append(r)
                    print(f"  round {rnd + 1} {http:9s} {loop:7s} {name:22s} {r['rps']:8.0f} req/s  server "
                          f"{r['server_us']:6.0f} us CPU/req  clients {r['client_cpu_s']:.2f} s CPU in "
                          f"{args.clients} x {r['wall_s']:g} s  non-200: {r['bad']}", flush=True)

    print(f"\nmachine: {describe_machine()}")
    print(f"{args.clients} client processes x {args.conns} kept-alive connections, {args.seconds:g} s a run, median of "
          f"{args.rounds} round(s); one server process (numpy backend)")
    print(f"{'request':22s} {'http':9s} {'loop':7s} {'req/s':>8s} {'us CPU/req':>10s} {'client CPU':>10s}")
    med = {k: {f: statistics.median(r[f] for r in v) for f in ("rps", "server_us", "client_cpu_s")}
           for k, v in table.items()}
    for (name, http, loop), m in med.items():
        print(f"{name:22s} {http:9s} {loop:7s} {m['rps']:8.0f} {m['server_us']:10.0f} "
              f"{m['client_cpu_s'] / (args.clients * args.seconds):9.0%}")
    ours = VARIANTS[0]
    print(f"\nours = {ours[0]} on {ours[1]} (CONVSERVE_HTTP=auto, uvicorn loop=auto); ratio = ours / alternative")
    for name in reqs:
        a = med[(name, *ours)]
        for alt in VARIANTS[1:]:
            b = med[(name, *alt)]
            print(f"{name:22s} vs {alt[0]:9s} {alt[1]:7s}: req/s x{a['rps'] / b['rps']:.2f}, "
                  f"server CPU/req x{a['server_us'] / b['server_us']:.2f}")


if __name__ == "__main__":
    main()
