"""Throughput through the HTTP service vs the raw model, same machine, same run (the service split's target: the
service delivers >= 0.9 of the raw model's throughput in every format, on every GPU of a host).

raw: the model's own call (`decode` / `encode`) in a child process on batches of --batch rows
(inputs from host memory, outputs back to host memory, float32 as the model returns them), the
best of --reps timed calls after a warm-up, run before and after the service run (a shared
machine's load moves between them; the ratio uses their mean). With several devices the raw
figure is one device's: the service row says how many it used.
service: a real `convserve serve` (its model worker per device, --workers front ends) under a
closed loop of --concurrency clients spread over --client-procs processes, each sending one item
at a time: decode: 1xCxhxw float32 .npy latents answered in --format (png, jpeg, webp, npy);
encode: one --size image as uint8 .npy, PNG or JPEG (--format). Prints requests/s answered 200,
latency p50/p99, the mean batch the server ran, rows per device, service/raw, and the clients'
CPU use (seconds of CPU per second of wall time, summed over the client processes, and the
busiest one's share of a core), so a client-bound run shows itself.

    python benchmarks/service/service_throughput.py                                   # CPU: tiny-convnext encode
    python benchmarks/service/service_throughput.py --workload decode --preset tiny-vae --latent 16 --format png
    python benchmarks/service/service_throughput.py --workload decode --backend cuda --preset sd-vae --latent 64 \\
        --format png --batch 8 --concurrency 64 --client-procs 8 --requests 4096 --devices 0,1
"""
from __future__ import annotations

import argparse
import io
import multiprocessing
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
import pyspy_profile  # noqa: E402
from server_process import ServerProcess  # noqa: E402

MEDIA = {"npy": "application/x-npy", "png": "image/png", "jpeg": "image/jpeg"}
#: a client process busier than this share of a core is taken as the run's limit (flagged)
CLIENT_BOUND = 0.9


def raw_items_per_s(workload: str, backend: str, preset: str, size: int, latent: int, batch: int, reps: int) -> float:
    from convkernels import get_backend
    from models import load_model

    model = load_model("m", preset, get_backend(backend))
    rng = np.random.default_rng(0)
    if workload == "decode":
        x = rng.standard_normal((batch, model.latent_channels, latent, latent), dtype=np.float32)
        call = model.decode
    else:
        x = rng.random((batch, size, size, 3), dtype=np.float32)
        call = model.encode
    for _ in range(3):  # path choice / plans, then graph capture where enabled
        call(x)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        call(x)
        best = min(best, time.perf_counter() - t0)
    return batch / best


def bodies(args, fmt: str) -> tuple[list[bytes], str, dict]:
    """Request bodies, their content type, and the query parameters, for one format."""
    rng = np.random.default_rng(1)
    out = []
    distinct = min(args.requests, 64)  # the bodies repeat: making 4096 PNGs would time the client
    for _ in range(distinct):
        buf = io.BytesIO()
        if args.workload == "decode":
            np.save(buf, rng.standard_normal((1, args.channels, args.latent, args.latent), dtype=np.float32))
        else:
            imgs = [photo_like(rng, args.size) for _ in range(args.per_request)]
            if fmt == "npy":
                np.save(buf, np.stack(imgs) if args.per_request > 1 else imgs[0], allow_pickle=False)
            elif args.per_request == 1:
                Image.fromarray(imgs[0]).save(buf, format="PNG" if fmt == "png" else "JPEG", quality=90)
            else:  # several images: multipart, one file part each
                files = []
                for i, img in enumerate(imgs):
                    part = io.BytesIO()
                    Image.fromarray(img).save(part, format="PNG" if fmt == "png" else "JPEG", quality=90)
                    files.append(("files", (f"{i}.{fmt}", part.getvalue(), MEDIA[fmt])))
                req = httpx.Request("POST", "http://x/", files=files,  # one boundary for every body
                                    headers={"content-type": "multipart/form-data; boundary=convservebench"})
                out.append((req.read(), req.headers["content-type"]))
                continue
        out.append((buf.getvalue(), None))
    ctype = MEDIA["npy"] if args.workload == "decode" else (out[0][1] or MEDIA[fmt])
    data = [out[i % distinct][0] for i in range(args.requests)]
    if args.workload == "decode":
        return data, ctype, {"format": fmt}
    return data, ctype, {}


