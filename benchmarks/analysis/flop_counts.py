"""How much arithmetic a decode is, and so the least time it can take: the diffusers class's
forward counted by torch.utils.flop_counter on the meta device (no weights, no compute, any size),
for the workloads whose targets sit near that floor (the 2026 VAE families: TAESD 1024x1024 in 1 ms on an H100
and 100 ms on 2 CPU cores; Wan 2.2 121x704x1280 at 2x PyTorch eager; the sharded decode: Wan 2.1 81x480x832
in 0.5 s on 2 GPUs), and SD-VAE 512 for scale.

The floor is FLOPs / peak: `--peak-tflops` (default 989, an H100 or H200 SXM's dense float16 and
bfloat16 tensor-core rate) for the GPU; for the CPU, the CI machine's 2 cores (Sapphire Rapids,
2.6 GHz) in float32 on AVX-512 (`--cpu-gflops`, default 2 cores x 2 FMA units x 16 lanes x 2 x
3 GHz = 384) and in bfloat16 on AMX (`--amx-tflops`, default 2 cores x 1024 per cycle x 2.6 GHz
= 5.3), both above what any kernel sustains.

Run: python benchmarks/analysis/flop_counts.py [--peak-tflops 989] [--cpu-gflops 384] [--amx-tflops 5.3]
[--layers 3] (each workload's conv shapes with the most FLOPs).
Needs torch and diffusers (the test extra); no GPU.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo


def count(build, latents_shape) -> tuple[float, dict[str, float], Counter]:
    """(total FLOPs, FLOPs by op, conv FLOPs by (in channels, out channels, kernel, output rows x
    columns)) of build().decode(latents) on the meta device."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode

    with torch.device("meta"):
        vae = build().eval()
        z = torch.empty(latents_shape)
    convs: Counter = Counter()

    def conv_flops(module, inputs, out):
        w = module.weight
        kernel = tuple(int(k) for k in w.shape[2:])
        convs[(int(w.shape[1]) * module.groups, int(w.shape[0]), kernel, tuple(out.shape[-2:]))] += \
            2 * out.numel() * int(w.shape[1]) * math.prod(kernel)

    for m in vae.modules():
        if isinstance(m, (torch.nn.Conv2d, torch.nn.Conv3d)):
            m.register_forward_hook(conv_flops)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        vae.decode(z)
    return counter.get_total_flops(), {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}, convs


def wan22():
    import diffusers

    from models.wan22_vae import PRESETS
    arch = {k: v for k, v in PRESETS["wan2.2-vae"].items() if k not in ("scale_factor_temporal", "scale_factor_spatial")}
    return diffusers.AutoencoderKLWan(**arch)


def wan21():
    import diffusers

    from models.wan_vae import PRESETS
    return diffusers.AutoencoderKLWan(**{k: v for k, v in PRESETS["wan2.1-vae"].items()
                                         if k not in ("latents_mean", "latents_std")})


def sd():
    import diffusers

    from models.autoencoder_kl import PRESETS
    return diffusers.AutoencoderKL(**PRESETS["sd-vae"])


def taesd():
    import diffusers
    return diffusers.AutoencoderTiny()


WORKLOADS = [("TAESD decode 1024x1024", taesd, (1, 4, 128, 128)),
             ("TAESD decode 512x512", taesd, (1, 4, 64, 64)),
             ("SD-VAE decode 512x512", sd, (1, 4, 64, 64)),
             ("Wan 2.1 decode 81x480x832", wan21, (1, 16, 21, 60, 104)),
             ("Wan 2.2 decode 121x704x1280", wan22, (1, 48, 31, 44, 80))]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peak-tflops", type=float, default=989.0)
    ap.add_argument("--cpu-gflops", type=float, default=384.0)
    ap.add_argument("--amx-tflops", type=float, default=5.3)
    ap.add_argument("--layers", type=int, default=0, help="also list each workload's N conv shapes with the most FLOPs")
    args = ap.parse_args()
    layers = []
    print("| workload | GFLOP | of it convolution | GPU floor | CPU floor, float32 | CPU floor, AMX bfloat16 |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name, build, shape in WORKLOADS:
        total, by_op, convs = count(build, shape)
        layers += [(name, key, n / total) for key, n in convs.most_common(args.layers)]
        conv = by_op.get("aten.convolution", 0.0)
        print(f"| {name} | {total / 1e9:,.1f} | {conv / total:.1%} | {seconds(total / (args.peak_tflops * 1e12))} | "
              f"{seconds(total / (args.cpu_gflops * 1e9))} | {seconds(total / (args.amx_tflops * 1e12))} |")

    if layers:
        print("\n| workload | conv in -> out channels, kernel, output rows x columns | share of the FLOPs |")
        print("| --- | --- | --- |")
        for name, (cin, cout, kernel, rows_cols), share in layers:
            print(f"| {name} | {cin} -> {cout}, {'x'.join(map(str, kernel))}, {'x'.join(map(str, rows_cols))} | {share:.1%} |")


def seconds(s: float) -> str:
    return f"{s * 1e3:.2f} ms" if s < 0.01 else f"{s * 1e3:.0f} ms" if s < 1 else f"{s:,.2f} s"


if __name__ == "__main__":
    main()
