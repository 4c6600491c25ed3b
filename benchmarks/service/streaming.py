"""Streamed video decode: time to the first frame vs time to the full clip, on a real convserve.

Same server, same latents, same run, interleaved: the peer is the non-streaming
`POST /v1/models/{name}/decode?format=npy` (the whole clip in one answer); ours is
`POST /v1/models/{name}/decode/stream` as `.npy` records and as fragmented MP4. Client-side
times from sending the request: first group = the first frame group fully received (the
first .npy record, or init segment + first moof/mdat), full = the last byte. The server's
own convserve_time_to_first_frame_seconds (mean over the runs) is printed beside them.

    python benchmarks/service/streaming.py                       # starts `convserve serve`: tiny-wan-vae, numpy
    python benchmarks/service/streaming.py --shapes 9x16x16 9x32x32 --reps 3
    python benchmarks/service/streaming.py --models wan=wan2.1-vae --backend cuda --shapes 21x60x104   # GPU
    python benchmarks/service/streaming.py --url http://host:8000 --model wan                          # a running server
    python benchmarks/service/streaming.py --models wan=wan2.1-vae --backend cuda --shapes 21x60x104 --raw    # + raw model
    python benchmarks/service/streaming.py --models wan=wan2.1-vae --backend cuda --shapes 31x90x160 --shards 4  # 4 GPUs

With --shards N, the started server gets devices 0..N-1 and shard groups on, and every request asks
for `shards=N`: one decode split by rows over N GPUs, its frame groups streamed as
every GPU completes them.

With --raw, the raw model's own decode (`model.decode`, float32 frames back to host memory, in a
child process, best of --reps) is timed on the same latents, and each route's time to its last
byte is printed as raw / route (the service split's target: it delivers >= 0.9 of the raw decode's speed).
The whole-clip answers (.npy and MP4) are read over a plain socket into one buffer (`--client httpx` for
httpx), the streams with httpx; the client's CPU per call is printed for each route. Per route, the server's own
time per frame group after the first is printed by stage (convserve_stream_group_stage_seconds).
"""
from __future__ import annotations

import argparse
import io
import socket
import statistics
import struct
import sys
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
from benchmarks.machine import describe_machine  # noqa: E402
from server_process import ServerProcess, scrape  # noqa: E402

NPY = {"content-type": "application/x-npy"}


