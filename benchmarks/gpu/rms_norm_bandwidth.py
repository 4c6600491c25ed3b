"""The CUDA backend's RMS norm + SiLU (Wan's norm, before every causal conv of the decoder) against
PyTorch's, at the Wan 2.2 720p decoder's shapes, one GPU, in one process: time (CUDA events, median
of --reps after warm-up) and the bytes moved (one read and one write of x) per second.

PyTorch's is the diffusers WanRMS_norm forward, F.normalize(x, dim=-1) * sqrt(C) * gamma, then
F.silu: eager, and torch.compile'd (one fused kernel) unless --no-compile. Ours is one kernel
(shuffle-free rms_rows_vec where a row is whole 16-byte vectors). Ratios are PyTorch's time / ours.

Run (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/gpu/rms_norm_bandwidth.py [--reps 30]
[--dtypes bfloat16,float16,float32] [--no-compile]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # this group's scripts; the repo (benchmarks.machine)
from gpu_ops import CpEvents, TorchEvents, bench  # noqa: E402  (the shared CUDA-event timing)
from benchmarks.machine import describe_machine  # noqa: E402

#: (label, N x T, H, W, C): the 720p decoder's norm inputs over a chunk of 4 frames, and one frame
SHAPES = [
    ("wan2.2 720p 352x640, 256 ch, 4 frames", 4, 352, 640, 256),
    ("wan2.2 720p 176x320, 512 ch, 4 frames", 4, 176, 320, 512),
    ("wan2.2 720p 88x160, 1024 ch, 4 frames", 4, 88, 160, 1024),
    ("wan2.2 720p 352x640, 256 ch, 1 frame", 1, 352, 640, 256),
    ("wan2.1 480p 480x832, 96 ch, 4 frames", 4, 480, 832, 96),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--dtypes", default="bfloat16,float16,float32")
    ap.add_argument("--no-compile", action="store_true")
    args = ap.parse_args()

    import cupy as cp
    import torch
    import torch.nn.functional as F

    from convkernels import get_backend

    def torch_norm(x, g):
        return F.silu(F.normalize(x, dim=-1) * (x.shape[-1] ** 0.5) * g)

    compiled = None if args.no_compile else torch.compile(torch_norm)
    tev = TorchEvents(torch)
    print(f"# RMS norm + SiLU, {describe_machine()}, {torch.cuda.get_device_name()}; ratios are PyTorch's time / ours")
    print("| shape | dtype | ours ms | ours GB/s | eager ms | eager / ours | compile ms | compile / ours | max abs diff vs eager |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    rng = np.random.default_rng(0)
    for dt in args.dtypes.split(","):
        be = get_backend("cuda", dtype=dt)
        tdt = getattr(torch, dt)
        for label, n, h, w, c in SHAPES:
            host = rng.standard_normal((n, h, w, c)).astype(np.float32)
            gamma = rng.uniform(0.5, 1.5, c).astype(np.float32)
            x, g = be.asarray(host), be.asarray(gamma)
            eps = 1e-24 / c  # F.normalize's 1e-12 floor on the norm, as models/wan_vae/layers.py
            ms = bench(lambda: be.rms_norm(x, g, eps, "silu"), CpEvents(cp), reps=args.reps)
            ours = np.asarray(be.to_host(be.rms_norm(x, g, eps, "silu")), np.float32)
            tx = torch.from_numpy(host).cuda().to(tdt)
            tg = torch.from_numpy(gamma).cuda().to(tdt)
            eager = bench(lambda: torch_norm(tx, tg), tev, reps=args.reps)
            ref = torch_norm(tx, tg).float().cpu().numpy()
            comp = bench(lambda: compiled(tx, tg), tev, reps=args.reps) if compiled else float("nan")
            gb = 2 * host.size * np.dtype(np.float32 if dt == "float32" else np.float16).itemsize / 1e6
            print(f"| {label} | {dt} | {ms:.3f} | {gb / ms:.0f} | {eager:.3f} | {eager / ms:.2f} | "
                  f"{comp:.3f} | {comp / ms:.2f} | {np.abs(ours - ref).max():.2e} |", flush=True)


if __name__ == "__main__":
    main()
