"""Wan 2.1 video VAE decode on the NumPy backend vs diffusers' AutoencoderKLWan on PyTorch CPU,
same random weights, same run, interleaved (the CI box is shared: the ratio is what counts).
Prints ours vs torch per shape (torch/ours > 1 means we are faster), our time to the first
frame group (the streaming hook), and the parity error.

    python benchmarks/cpu/wan_cpu.py [--preset tiny-wan-vae] [--shapes 4x16x16] [--reps 3]
    python benchmarks/cpu/wan_cpu.py --preset wan2.1-vae --shapes 2x8x8 --reps 1
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
from benchmarks.machine import describe_machine  # noqa: E402

from convkernels import get_backend  # noqa: E402
from models.wan_vae import PRESETS, WanVAEConfig, WanVAEDecoder  # noqa: E402


def reference(preset: str):
    """diffusers AutoencoderKLWan with the preset's config and its own random init."""
    import torch
    import diffusers
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(**PRESETS[preset]).eval(), torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="tiny-wan-vae", choices=sorted(PRESETS))
    ap.add_argument("--shapes", nargs="+", default=["4x16x16"], help="latent TxHxW")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    args = ap.parse_args()

    ref, torch = reference(args.preset)
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = WanVAEConfig.from_dict(PRESETS[args.preset])
    tensors = {k: v.detach().numpy() for k, v in ref.state_dict().items()}
    ours = WanVAEDecoder("bench", args.preset, get_backend("numpy"), cfg, tensors, weights_source="torch")
    mean = torch.tensor(cfg.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(cfg.latents_std).view(1, -1, 1, 1, 1)

    print(f"machine: {describe_machine()}")
    print(f"model: {args.preset} (diffusers AutoencoderKLWan decode, fp32) — ours: numpy backend, "
          f"channels-last; median of {args.reps} after a warm-up, interleaved")
    print(f"{'latents TxHxW':>13s} {'frames':>12s} {'ours s':>8s} {'torch s':>8s} {'torch/ours':>10s} "
          f"{'ours 1st grp s':>14s} {'rel L2':>9s}")
    rng = np.random.default_rng(0)
    for shape in args.shapes:
        t, h, w = (int(v) for v in shape.split("x"))
        lat = rng.standard_normal((1, cfg.z_dim, t, h, w)).astype(np.float32)
        z = torch.from_numpy(lat) * std + mean

        def run_torch():
            with torch.inference_mode():
                return ref.decode(z).sample

        got = ours.decode(lat)
        want = (run_torch() / 2 + 0.5).permute(0, 2, 3, 4, 1).numpy()
        err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
        ts_ours, ts_torch, ts_first = [], [], []
        for _ in range(args.reps):  # interleave so load from other jobs hits both sides alike
            t0 = time.perf_counter()
            gen = ours.decode_frames(lat)
            next(gen)
            ts_first.append(time.perf_counter() - t0)
            for _ in gen:
                pass
            ts_ours.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            run_torch()
            ts_torch.append(time.perf_counter() - t0)
        o, tt, f = (statistics.median(v) for v in (ts_ours, ts_torch, ts_first))
        frames = f"{got.shape[1]}x{got.shape[2]}x{got.shape[3]}"
        print(f"{shape:>13s} {frames:>12s} {o:8.2f} {tt:8.2f} {tt / o:10.2f} {f:14.2f} {err:9.2e}")


if __name__ == "__main__":
    main()
