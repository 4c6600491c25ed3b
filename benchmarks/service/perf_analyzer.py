"""Triton's own load tool, perf_analyzer, against a real `convserve serve` (KServe v2 HTTP with the
binary tensor extension), an encode and a decode model over a concurrency sweep, beside a locust
run (loadtests/) of the same models and sizes against the same server.

  python benchmarks/service/perf_analyzer.py --perf-analyzer /path/to/perf_analyzer
  python benchmarks/service/perf_analyzer.py --concurrency 1,2,4 --locust-users 4 --locust-time 20s

perf_analyzer comes from PyPI's `perf-analyzer` (2.60.0: a manylinux_2_38 wheel, so glibc >= 2.38;
on older systems pip installs a 0.1.0 placeholder: README "Triton tools" has the recipe that runs it
on Debian 12). It needs the server's /config and /stats (Triton's model configuration and
statistics extensions). Inputs are zeros (`--input-data zero`): perf_analyzer's default random
FP32 bytes hold NaN and Inf, which convserve answers 422 by design.

What the two tools measure differs: perf_analyzer sends back-to-back requests (closed loop, no
think time) of raw FP32 tensors and reads raw FP32 outputs; locust's users wait 10-50 ms between
requests and send a PNG (encode) or .npy latents and get a PNG back (decode), so image codecs are
in its figures and not in perf_analyzer's."""
from __future__ import annotations

import argparse
import csv
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path[:0] = [str(REPO), str(HERE), str(REPO / "loadtests")]

from benchmarks.machine import describe_machine  # noqa: E402
from server_process import ServerProcess  # noqa: E402
from service.ipc.batch_sizes import batch_sizes  # noqa: E402

ENCODER, DECODER = "tiny-convnext", "tiny-vae"
MAX_BATCH = 8  # the service default


