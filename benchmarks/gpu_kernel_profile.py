"""Which GPU kernels one decode spends its device time in: ours (CuPy, cuDNN, our CUDA C) beside the
diffusers class on PyTorch eager, from one CUPTI trace each (torch.profiler sees every kernel the
process launches, CuPy's included).

For the workloads whose speed target was missed (issue #31: Wan 2.2 720p at 1.57x eager where 2x
is asked, TAESD 1024^2 at 2.7 ms where 1 ms is asked), this says where the time goes before any of
it is changed: kernels grouped by name, total device ms, launches, and the share of the whole.

Run (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/gpu_kernel_profile.py
[--only taesd,wan22] [--wan22-latent 31x44x80] [--top 18]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from machine import describe_machine  # noqa: E402  (loads torch before convkernels, see machine.py)


def kernel_table(fn, top: int, label: str) -> None:
    """Runs fn once under the CUDA profiler and prints its kernels, largest total first."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    totals: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        t = totals.setdefault(ev.name[:90], [0.0, 0])
        t[0] += ev.device_time_total / 1e3  # ms
        t[1] += 1
    whole = sum(v[0] for v in totals.values()) or 1.0
    print(f"\n## {label}: {whole:.1f} ms of device time in {sum(v[1] for v in totals.values())} kernels")
    for name, (ms, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[:top]:
        print(f"{ms:9.2f} ms {100 * ms / whole:5.1f}% {n:6d}x  {name}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="taesd,wan22")
    ap.add_argument("--wan22-latent", default="31x44x80")
    ap.add_argument("--top", type=int, default=18)
    args = ap.parse_args()
    only = set(args.only.split(","))

    import diffusers
    import torch

    from convkernels import get_backend
    from models import load_model

    torch.backends.cudnn.benchmark = True
    rng = np.random.default_rng(0)
    print(describe_machine(), torch.cuda.get_device_name())
    if "taesd" in only:
        lat = rng.standard_normal((1, 4, 128, 128)).astype(np.float32)
        model = load_model("taesd", "taesd", get_backend("cuda", dtype="float16"))
        for _ in range(3):
            model.decode(lat, tiled=False)
        kernel_table(lambda: model.decode(lat, tiled=False), args.top, "ours: taesd 1024x1024 fp16")
        vae = diffusers.AutoencoderTiny().to("cuda", torch.float16).eval()
        z = torch.from_numpy(lat).to("cuda", torch.float16)
        with torch.inference_mode():
            vae.decode(z)
            kernel_table(lambda: vae.decode(z), args.top, "torch eager: AutoencoderTiny 1024x1024 fp16")
        model = vae = None
    if "wan22" in only:
        from models.wan22_vae import PRESETS as WAN22

        t, h, w = map(int, args.wan22_latent.split("x"))
        lat = rng.standard_normal((1, 48, t, h, w)).astype(np.float32)
        model = load_model("wan22", "wan2.2-vae", get_backend("cuda", dtype="bfloat16"))
        model.decode(lat, tiled=False, uint8=True)
        model.decode(lat, tiled=False, uint8=True)
        kernel_table(lambda: model.decode(lat, tiled=False, uint8=True), args.top,
                     f"ours: wan2.2 48x{t}x{h}x{w} bf16")
        model = None
        import cupy as cp
        cp.get_default_memory_pool().free_all_blocks()
        vae = diffusers.AutoencoderKLWan(**WAN22["wan2.2-vae"]).to("cuda", torch.bfloat16).eval()
        z = torch.from_numpy(lat).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            kernel_table(lambda: vae.decode(z), args.top, f"torch eager: AutoencoderKLWan 48x{t}x{h}x{w} bf16")


if __name__ == "__main__":
    main()