def npy(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def first_group_end(data: bytes, fmt: str) -> bool:
    """True once `data` holds the whole first frame group."""
    if fmt == "npy":
        return len(data) >= 8 and len(data) >= 8 + struct.unpack("<Q", data[:8])[0]
    i = 0
    while i + 8 <= len(data):
        size = int.from_bytes(data[i:i + 4], "big")
        if i + size > len(data):
            return False
        if data[i + 4:i + 8] == b"mdat":
            return True
        i += size
    return False


def timed_stream(url: str, body: bytes, fmt: str, **params) -> tuple[float, float, int, float]:
    """(seconds to the first whole frame group, seconds to the last byte, bytes, the client's CPU seconds)."""
    t0, c0 = time.perf_counter(), time.thread_time()
    first, head, size = None, bytearray(), 0
    with httpx.stream("POST", url, content=body, headers=NPY, params={"format": fmt, **params}, timeout=3600) as r:
        if r.status_code != 200:
            raise SystemExit(f"stream answered {r.status_code}: {r.read()[:300]!r}")
        for chunk in r.iter_raw():
            size += len(chunk)
            if first is None:  # keep bytes only until the first group is whole: the client stays cheap
                head += chunk
                if first_group_end(bytes(head), fmt):
                    first, head = time.perf_counter() - t0, None
    return first, time.perf_counter() - t0, size, time.thread_time() - c0


def timed_decode(url: str, body: bytes, fmt: str = "npy", **params) -> tuple[float, float]:
    """(seconds to the last byte, the client's CPU seconds). The whole answer is kept, as a client
    that uses it would, but read into one buffer of the answer's Content-Length: httpx.post's
    `.content` joins 64 KiB chunks and cost the client about as much CPU as the transfer took
    (a 388 MB clip), which made the client, not the server, the limit of this route's figure."""
    t0, c0 = time.perf_counter(), time.thread_time()
    with httpx.stream("POST", url, content=body, headers=NPY, params={"format": fmt, **params}, timeout=3600) as r:
        if r.status_code != 200:
            raise SystemExit(f"decode answered {r.status_code}: {r.read()[:300]!r}")
        length = r.headers.get("content-length")
        buf = bytearray(int(length)) if length else bytearray()
        view, n = memoryview(buf) if length else None, 0
        for chunk in r.iter_raw():
            if view is not None:
                view[n:n + len(chunk)] = chunk
            else:  # an MP4 sent as it is encoded has no length up front
                buf += chunk
            n += len(chunk)
        if length and n != int(length):
            raise SystemExit(f"decode answer cut short: {n} of {length} bytes")
    return time.perf_counter() - t0, time.thread_time() - c0


def raw_decode(url: str, body: bytes, fmt: str = "npy", **params) -> tuple[float, float]:
    """timed_decode over a plain socket: the answer is received straight into one buffer (recv_into)
    where it has a Content-Length (.npy), or chunk by chunk from a buffered reader where it is
    chunked (MP4), no HTTP library between. Why: httpx's chunks cost the client 0.43-0.65 s of
    CPU for a 388 MB float32 clip on the H200 host, most of a core over a ~0.9 s call, so the
    client could have set that route's figure."""
    t0, c0 = time.perf_counter(), time.thread_time()
    target = httpx.URL(url, params={"format": fmt, **params})
    with socket.create_connection((target.host, target.port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        head = (f"POST {target.raw_path.decode()} HTTP/1.1\r\nHost: {target.host}:{target.port}\r\n"
                f"Content-Type: application/x-npy\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n")
        sock.sendall(head.encode() + body)
        reader = sock.makefile("rb", buffering=1 << 20)
        status_line = reader.readline()
        headers = {}
        while (line := reader.readline()) not in (b"\r\n", b""):
            key, _, value = line.decode("latin-1").partition(":")
            headers[key.strip().lower()] = value.strip()
        status = int(status_line.split()[1]) if status_line else 0
        length, chunked = headers.get("content-length"), headers.get("transfer-encoding", "").lower() == "chunked"
        if status != 200 or not (length or chunked):
            raise SystemExit(f"decode answered {status}: {status_line!r} {headers}")
        if length is not None:
            out = bytearray(int(length))
            view, n = memoryview(out), 0
            while n < len(out):
                r = reader.readinto(view[n:])
                if not r:
                    raise SystemExit(f"decode answer cut short: {n} of {length} bytes")
                n += r
        else:  # chunked: size line, data, CRLF ... until the zero-size chunk
            out = bytearray()
            while (size := int(reader.readline().split(b";")[0], 16)) > 0:
                part = reader.read(size)
                if len(part) != size or reader.read(2) != b"\r\n":
                    raise SystemExit("decode answer cut short inside a chunk")
                out += part
    return time.perf_counter() - t0, time.thread_time() - c0


def wait_for_every_device(url: str, model: str, timeout: float = 600) -> None:
    """/readyz answers once any worker is ready; a shard group needs every one of its workers,
    and the leader's links to them (503 shard-group-not-ready with Retry-After until then)."""
    deadline = time.monotonic() + timeout
    while True:
        devices = httpx.get(f"{url}/v1/models/{model}", timeout=30).json().get("devices", [])
        if devices and all(d["state"] == "ready" for d in devices):
            return
        if time.monotonic() > deadline:
            raise SystemExit(f"the devices of {model} did not all get ready in {timeout:.0f} s: {devices}")
        time.sleep(0.2)


def first_sharded_call(url: str, body: bytes, shards: int, timeout: float = 300) -> None:
    """One sharded decode that succeeds: the group forms on the first N-shard request, and until
    each follower has linked up the answer is 503 with Retry-After."""
    deadline = time.monotonic() + timeout
    while True:
        r = httpx.post(url, content=body, headers=NPY, params={"format": "npy", "shards": shards}, timeout=3600)
        if r.status_code == 200:
            return
        if r.status_code != 503 or time.monotonic() > deadline:
            raise SystemExit(f"sharded decode answered {r.status_code}: {r.text[:300]}")
        time.sleep(float(r.headers.get("Retry-After", "1")))


def model_sums(snap: dict[tuple, float], name: str, model: str, by: tuple[str, ...]) -> dict[tuple, float]:
    """The model's samples called `name` in a scrape, summed over every label but those in `by`
    (keyed by their values, in that order)."""
    out: dict[tuple, float] = {}
    for (sample, labels), value in snap.items():
        labels = dict(labels)
        if sample == name and labels.get("model") == model:
            key = tuple(labels.get(label, "") for label in by)
            out[key] = out.get(key, 0.0) + value
    return out


def server_stages(url: str, model: str) -> dict[str, float]:
    """Sum per stage of convserve_stream_first_frame_stage_seconds for the model."""
    sums = model_sums(scrape(url), "convserve_stream_first_frame_stage_seconds_sum", model, ("stage",))
    return {stage: total for (stage,), total in sums.items()}


def group_stages(url: str, model: str) -> dict[tuple[str, str], tuple[float, float]]:
    """(format, stage) -> (sum, count) of convserve_stream_group_stage_seconds for the model."""
    snap, by = scrape(url), ("format", "stage")
    sums = model_sums(snap, "convserve_stream_group_stage_seconds_sum", model, by)
    counts = model_sums(snap, "convserve_stream_group_stage_seconds_count", model, by)
    return {key: (total, counts.get(key, 0.0)) for key, total in sums.items()}


def worker_calls(url: str, model: str) -> tuple[float, float]:
    """(model calls, their compute_infer ns) so far, from the Triton statistics (the workers' own
    records, asked of them at the time): a streamed decode's steps are its model calls."""
    stats = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30).json()["model_stats"][0]
    return float(stats["execution_count"]), float(stats["inference_stats"]["compute_infer"]["ns"])


class GroupStages:
    """Each route's frame groups, stage by stage (wait for the decode, encode, send), from the
    server's own series: scraped around each call, so routes that share a format stay apart. Beside
    them, the worker's own time a model call (a decode step), to tell a decode slowed by what runs
    beside it from a sender that waits."""

    def __init__(self, url: str, model: str):
        self.url, self.model = url, model
        self.per_route: dict[str, dict[str, list[float]]] = {}
        self.calls: dict[str, int] = {}
        self.steps: dict[str, list[float]] = {}

    def call(self, route: str, fn, *args, **kwargs):
        before, calls0 = group_stages(self.url, self.model), worker_calls(self.url, self.model)
        result = fn(*args, **kwargs)
        after, calls1 = group_stages(self.url, self.model), worker_calls(self.url, self.model)
        steps = self.steps.setdefault(route, [0.0, 0.0])
        steps[0] += calls1[0] - calls0[0]
        steps[1] += calls1[1] - calls0[1]
        acc = self.per_route.setdefault(route, {})
        self.calls[route] = self.calls.get(route, 0) + 1
        for key, (total, count) in after.items():
            t0, c0 = before.get(key, (0.0, 0.0))
            if count > c0:
                sums = acc.setdefault(key[1], [0.0, 0.0])
                sums[0] += total - t0
                sums[1] += count - c0
        return result

    def lines(self) -> list[str]:
        """Per route: each stage's mean per group, and its sum per call; the worker's time a step."""
        out = []
        for route, stages in self.per_route.items():
            calls, ns = self.steps.get(route, (0.0, 0.0))
            worker = f"; the worker's model calls {1e-6 * ns / calls:.1f} ms each ({calls / self.calls[route]:.0f} a call)" \
                if calls else ""
            out.append(f"    {route}: " + ", ".join(
                f"{stage} {1e3 * total / max(count, 1):.1f} ms a group ({1e3 * total / self.calls[route]:.0f} a call)"
                for stage, (total, count) in sorted(stages.items())) + worker)
        return out


def server_ttff(url: str, model: str) -> tuple[float, float]:
    """(sum, count) of convserve_time_to_first_frame_seconds for the model."""
    snap = scrape(url)
    total = model_sums(snap, "convserve_time_to_first_frame_seconds_sum", model, ()).get((), 0.0)
    return total, model_sums(snap, "convserve_time_to_first_frame_seconds_count", model, ()).get((), 0.0)


def raw_decode_s(preset: str, backend: str, latents: np.ndarray, reps: int) -> float:
    """The model's own decode of `latents` (best of reps after a warm-up), in a child process."""
    import subprocess
    import tempfile

    with tempfile.NamedTemporaryFile(suffix=".npy") as f:
        np.save(f.name, latents)
        code = ("import sys, time, numpy as np; sys.path.insert(0, '.'); from convkernels import get_backend; "
                "from models import load_model; "
                f"m = load_model('w', {preset!r}, get_backend({backend!r})); x = np.load({f.name!r}); m.decode(x); "
                "best = 1e9\n"
                f"for _ in range({reps}):\n t0 = time.perf_counter(); m.decode(x); best = min(best, time.perf_counter() - t0)\n"
                "print(best)")
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             cwd=Path(__file__).resolve().parents[2])
        if out.returncode:
            raise SystemExit(f"raw decode failed:\n{out.stderr[-2000:]}")
        return float(out.stdout.strip().splitlines()[-1])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", help="a running server (default: start one)")
    ap.add_argument("--models", default="wan=tiny-wan-vae", help="CONVSERVE_MODELS of the started server")
    ap.add_argument("--backend", default="numpy", help="CONVSERVE_BACKEND of the started server (CPU default: numpy)")
    ap.add_argument("--model", default="wan", help="the video decoder's served name")
    ap.add_argument("--shapes", nargs="+", default=["9x16x16"], help="latent TxHxW")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--raw", action="store_true", help="also time the raw model's decode (a child process)")
    ap.add_argument("--shards", type=int, default=1, help="split each decode by rows over this many GPUs")
    ap.add_argument("--mp4-preset", default="veryfast", help="the started server's MP4_PRESET (x264's speed preset)")
    ap.add_argument("--client", choices=("raw", "httpx"), default="raw",
                    help="how the whole-clip answers (.npy, MP4) are read: a plain socket into one buffer (raw), or httpx")
    ap.add_argument("--setting", action="append", default=[], metavar="KEY=VALUE",
                    help="another setting of the started server (CONVSERVE_KEY), repeatable: e.g. mp4_threads=4")
    args = ap.parse_args()

    srv = None
    url = args.url
    sharded = {"shards": args.shards} if args.shards > 1 else {}
    if url is None:
        extra = dict(devices=",".join(map(str, range(args.shards))), shard_groups=1) if sharded else {}
        for pair in args.setting:
            key, _, value = pair.partition("=")
            extra[key.strip().lower()] = value.strip()
        srv = ServerProcess(models=args.models, backend=args.backend, max_frames=100000, request_timeout_s=3600,
                            mp4_preset=args.mp4_preset, **extra)
        url = srv.url
    if sharded:
        wait_for_every_device(url, args.model)
    try:
        card = httpx.get(f"{url}/v1/models/{args.model}", timeout=30).json()
        c = card["latent_channels"]
        print(f"machine: {describe_machine()}")
        print(f"server: {card['name']} = {card['preset']} ({card.get('weights')}), backend {card['backend']} "
              f"{card['dtype']}; client on localhost; median of {args.reps} after a warm-up, interleaved"
              + (f"; every decode split over {args.shards} GPUs" if sharded else "")
              + ("" if args.url else f"; MP4_PRESET {args.mp4_preset}")
              + "".join(f"; {pair}" for pair in args.setting))
        print(f"{'latents TxHxW':>13s} {'frames':>14s} {'full clip s':>11s} {'npy 1st s':>9s} {'npy end s':>9s} "
              f"{'mp4 1st s':>9s} {'mp4 end s':>9s} {'full/1st':>8s} {'npy end/full':>12s} {'server ttff s':>13s}")
        rng = np.random.default_rng(0)
        base = f"{url}/v1/models/{args.model}"
        raw_rows = []
        fetch = raw_decode if args.client == "raw" else timed_decode
        stages = GroupStages(url, args.model)
        for shape in args.shapes:
            t, h, w = (int(v) for v in shape.split("x"))
            lat = rng.standard_normal((1, c, t, h, w)).astype(np.float32)
            body = npy(lat)
            if sharded:
                first_sharded_call(f"{base}/decode", body, args.shards)
            if args.raw:
                raw = raw_decode_s(card["preset"], args.backend, lat, args.reps)
                mp4, u8 = [], []
            # warm-up: path choice for these shapes; the second call records the steady chunks' graphs
            for _ in range(2):
                timed_stream(f"{base}/decode/stream", body, "npy", **sharded)
            if args.raw:
                timed_decode(f"{base}/decode", body, "mp4", **sharded)
            full, npy1, npyend, mp41, mp4end = [], [], [], [], []
            cpu = {"npy": [], "npy streamed": [], "mp4 streamed": []}  # the client's CPU seconds per call
            s0, st0 = server_ttff(url, args.model), server_stages(url, args.model)
            for _ in range(args.reps):  # every route once a round, the rounds after each other
                if args.raw:
                    mp4.append(stages.call("mp4", fetch, f"{base}/decode", body, "mp4", **sharded))
                    u8.append(stages.call("npy uint8", fetch, f"{base}/decode", body, "npy", dtype="uint8",
                                          **sharded))
                wall, c = stages.call("npy", fetch, f"{base}/decode", body, **sharded)
                full.append(wall), cpu["npy"].append(c)
                a, b, _, c = stages.call("npy streamed", timed_stream, f"{base}/decode/stream", body, "npy", **sharded)
                npy1.append(a), npyend.append(b), cpu["npy streamed"].append(c)
                a, b, _, c = stages.call("mp4 streamed", timed_stream, f"{base}/decode/stream", body, "mp4", **sharded)
                mp41.append(a), mp4end.append(b), cpu["mp4 streamed"].append(c)
            s1, st1 = server_ttff(url, args.model), server_stages(url, args.model)
            med = statistics.median
            frames = f"{1 + 4 * (t - 1)}x{h * 8}x{w * 8}"
            ttff = (s1[0] - s0[0]) / max(s1[1] - s0[1], 1)
            print(f"{shape:>13s} {frames:>14s} {med(full):11.3f} {med(npy1):9.3f} {med(npyend):9.3f} "
                  f"{med(mp41):9.3f} {med(mp4end):9.3f} {med(full) / med(npy1):7.1f}x {med(npyend) / med(full):11.2f}x "
                  f"{ttff:13.3f}", flush=True)
            streams = max(s1[1] - s0[1], 1)
            print("    server's time to first frame by stage (mean): " + ", ".join(
                f"{st} {1e3 * (st1.get(st, 0.0) - st0.get(st, 0.0)) / streams:.1f} ms" for st in st1), flush=True)
            if args.raw:
                cpu.update({"npy uint8": [c for _, c in u8], "mp4": [c for _, c in mp4]})
                mp4, u8 = [w for w, _ in mp4], [w for w, _ in u8]
            print("    the client's CPU per call (median s, one process): " + ", ".join(
                f"{route} {med(c):.3f}" for route, c in cpu.items()), flush=True)
            print("    the server's frame groups after the first, mean by stage (wait: for the decode; the "
                  "number of groups observed):", *stages.lines(), sep="\n", flush=True)
            stages.per_route.clear(), stages.calls.clear(), stages.steps.clear()
            if args.raw:
                raw_rows.append((shape, frames, raw, {"npy": med(full), "npy uint8": med(u8), "mp4": med(mp4),
                                                      "npy streamed": med(npyend),
                                                      "mp4 streamed": med(mp4end)}))
        if raw_rows:
            print("\nraw model decode (float32 frames to host) vs each route's last byte, raw / route:")
            print("| latents | frames | raw s | npy s | npy uint8 s | mp4 s | npy streamed s | mp4 streamed s |")
            print("| --- | --- | --- | --- | --- | --- | --- | --- |")
            for shape, frames, raw, routes in raw_rows:
                cells = " | ".join(f"{v:.3f} ({raw / v:.2f})" for v in routes.values())
                print(f"| {shape} | {frames} | {raw:.3f} | {cells} |")
    finally:
        if srv is not None:
            srv.stop()


if __name__ == "__main__":
    main()