def perf_analyzer_version(cmd: list[str]) -> str:
    """The tool's version line, or exit with what went wrong (a glibc too old shows here)."""
    try:
        run = subprocess.run([*cmd, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SystemExit(f"cannot run perf_analyzer ({' '.join(cmd)}): {exc}") from exc
    out = (run.stdout + run.stderr).strip()
    found = [line for line in out.splitlines() if "Perf Analyzer" in line]
    if not found:
        raise SystemExit(f"{' '.join(cmd)} is not a working perf_analyzer:\n{out}\n"
                         "(README 'Triton tools' says how to run the 2.60 wheel where glibc is older than 2.38)")
    return found[0]


def warm_batch_sizes(url: str, model: str, tensor: str, row_shape: list[int], max_batch: int) -> None:
    """One request per batch size the batcher runs: the first call of a new shape pays for the
    CPU backend's path choice (seconds), which would otherwise land in a measurement window."""
    import numpy as np
    import tritonclient.http as tc

    client = tc.InferenceServerClient(url.removeprefix("http://"), network_timeout=600)
    try:
        for rows in batch_sizes(max_batch):
            x = tc.InferInput(tensor, [rows, *row_shape], "FP32")
            x.set_data_from_numpy(np.zeros((rows, *row_shape), np.float32))
            client.infer(model, [x])
    finally:
        client.close()


def run_perf_analyzer(cmd: list[str], url: str, model: str, shape: str, batch: int, concurrency: int,
                      interval_ms: int, stability: int, out_dir: Path) -> dict | None:
    """One perf_analyzer measurement at one concurrency; its CSV row in ms, or None if it failed."""
    csv_path = out_dir / f"{model}-c{concurrency}.csv"
    args = [*cmd, "-m", model, "-u", url.removeprefix("http://"), "-i", "http", "--input-data", "zero",
            "--shape", shape, "-b", str(batch), "--concurrency-range", str(concurrency),
            "--measurement-interval", str(interval_ms), "--stability-percentage", str(stability),
            "--max-trials", "20", "-f", str(csv_path)]
    run = subprocess.run(args, capture_output=True, text=True, timeout=900)
    if run.returncode != 0 or not csv_path.exists():
        tail = "\n".join((run.stdout + run.stderr).strip().splitlines()[-4:])
        print(f"perf_analyzer {model} c={concurrency}: exit {run.returncode}\n{tail}", file=sys.stderr)
        return None
    with open(csv_path) as f:
        row = next(csv.DictReader(f))
    us = lambda key: float(row[key]) / 1000.0  # noqa: E731
    return {"infer_s": float(row["Inferences/Second"]), "p50": us("p50 latency"), "p99": us("p99 latency"),
            "queue": us("Server Queue"), "infer": us("Server Compute Infer")}


def server_counts(url: str, model: str) -> tuple[int, int]:
    """(successful requests, failed requests) from the statistics extension."""
    import httpx

    (entry,) = httpx.get(f"{url}/v2/models/{model}/stats", timeout=30).json()["model_stats"]
    s = entry["inference_stats"]
    return s["success"]["count"], s["fail"]["count"]


def run_locust(url: str, scenario: str, users: int, run_time: str, out_dir: Path) -> dict | None:
    from run import percentile_ms  # loadtests/run.py

    args = [sys.executable, str(REPO / "loadtests" / "run.py"), "--scenario", scenario, "--users", str(users),
            "--run-time", run_time, "--host", url, "--csv-dir", str(out_dir), "--max-p99-ms", "1e9"]
    subprocess.run(args, capture_output=True, text=True, timeout=900)
    path = out_dir / f"{scenario}.json"
    if not path.exists():
        print(f"locust {scenario}: no results", file=sys.stderr)
        return None
    rows = [r for r in json.loads(path.read_text()) if r["num_requests"]]
    if not rows:
        return None
    n = sum(int(r["num_requests"]) for r in rows)
    span = max(r["last_request_timestamp"] for r in rows) - min(r["start_time"] for r in rows)
    times: dict[str, int] = {}
    for r in rows:
        for k, v in r["response_times"].items():
            times[k] = times.get(k, 0) + int(v)
    return {"rps": n / max(span, 1e-3), "p50": percentile_ms(times, 0.5), "p99": percentile_ms(times, 0.99),
            "requests": n, "failures": sum(int(r["num_failures"]) for r in rows)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--perf-analyzer", default=shutil.which("perf_analyzer") or "perf_analyzer",
                    help="the perf_analyzer binary, or a wrapper script that runs it [perf_analyzer on PATH]")
    ap.add_argument("--concurrency", default="1,2,4,8", help="comma list of request concurrencies")
    ap.add_argument("--batch", type=int, default=1, help="perf_analyzer -b (rows per request)")
    ap.add_argument("--image-side", type=int, default=64, help="encoder input side (locust's LOAD_IMAGE_SIDE)")
    ap.add_argument("--latent-side", type=int, default=8, help="decoder latent side (locust's LOAD_LATENT_SIDE)")
    ap.add_argument("--interval-ms", type=int, default=3000, help="perf_analyzer --measurement-interval")
    ap.add_argument("--stability", type=int, default=50,
                    help="perf_analyzer --stability-percentage (its default 10 rarely settles on a shared box)")
    ap.add_argument("--locust-users", type=int, default=4, help="0 skips the locust run")
    ap.add_argument("--locust-time", default="20s")
    args = ap.parse_args(argv)
    cmd = [args.perf_analyzer]
    version = perf_analyzer_version(cmd)
    levels = [int(c) for c in args.concurrency.split(",") if c.strip()]
    targets = [("encode", ENCODER, "pixels", [args.image_side, args.image_side, 3]),
               ("decode", DECODER, "latents", [4, args.latent_side, args.latent_side])]

    print(f"machine: {describe_machine()}")
    print(f"peer tool: {version}; server: convserve serve, numpy backend, {ENCODER} {args.image_side}px, "
          f"{DECODER} {args.latent_side}x{args.latent_side} latents, batch {args.batch}")
    server = ServerProcess(models=f"{DECODER},{ENCODER}", backend="numpy", max_batch=MAX_BATCH)
    out_dir = Path(tempfile.mkdtemp(prefix="convserve-perf-analyzer-"))
    rows = []
    try:
        for scenario, model, tensor, row_shape in targets:
            warm_batch_sizes(server.url, model, tensor, row_shape, MAX_BATCH)
            shape = f"{tensor}:{','.join(map(str, row_shape))}"
            before = server_counts(server.url, model)
            for c in levels:
                r = run_perf_analyzer(cmd, server.url, model, shape, args.batch, c, args.interval_ms,
                                      args.stability, out_dir)
                if r:
                    rows.append(("perf_analyzer", model, "KServe v2 binary", c, r["infer_s"], r["p50"], r["p99"],
                                 f"queue {r['queue']:.1f} / infer {r['infer']:.1f}"))
            ok, failed = (a - b for a, b in zip(server_counts(server.url, model), before))
            print(f"{model}: server statistics counted {ok} successful and {failed} failed requests "
                  "over the sweep (warm-up and measurement)")
            if args.locust_users:
                r = run_locust(server.url, scenario, args.locust_users, args.locust_time, out_dir)
                if r:
                    rows.append(("locust", model, f"/v1 {scenario} (PNG)", args.locust_users, r["rps"], r["p50"],
                                 r["p99"], f"{r['requests']} req, {r['failures']} failed"))
    finally:
        server.proc.terminate()
        server.proc.wait(30)
    print(f"\n{'tool':<14} {'model':<14} {'protocol':<20} {'conc':>4} {'items/s':>8} {'p50 ms':>8} {'p99 ms':>8}  server ms / notes")
    for tool, model, proto, c, tput, p50, p99, note in rows:
        print(f"{tool:<14} {model:<14} {proto:<20} {c:>4} {tput:>8.1f} {p50:>8.1f} {p99:>8.1f}  {note}")
    return 0 if rows else 1


if __name__ == "__main__":
    sys.exit(main())
