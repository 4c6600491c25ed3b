"""Headless, bounded locust run against a convserve on localhost, then a pass/fail check:
fails (exit 1) when the error rate exceeds --max-error-rate (default 0.1%) or the aggregated p99
exceeds --max-p99-ms (default 2000 ms: tiny presets, 4 users, a 2-core CPU box).

  python loadtests/run.py --scenario mixed --users 4 --run-time 30s --host http://127.0.0.1:8000
  python loadtests/run.py --scenario decode --start-server      # starts `convserve serve` itself
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

HERE = Path(__file__).resolve().parent
SCENARIOS = {"encode": "EncodeUser", "decode": "DecodeUser", "mixed": "MixedUser"}
LOCAL_HOSTS = {"127.0.0.1", "localhost", "::1"}


def percentile_ms(response_times: dict, q: float) -> float:
    """Percentile from locust's {rounded ms: count} histogram."""
    items = sorted((float(k), int(v)) for k, v in response_times.items())
    total = sum(c for _, c in items)
    if total == 0:
        return float("inf")
    seen = 0
    for ms, c in items:
        seen += c
        if seen >= q * total:
            return ms
    return items[-1][0]


def check_stats(stats: list[dict], max_error_rate: float, max_p99_ms: float) -> tuple[bool, str]:
    """Judge locust's final stats (--json-file): every endpoint and the aggregate of all."""
    agg_times: dict[float, int] = {}
    lines = [f"{'name':<10} {'reqs':>6} {'fails':>6} {'rps':>7} {'p50 ms':>8} {'p99 ms':>8}"]
    n = failures = 0
    active = [r for r in stats if r["num_requests"]]
    span = (max(r["last_request_timestamp"] for r in active) - min(r["start_time"] for r in active)) if active else 1.0
    for row in stats:
        rn, rf = int(row["num_requests"]), int(row["num_failures"])
        n, failures = n + rn, failures + rf
        for k, v in row["response_times"].items():
            agg_times[float(k)] = agg_times.get(float(k), 0) + int(v)
        lines.append(f"{row['name']:<10} {rn:>6} {rf:>6} {rn / max(span, 1e-3):>7.1f} "
                     f"{percentile_ms(row['response_times'], 0.5):>8.0f} {percentile_ms(row['response_times'], 0.99):>8.0f}")
    if n == 0:
        return False, "no requests were made"
    p99 = percentile_ms(agg_times, 0.99)
    rate = failures / n
    ok = rate <= max_error_rate and p99 <= max_p99_ms
    lines.append(f"all: {n} requests, error rate {rate:.4%} (max {max_error_rate:.4%}), p99 {p99:.0f} ms "
                 f"(max {max_p99_ms:.0f} ms): {'PASS' if ok else 'FAIL'}")
    return ok, "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start_server() -> tuple[subprocess.Popen, str]:
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1", "--port", str(port),
                             "--log-level", "warning"], cwd=HERE.parent)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/readyz", timeout=2) as r:
                if r.status == 200:
                    return proc, url
        except OSError:
            time.sleep(0.2)
    proc.terminate()
    raise SystemExit("server did not become ready")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--scenario", choices=sorted(SCENARIOS), default="mixed")
    ap.add_argument("--host", default="http://127.0.0.1:8000")
    ap.add_argument("--users", type=int, default=4)
    ap.add_argument("--spawn-rate", type=float, default=None, help="users started per second [all at once]")
    ap.add_argument("--run-time", default="20s", help="locust duration, e.g. 10s, 2m")
    ap.add_argument("--max-error-rate", type=float, default=0.001)
    ap.add_argument("--max-p99-ms", type=float, default=2000.0)
    ap.add_argument("--start-server", action="store_true", help="start `convserve serve` on a free port")
    ap.add_argument("--csv-dir", default=None, help="keep locust's CSVs here [a temporary folder, removed at the end]")
    args = ap.parse_args(argv)
    if args.users < 1 or args.users > 256:
        ap.error("--users must be 1..256")

    proc = None
    host = args.host
    if args.start_server:
        proc, host = _start_server()
    if urlparse(host).hostname not in LOCAL_HOSTS:
        ap.error(f"load tests run against localhost only, not {host}")
    # without --csv-dir locust's files go to a temporary folder that is removed however the run
    # ends (failure, exception, Ctrl-C): repeated runs must not pile up folders in /tmp
    scratch = tempfile.TemporaryDirectory(prefix="convserve-locust-") if not args.csv_dir else None
    try:
        out_dir = Path(args.csv_dir or scratch.name)
        out_dir.mkdir(parents=True, exist_ok=True)
        prefix = out_dir / args.scenario
        cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless",
               "-u", str(args.users), "-r", str(args.spawn_rate or args.users), "-t", args.run_time,
               "--host", host, "--csv", str(prefix), "--json-file", str(prefix), "--only-summary",
               "--stop-timeout", "10", "--exit-code-on-error", "0", SCENARIOS[args.scenario]]
        print("running:", " ".join(cmd), flush=True)
        rc = subprocess.run(cmd, env={**os.environ}).returncode
        if rc != 0:
            print(f"locust exited {rc}", file=sys.stderr)
            return 1
        stats = json.loads(Path(f"{prefix}.json").read_text())
        ok, report = check_stats(stats, args.max_error_rate, args.max_p99_ms)
        print(report)
        return 0 if ok else 1
    finally:
        if scratch is not None:
            scratch.cleanup()
        if proc is not None:
            proc.terminate()
            proc.wait(30)


if __name__ == "__main__":
    # SIGTERM (a CI timeout, `kill`) as an exit, so the finally above still removes the scratch
    # folder and stops the server it started
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    sys.exit(main())
