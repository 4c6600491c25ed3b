"""Where a streamed Wan 2.1 decode's first frame group spends its time on the GPU (the streamed decode's
"first group <= 0.1 s" target): the latents' host preparation, the first chunk's ops queued by the host
(the time until `_decode_chunk` returns), its wait for the device, and the same chunk's summed
kernel time with the costliest kernels (gpu_models.kernel_ms: CUPTI, memcpys not counted; the
run of 2026-11-25 02:57 counted them, 0.7 of its 6.1 ms). Queueing close to the
whole chunk means the host's launches are the bound; kernel time close to it, the GPU.

    PYTHONPATH=. python3 benchmarks/gpu/wan_first_chunk.py [--dtype float16] [--shape 21x60x104] [--reps 5]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
from gpu_models import kernel_ms  # noqa: E402 (benchmarks/gpu/ is the script's directory)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtype", default="float16", help="the streaming benchmark's server runs float16")
    ap.add_argument("--shape", default="21x60x104", help="latent frames x height x width")
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    import cupy as cp

    from convkernels import get_backend
    from models import load_model
    from models.contract import PIXEL_RANGE
    from models.wan_vae.layers import FeatureCache

    be = get_backend("cuda", dtype=args.dtype)
    model = load_model("wan", "wan2.1-vae", be)
    t, h, w = (int(v) for v in args.shape.split("x"))
    lat = np.random.default_rng(0).standard_normal((1, 16, t, h, w)).astype(np.float32)
    sync = cp.cuda.get_current_stream().synchronize

    def first_chunk(z):
        t0 = time.perf_counter()
        pending = model._decode_chunk(z[:, :1], FeatureCache(), clip=PIXEL_RANGE)
        queued = time.perf_counter()
        pending.result()
        return 1e3 * (queued - t0), 1e3 * (time.perf_counter() - t0)

    z = model._prepare(lat)
    for _ in range(2):  # plans, kernels compiled
        first_chunk(z)
    prep, queue, whole = [], [], []
    for _ in range(args.reps):
        sync()
        t0 = time.perf_counter()
        z = model._prepare(lat)
        prep.append(1e3 * (time.perf_counter() - t0))
        q, c = first_chunk(z)
        queue.append(q)
        whole.append(c)
    rows = []
    kernels = kernel_ms(lambda: first_chunk(z), sync, reps=1, top=rows)
    med = statistics.median
    print(f"# Wan 2.1 first chunk, latents 1x16x{args.shape}, {args.dtype}, {be.describe().get('gpu')}, "
          f"median of {args.reps}")
    print(f"host prepare {med(prep):.2f} ms | first chunk queued {med(queue):.2f} ms | first chunk to host "
          f"{med(whole):.2f} ms | its kernels {kernels:.2f} ms (memcpys not counted)")
    for name, n, us in rows[:15]:
        print(f"{us:10.1f} us {n:5.0f}x  {name}")


if __name__ == "__main__":
    main()