def photo_like(rng: np.random.Generator, size: int) -> np.ndarray:
    """Smooth content with some noise: compresses like a photo, not like noise."""
    yy, xx = np.mgrid[0:size, 0:size]
    wave = (np.sin(xx / 17.0 + rng.random()) * np.cos(yy / 23.0))[..., None]
    return (127 + 100 * wave + rng.normal(0, 8, (size, size, 3))).clip(0, 255).astype(np.uint8)


#: the server's keep-alive (CONVSERVE_KEEP_ALIVE_S) and the client's pool expiry, shorter than it:
#: a client reusing a connection the server is closing at that moment loses the request
SERVER_KEEP_ALIVE_S = 75.0
CLIENT_KEEPALIVE_EXPIRY_S = 30.0


@dataclass
class LoopResult:
    seconds: float
    latencies: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    transport_errors: Counter = field(default_factory=Counter)
    cpu_seconds: list[float] = field(default_factory=list)  # per client process
    server_cpu: dict = field(default_factory=dict)          # cores busy per server role
    worker_threads: dict = field(default_factory=dict)      # CPU seconds per model-worker thread
    bytes_in: int = 0
    frontend_spread: list = field(default_factory=list)     # (connections, cores) per front end


class _Sampler(threading.Thread):
    """`fn()` every `every_s` on a thread of its own until stop(): `spread`, the sample whose
    connections add up to the most (the client processes take a second or more to connect all of
    theirs, and close them as they finish); [] if none could be read."""

    def __init__(self, fn, every_s: float = 0.5):
        super().__init__(daemon=True)
        self.fn, self.every_s, self.spread = fn, every_s, []
        self._halt = threading.Event()
        self.start()

    def run(self) -> None:
        while not self._halt.wait(self.every_s):
            try:
                sample = self.fn()
            except Exception:  # noqa: BLE001 - a figure of the report, never the run's failure
                continue
            if sum(c for c, _ in sample) > sum(c for c, _ in self.spread):
                self.spread = sample

    def stop(self) -> None:
        self._halt.set()
        self.join()


def closed_loop(url: str, data: list[bytes], ctype: str, params: dict, concurrency: int, start=None) -> LoopResult:
    """`concurrency` clients, each sending its next request when the last one is answered.
    Errors are counted (status codes, transport errors by class), never raised. `start`: a
    barrier to wait on before the clock starts (several client processes start together)."""
    res = LoopResult(0.0)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency,
                          keepalive_expiry=CLIENT_KEEPALIVE_EXPIRY_S)
    with httpx.Client(timeout=600, limits=limits) as client:
        def one(body: bytes) -> None:
            t0 = time.perf_counter()
            try:
                r = client.post(url, content=body, headers={"content-type": ctype}, params=params)
            except httpx.TransportError as exc:
                res.transport_errors[exc.__class__.__name__] += 1
                return
            res.statuses[r.status_code] += 1
            if r.status_code == 200:
                res.latencies.append(time.perf_counter() - t0)
                res.bytes_in += len(r.content)
        if start is not None:
            start.wait()
        cpu0, t0 = time.process_time(), time.perf_counter()
        with ThreadPoolExecutor(concurrency) as pool:
            list(pool.map(one, data))
        res.seconds = time.perf_counter() - t0
        res.cpu_seconds = [time.process_time() - cpu0]
    return res


