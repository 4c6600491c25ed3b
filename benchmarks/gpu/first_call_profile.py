"""Where the first call of a new shape spends its time on the GPU (the first-call bound: the first SD-VAE 512
request of a server with no plan cache must take <= 10 s): one fresh process per case runs
`model.decode` once under cProfile and prints its wall time and the functions that took longest.

Cases: autotune on and off; each with an empty CuPy kernel cache (CUPY_CACHE_DIR in a temporary
folder, so NVRTC compiles every elementwise/raw kernel) and with the one the first case filled.

Run: PYTHONPATH=. python3 benchmarks/gpu/first_call_profile.py [--preset sd-vae] [--size 64] [--top 18]
"""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import cProfile, pstats, sys, time
import numpy as np
from convkernels import get_backend
from models import load_model
preset, size, autotune, top = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])
be = get_backend("cuda", dtype="float16", autotune=autotune)
model = load_model("m", preset, be)
lat = np.random.default_rng(0).standard_normal((1, model.latent_channels, size, size)).astype(np.float32)
prof = cProfile.Profile()
t0 = time.perf_counter()
prof.enable()
model.decode(lat, tiled=False)
prof.disable()
print(f"first decode {time.perf_counter() - t0:.2f} s; plan cache {be.plan_cache_stats()}")
t0 = time.perf_counter()
model.decode(lat, tiled=False)
print(f"second decode (captures the graph) {time.perf_counter() - t0:.3f} s")
st = pstats.Stats(prof)
st.sort_stats("cumulative").print_stats(top)
st.sort_stats("tottime").print_stats(top)
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="sd-vae")
    ap.add_argument("--size", type=int, default=64, help="latent side (64 -> a 512x512 image)")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    kernel_cache = tempfile.mkdtemp(prefix="cupy-cache-")
    for autotune in ("1", "0"):
        for label in ("empty CuPy kernel cache", "warm CuPy kernel cache"):
            cache = tempfile.mkdtemp(prefix="cupy-cache-") if label.startswith("empty") else kernel_cache
            print(f"\n===== {args.preset} latents {args.size}x{args.size}, autotune {autotune}, {label}", flush=True)
            env = {**os.environ, "CUPY_CACHE_DIR": cache}
            subprocess.run([sys.executable, "-c", CHILD, args.preset, str(args.size), autotune, str(args.top)],
                           env=env, check=False, timeout=600)
            if label.startswith("empty"):
                kernel_cache = cache


if __name__ == "__main__":
    main()
