"""Cold vs warm start of a real server: time to /readyz, then the first, second and third request
of one size (the plan cache: "a restarted server's first request must not autotune again"; first calls:
the first request of a new SD-VAE 512 shape within 10 s on the GPU, and on CUDA the second request
captures the forward as a CUDA graph, the third replays it).

Four starts, one after the other:
  no-dir  no CONVSERVE_PLAN_CACHE_DIR at all (nothing persists)
  cold    an empty plan-cache directory (CUDA builds, and with autotune times, the plans)
  warm    the same directory again (CUDA loads the serialized plans)
  warm+   the same directory and CONVSERVE_WARMUP_SIZES=<size>: the size runs before ready
The NumPy backend keeps its measured path choices in the same directory (one JSON file per machine
fingerprint), so its warm start skips the measuring too.

    python benchmarks/service/cold_start.py                                   # CPU: sd-vae decode 256
    python benchmarks/service/cold_start.py --backend cuda --models sd=sd-vae --size 512
    python benchmarks/service/cold_start.py --backend cuda --models enc=convnext-tiny --model enc --size 224
"""
from __future__ import annotations

import argparse
import io
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
from server_process import ServerProcess  # noqa: E402


def request(url: str, model: str, size: int) -> float:
    """Seconds for one request of `size` (decoders: latents for a size x size image)."""
    card = httpx.get(f"{url}/v1/models/{model}", timeout=60).json()
    rng = np.random.default_rng()
    buf = io.BytesIO()
    if card.get("kind") == "image-encoder":
        np.save(buf, rng.integers(0, 256, (size, size, 3), dtype=np.uint8))
        path = "encode"
    else:
        f = int(card.get("spatial_factor") or card.get("config", {}).get("spatial_factor", 8))
        c = int(card.get("latent_channels") or card.get("config", {}).get("latent_channels", 4))
        np.save(buf, rng.standard_normal((1, c, size // f, size // f)).astype(np.float32))
        path = "decode"
    t0 = time.perf_counter()
    r = httpx.post(f"{url}/v1/models/{model}/{path}", content=buf.getvalue(),
                   headers={"content-type": "application/x-npy"}, params={"format": "npy"} if path == "decode" else None,
                   timeout=3600)
    r.raise_for_status()
    return time.perf_counter() - t0


def plan_builds(url: str) -> str:
    """How many conv keys were built (or loaded) since start and the seconds that took, from the
    server's own convkernels_plan_build_seconds histogram: what a cold first request pays for."""
    from prometheus_client.parser import text_string_to_metric_families

    count = total = 0.0
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=60).text):
        for s in fam.samples:
            if s.name == "convkernels_plan_build_seconds_count":
                count += s.value
            elif s.name == "convkernels_plan_build_seconds_sum":
                total += s.value
    return f"{int(count)} keys in {total:.1f} s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--backend", default="numpy")
    ap.add_argument("--models", default="sd=sd-vae", help="CONVSERVE_MODELS")
    ap.add_argument("--model", default="sd", help="the served name to request")
    ap.add_argument("--size", type=int, default=256)
    ap.add_argument("--plan-cache-dir", help="default: a fresh temporary directory")
    ap.add_argument("--log", help="server log file")
    args = ap.parse_args()
    cache = args.plan_cache_dir or tempfile.mkdtemp(prefix="convserve-plans-")
    base = dict(models=args.models, backend=args.backend, plan_cache_dir=cache, request_timeout_s=3600)
    if args.backend == "cuda":
        base["cuda_autotune"] = 1  # CONVSERVE_CUDA_AUTOTUNE, passed to the CUDA backend: the cold start pays for the measured plans
    no_dir = {k: v for k, v in base.items() if k != "plan_cache_dir"}
    rows = []
    for label, settings in (("no-dir", no_dir), ("cold", base), ("warm", base),
                            ("warm+", {**base, "warmup_sizes": str(args.size)})):
        log = f"{args.log}.{label}" if args.log else None  # one log per start, at INFO
        with ServerProcess(timeout=3600, log_path=log, log_level="info", **settings) as srv:
            times = [request(srv.url, args.model, args.size) for _ in range(3)]
            built = plan_builds(srv.url)
        rows.append((label, srv.ready_s, *times))
        print(f"{label:6s} ready {srv.ready_s:8.2f} s   requests {times[0]:8.2f} s, {times[1]:8.3f} s, "
              f"{times[2]:8.3f} s   plan builds/loads {built}", flush=True)
    from benchmarks.machine import describe_machine
    print(f"machine: {describe_machine()}")
    print(f"{args.models} on {args.backend}, {args.size}x{args.size}, plan cache {cache}")
    print("| start | time to ready s | first request s | second request s | third request s |")
    print("| --- | --- | --- | --- | --- |")
    for label, ready, first, second, third in rows:
        print(f"| {label} | {ready:.2f} | {first:.2f} | {second:.3f} | {third:.3f} |")


if __name__ == "__main__":
    main()