def raw_loop(url: str, data: list[bytes], ctype: str, params: dict, concurrency: int, start=None) -> LoopResult:
    """The same closed loop with a client of a few microseconds per request: `concurrency`
    kept-alive raw sockets in one thread, requests prepared beforehand, answers framed by their
    Content-Length (the server sends no chunked answers to these requests)."""
    import selectors
    import socket
    from urllib.parse import urlencode, urlsplit

    u = urlsplit(url)
    target = u.path + ("?" + urlencode(params) if params else "")
    prepared = [(f"POST {target} HTTP/1.1\r\nHost: {u.netloc}\r\nContent-Type: {ctype}\r\n"
                 f"Content-Length: {len(body)}\r\n\r\n").encode() + body for body in data]
    res = LoopResult(0.0)
    sel = selectors.DefaultSelector()
    conns = [socket.create_connection((u.hostname, u.port)) for _ in range(min(concurrency, len(prepared)))]
    if start is not None:
        start.wait()
    cpu0, t0 = time.process_time(), time.perf_counter()
    nxt = 0
    for sock in conns:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sel.register(sock, selectors.EVENT_READ, [bytearray(), time.perf_counter()])
        sock.sendall(prepared[nxt])
        nxt += 1
    busy = len(conns)
    while busy:
        for key, _ in sel.select(60):
            sock, state = key.fileobj, key.data
            chunk = sock.recv(1 << 20)
            if not chunk:
                res.transport_errors["closed"] += 1
                sel.unregister(sock)
                busy -= 1
                continue
            buf = state[0]
            buf += chunk
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                continue
            head = bytes(buf[:end]).lower()
            i = head.find(b"content-length:")
            total = end + 4 + int(head[i + 15:head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None])
            if len(buf) < total:
                continue
            status = int(head[9:12])
            res.statuses[status] += 1
            if status == 200:
                res.latencies.append(time.perf_counter() - state[1])
                res.bytes_in += total
            del buf[:total]
            if nxt < len(prepared):
                state[1] = time.perf_counter()
                sock.sendall(prepared[nxt])
                nxt += 1
            else:
                sel.unregister(sock)
                busy -= 1
    res.seconds = time.perf_counter() - t0
    res.cpu_seconds = [time.process_time() - cpu0]
    for sock in conns:
        sock.close()
    return res


def _client_process(url, data, ctype, params, concurrency, start, results, raw) -> None:
    results.put((raw_loop if raw else closed_loop)(url, data, ctype, params, concurrency, start))


def closed_loop_procs(url: str, data: list[bytes], ctype: str, params: dict, concurrency: int, procs: int,
                      raw: bool = False) -> LoopResult:
    """The closed loop split over `procs` client processes (one Python client process tops out
    near a core's worth of requests); they start together and the run lasts until the last ends.
    raw: the raw-socket client (raw_loop) instead of httpx."""
    if procs <= 1:
        return (raw_loop if raw else closed_loop)(url, data, ctype, params, concurrency)
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(procs), ctx.Queue()
    workers = [ctx.Process(target=_client_process, args=(url, data[i::procs], ctype, params,
                                                         max(1, concurrency // procs), start, results, raw))
               for i in range(procs)]
    for w in workers:
        w.start()
    parts = [results.get() for _ in workers]
    for w in workers:
        w.join()
    total = LoopResult(max(p.seconds for p in parts))
    for p in parts:
        total.latencies += p.latencies
        total.statuses.update(p.statuses)
        total.transport_errors.update(p.transport_errors)
        total.cpu_seconds += p.cpu_seconds
        total.bytes_in += p.bytes_in
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--workload", choices=("encode", "decode"), default="encode")
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--preset", default=None, help="default: tiny-convnext (encode), tiny-vae (decode)")
    ap.add_argument("--size", type=int, default=64, help="encode: image side sent")
    ap.add_argument("--latent", type=int, default=16, help="decode: latent side (pixels = 8x)")
    ap.add_argument("--channels", type=int, default=4, help="decode: latent channels")
    ap.add_argument("--per-request", type=int, default=1,
                    help="encode: images per request (npy: one N,S,S,3 array; jpeg/png: multipart)")
    ap.add_argument("--batch", type=int, default=8, help="server max_batch and the raw batch")
    ap.add_argument("--concurrency", type=int, default=32)
    ap.add_argument("--requests", type=int, default=256)
    ap.add_argument("--format", default="npy",
                    help="comma list, each run in turn against the same server: decode: the response "
                         "format (png, jpeg, webp, npy); encode: the body format (npy = uint8 pixels, png, jpeg)")
    ap.add_argument("--client-procs", type=int, default=1, help="client processes sharing --concurrency")
    ap.add_argument("--client", choices=("httpx", "raw"), default="httpx",
                    help="httpx (a real client), or raw sockets with prepared requests (microseconds a request: "
                         "shows what the server does when the client costs next to nothing)")
    ap.add_argument("--devices", default=None, help="CONVSERVE_DEVICES for the server (GPUs: all or 0,1)")
    ap.add_argument("--workers", type=int, default=None, help="front-end processes (default: the server's auto)")
    ap.add_argument("--delay-ms", type=float, default=2.0, help="the server's batching window")
    ap.add_argument("--no-bulk", action="store_true",
                    help="CONVSERVE_BULK_SUBMIT=0: each request its own message to the worker (no SubmitMany)")
    ap.add_argument("--no-run-ahead", action="store_true",
                    help="the server's CONVSERVE_RUN_AHEAD=false: each batch waited for before the next starts")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-raw", action="store_true", help="skip the raw model (a second row of the same run)")
    ap.add_argument("--log", help="server log file")
    ap.add_argument("--py-spy", type=float, default=0.0, metavar="SECONDS",
                    help="sample the model worker and one front end with py-spy for this long in each format's "
                         "measured run; raw stacks and a per-thread summary go to $OUT (default out)")
    ap.add_argument("--py-spy-gil", action="store_true",
                    help="with --py-spy: sample only the thread holding the interpreter lock (shares of "
                         "the Python work, not of the time threads wait)")
    ap.add_argument("--py-spy-native", action="store_true",
                    help="with --py-spy: C frames too (NumPy, the CUDA driver); py-spy pauses the process "
                         "to read them, so that run's throughput is not the service's")
    ap.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                    help="another setting of the server (CONVSERVE_KEY), repeatable: e.g. cuda_pinned_arena_bytes=0")
    ap.add_argument("--worker-cpus", default="", metavar="LIST",
                    help="pin the model workers' threads to these CPUs (e.g. 0-3 or 0,2) and the front ends' to "
                         "the others, from the start of the measured runs")
    ap.add_argument("--raw-only", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    args.preset = args.preset or ("tiny-convnext" if args.workload == "encode" else "tiny-vae")
    if args.raw_only:
        print(raw_items_per_s(args.workload, args.backend, args.preset, args.size, args.latent, args.batch, args.reps))
        return

    def measure_raw() -> float:
        if args.no_raw:
            return float("nan")
        child = subprocess.run([sys.executable, __file__, "--raw-only", "--workload", args.workload, "--backend",
                                args.backend, "--preset", args.preset, "--size", str(args.size), "--latent",
                                str(args.latent), "--batch", str(args.batch), "--reps", str(args.reps)],
                               capture_output=True, text=True)
        if child.returncode:
            raise SystemExit(f"raw run failed:\n{child.stderr[-3000:]}")
        return float(child.stdout.strip().splitlines()[-1])

    raw_before = measure_raw()
    formats = args.format.split(",")
    warm = f"{args.latent * 8}" if args.workload == "decode" else str(args.size)
    settings = dict(models=f"m={args.preset}", backend=args.backend, max_batch=args.batch,
                    max_queue=max(64, 2 * args.concurrency), warmup_sizes=warm, request_timeout_s=600,
                    keep_alive_s=SERVER_KEEP_ALIVE_S, max_queue_delay_ms=args.delay_ms, log_level="warning")
    if args.devices:
        settings["devices"] = args.devices
    if args.workers is not None:
        settings["workers"] = args.workers
    if args.no_bulk:
        settings["bulk_submit"] = "false"
    if args.no_run_ahead:
        settings["run_ahead"] = "false"
    for pair in args.setting:  # any other CONVSERVE_ setting of the server, e.g. cuda_pinned_arena_bytes=0
        key, _, value = pair.partition("=")
        settings[key.strip().lower()] = value.strip()
    url_path = f"/v1/models/m/{args.workload}"
    rows = []
    with ServerProcess(log_path=args.log, **settings) as srv:
        srv.wait_all_devices("m")
        frontends = srv.frontends()
        if args.worker_cpus:
            srv.pin_workers(_cpu_list(args.worker_cpus))
            print(f"model workers pinned to CPUs {args.worker_cpus}, front ends to the others")
        for fmt in formats:
            data, ctype, params = bodies(args, fmt)
            closed_loop(srv.url + url_path, data[: max(args.concurrency, args.batch) * 2], ctype, params,
                        args.concurrency)  # warm-up: every front end and batch size
            m0, cpu0, threads0 = srv.metrics(), srv.cpu_seconds(), srv.worker_thread_cpu()
            spread0 = srv.frontend_spread()
            mid = _Sampler(srv.frontend_spread)
            spies = _start_py_spy(srv, fmt, args.py_spy, args.py_spy_gil, args.py_spy_native)
            res = closed_loop_procs(srv.url + url_path, data, ctype, params, args.concurrency, args.client_procs,
                                    raw=args.client == "raw")
            cpu1, threads1, spread1 = srv.cpu_seconds(), srv.worker_thread_cpu(), srv.frontend_spread()
            _finish_py_spy(spies)
            mid.stop()
            # connections when most were open, CPU over the whole run
            res.frontend_spread = [(conns, (cpu - cpu_before) / res.seconds)
                                   for (conns, _), (_, cpu), (_, cpu_before) in zip(mid.spread, spread1, spread0)]
            res.server_cpu = {k: (cpu1[k] - cpu0[k]) / res.seconds for k in cpu1}
            res.worker_threads = {k: v - threads0.get(k, 0.0) for k, v in threads1.items()}
            rows.append((fmt, res, m0, srv.metrics()))
    raw_after = measure_raw()
    raw = (raw_before + raw_after) / 2
    from benchmarks.machine import describe_machine
    print(f"machine: {describe_machine()}")
    what = (f"decode 1x{args.channels}x{args.latent}x{args.latent} -> {args.latent * 8}^2"
            if args.workload == "decode" else f"encode {args.size}^2 bodies")
    if args.per_request > 1:
        what += f", {args.per_request} per request"
    print(f"{args.preset} {what}, backend {args.backend}, max_batch {args.batch}, {frontends} front end(s); "
          f"{args.concurrency} {args.client} clients in {args.client_procs} process(es), {args.requests} requests "
          "per format")
    print(f"raw items/s before {raw_before:.1f}, after {raw_after:.1f}: the ratio uses their mean")
    table = ["| format | raw model items/s (batch %d) | service items/s | service / raw | p50 ms | p99 ms | mean batch "
             "| rows per device | client CPU (cores, busiest process) | server CPU cores (front ends, workers) "
             "| worker CPU per request (us) | requests per message to a worker |"
             % args.batch, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    client_bound = []  # (format, busiest client process's share of a core) at or past CLIENT_BOUND
    for fmt, res, m0, m1 in rows:
        ok = len(res.latencies)
        rps = ok * args.per_request / res.seconds  # items (images) answered per second
        batches = _delta(m0, m1, "convserve_batch_size_count")
        mean_batch = _delta(m0, m1, "convserve_batch_size_sum") / max(1.0, batches)
        per_device = {dict(k[1])["device"]: round(v - m0.get(k, 0.0)) for k, v in m1.items()
                      if k[0] == "convserve_device_rows_total" and v - m0.get(k, 0.0) > 0}
        q = statistics.quantiles(res.latencies, n=100) if ok > 1 else [float("nan")] * 99
        errors = sum(res.transport_errors.values())
        if set(res.statuses) != {200} or errors:
            print(f"{fmt}: statuses {dict(res.statuses)}; transport errors {errors} {dict(res.transport_errors)}")
        cpu, busiest = sum(res.cpu_seconds) / res.seconds, max(res.cpu_seconds) / res.seconds
        if busiest >= CLIENT_BOUND:
            client_bound.append((fmt, busiest))
        # the workers' CPU seconds per answered request: every thread of theirs (I/O, batcher,
        # device, delivery), the model's own host work included
        per_request_us = res.server_cpu["model workers"] / max(ok / res.seconds, 1e-9) * 1e6
        # Submit / SubmitMany messages the workers read, and the requests in them (the workers
        # publish these counts every 50 ms and when idle: the scrape after the run has them all)
        per_message = _delta(m0, m1, "convserve_worker_submits_total") / max(
            1.0, _delta(m0, m1, "convserve_worker_submit_messages_total"))
        table.append(f"| {fmt} | {raw:.1f} | {rps:.1f} | {rps / raw:.2f} | {q[49] * 1e3:.1f} | {q[98] * 1e3:.1f} "
                     f"| {mean_batch:.1f} | {per_device} | {cpu:.2f}, {busiest:.0%} "
                     f"| {res.server_cpu['front ends']:.2f}, {res.server_cpu['model workers']:.2f} "
                     f"| {per_request_us:.0f} | {per_message:.2f} |")
    print("\n".join(table))
    # a client process near a whole core is the limit of its share of the load: such a row
    # measures the clients, not the service (one H200 host, 2026-11-29: 6 client processes at
    # 98-102 % gave 0.47-0.49 of raw where 8 processes at 69-87 % gave 0.72)
    for fmt, busiest in client_bound:
        print(f"{fmt}: CLIENT-BOUND: the busiest client process used {busiest:.0%} of a core; this row "
              f"measures the clients: run again with more --client-procs")
    # where a request's worker CPU goes: the threads other than the device thread (worker-...)
    # are the service's own cost whatever the backend; the device thread's includes the model's
    # host work (on the NumPy backend, its compute; its pools are "unnamed")
    for fmt, res, _, _ in rows:
        ok = max(len(res.latencies), 1)
        threads = res.worker_threads
        parts = sorted(((k, v) for k, v in threads.items() if not k.endswith((" system", " switches", " preempted"))),
                       key=lambda kv: -kv[1])
        print(f"{fmt}: worker CPU per request by thread, us (of it in the kernel; waits / preemptions a request): "
              + ", ".join(f"{name} {seconds / ok * 1e6:.1f} ({threads.get(name + ' system', 0.0) / ok * 1e6:.0f}; "
                          f"{threads.get(name + ' switches', 0.0) / ok:.2f} / {threads.get(name + ' preempted', 0.0) / ok:.2f})"
                          for name, seconds in parts if seconds > 0))
    # where a latency tail forms: the worker's queue (waiting for a batch) or elsewhere (the
    # front end's parsing and answering, the clients, the CPU's scheduling)
    for fmt, res, m0, m1 in rows:
        figures = {what: [_hist_quantile(m0, m1, name, q) * 1e3 for q in (0.5, 0.99)]
                   for what, name in (("server, body read to response ready", "convserve_request_seconds"),
                                      ("worker queue wait", "convserve_queue_wait_seconds"))}
        print(f"{fmt}: p50 / p99 ms from the service's histograms (coarse buckets): "
              + "; ".join(f"{what} {a:.1f} / {b:.1f}" for what, (a, b) in figures.items()))
        # the garbage collector's pauses in the server's processes during the run (each stops its
        # process's threads: service/gc_pauses.py); a full collection (generation 2) over ~10 ms
        # in a front end or worker is a latency tail of its own
        pauses = []
        for process in ("frontend", "worker"):
            for gen in ("0", "1", "2"):
                where = {"process": process, "generation": gen}
                count, total = (_delta(m0, m1, f"convserve_gc_pause_seconds_{part}", **where) for part in ("count", "sum"))
                slow = count - _delta(m0, m1, "convserve_gc_pause_seconds_bucket", le="0.01", **where)
                pauses.append(f"{process} {gen}: {count:.0f}, {total * 1e3:.1f} ms, {slow:.0f} over 10 ms")
        print(f"{fmt}: garbage-collector pauses (process generation: count, sum, over 10 ms): " + "; ".join(pauses))
        # how evenly the front ends shared the clients' connections and the work
        spread = res.frontend_spread
        if spread:
            conns = [c for c, _ in spread]
            cores = sorted(c for _, c in spread)
            print(f"{fmt}: front ends' client connections min / median / max {min(conns)} / "
                  f"{statistics.median(conns):g} / {max(conns)}; CPU cores {cores[0]:.2f} / "
                  f"{statistics.median(cores):.2f} / {cores[-1]:.2f}")
        # where image files were decoded (JPEG_DECODE: a front end's PIL, or the model worker)
        decodes = {where: _delta(m0, m1, "convserve_image_decodes_total", where=where)
                   for where in ("frontend", "device", "worker-host")}
        if any(decodes.values()):
            print(f"{fmt}: image files decoded by where: " + ", ".join(f"{k} {v:.0f}" for k, v in decodes.items()))


def _cpu_list(text: str) -> set[int]:
    """'0-3,6' -> {0, 1, 2, 3, 6}"""
    out: set[int] = set()
    for part in text.split(","):
        lo, _, hi = part.strip().partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _start_py_spy(srv: ServerProcess, fmt: str, seconds: float, gil: bool = False,
                  native: bool = False) -> list[tuple]:
    """py-spy on the first model worker and the first spawned front end, from the measured run's
    start (the run must outlast `seconds`: the summary says how many samples it got)."""
    if seconds <= 0:
        return []
    why = pyspy_profile.available()
    if why:
        print(f"--py-spy: {why}")
        return []
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    roles = srv.roles()
    chosen = {"worker": roles["model workers"][:1], "frontend": roles["front ends"][1:2] or roles["front ends"][:1]}
    spies = []
    for role, pids in chosen.items():
        for pid in pids:
            path = os.path.join(out, f"pyspy_{role}_{fmt}.txt")
            spies.append((path, pyspy_profile.record(pid, seconds, path, gil=gil, native=native)))
    return spies


def _finish_py_spy(spies: list[tuple]) -> None:
    for path, proc in spies:
        _, err = proc.communicate()
        if proc.returncode or not os.path.exists(path):
            print(f"py-spy failed ({proc.returncode}): {err.strip()[-500:]}")
            continue
        print(pyspy_profile.summary(path))


def _hist_quantile(m0: dict, m1: dict, name: str, q: float) -> float:
    """The q-quantile of a histogram's observations between two scrapes, linear within a bucket
    (the service's latency buckets are coarse: a figure to tell where a tail forms, not a timing)."""
    counts: dict[float, float] = {}
    for key, v in m1.items():
        if key[0] == f"{name}_bucket":
            le = float(dict(key[1])["le"])
            counts[le] = counts.get(le, 0.0) + v - m0.get(key, 0.0)
    bounds = sorted(counts)
    if not bounds or counts[bounds[-1]] <= 0:
        return float("nan")
    want, lo, below = q * counts[bounds[-1]], 0.0, 0.0
    for le in bounds:
        if counts[le] >= want:
            if le == float("inf"):
                return lo
            return lo + (le - lo) * (want - below) / max(counts[le] - below, 1e-12)
        lo, below = le, counts[le]
    return lo


def _delta(m0: dict, m1: dict, name: str, **labels: str) -> float:
    """A series' growth between two scrapes, summed over the samples whose labels include `labels`."""
    return sum(v - m0.get(k, 0.0) for k, v in m1.items()
               if k[0] == name and labels.items() <= dict(k[1]).items())


if __name__ == "__main__":
    main()
