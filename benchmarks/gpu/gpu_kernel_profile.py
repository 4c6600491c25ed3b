"""Which GPU kernels one decode spends its device time in: ours (CuPy, cuDNN, our CUDA C) beside the
diffusers class on PyTorch eager, from one CUPTI trace each (torch.profiler sees every kernel the
process launches, CuPy's included).

For the workloads whose speed target was missed (the 2026 VAE families: Wan 2.2 720p at 1.57x eager where 2x
is asked, TAESD 1024^2 at 2.7 ms where 1 ms is asked), this says where the time goes before any of
it is changed: kernels grouped by name, total device ms, launches, and the share of the whole.

Run (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/gpu/gpu_kernel_profile.py
[--only taesd,wan22,dcae,shardpath,hyimage,qwen21,ltx2,hv15] [--wan22-latent 31x44x80] [--top 18] [--autotune] (ours with timed
cuDNN plans, the service's CONVSERVE_CUDA_AUTOTUNE: which kernels the timing picks over cuDNN's
heuristic choice)

shardpath (the sharded decode): Wan 2.1's decode on a row shard (models/sharding, models/nn/row_shard.py) run as one shard of
the whole rows beside the unsharded decode, both eager (no CUDA graphs), same latents: a sharded
decode on N GPUs can only approach 1/N of one GPU's time if its path costs what the unsharded one
does on the same rows; the table says where it does not.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # this group's scripts; the repo (benchmarks.machine)
from benchmarks.machine import describe_machine  # noqa: E402  (loads torch before convkernels, see machine.py)


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
    ap.add_argument("--wan21-latent", default="8x60x104", help="shardpath's latents TxHxW (Wan 2.1 480p rows)")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--autotune", action="store_true", help="ours with timed cuDNN plans")
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
        model = load_model("taesd", "taesd", get_backend("cuda", dtype="float16", autotune=args.autotune))
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
        model = load_model("wan22", "wan2.2-vae", get_backend("cuda", dtype="bfloat16", autotune=args.autotune))
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
    if "dcae" in only:
        dc_ae(args, rng)
    if "shardpath" in only:
        shard_path(args, rng)
    for key in ("hyimage", "qwen21", "ltx2", "hv15"):
        if key in only:
            family_2026(args, rng, key)


def dc_ae(args, rng) -> None:
    """DC-AE f32c32 1024^2 bf16: ours at 79 ms against eager's 61 and torch.compile's 28 (one H200,
    2026-11-29), with 2.3x eager's memory. Ours eager (no CUDA graphs: each kernel named), the
    diffusers class from the same random weights."""
    import tempfile

    import diffusers
    import torch

    from convkernels import get_backend
    from models import PRESETS, load_model

    lat = rng.standard_normal((1, 32, 32, 32)).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder:
        with torch.device("cuda"):
            vae = diffusers.AutoencoderDC(**PRESETS["dc-ae-f32c32"].config).eval()
        vae.save_pretrained(folder)
        model = load_model("dcae", "dc-ae-f32c32", get_backend("cuda", dtype="bfloat16", autotune=args.autotune,
                                                                cuda_options={"cuda_graphs": False}), weights=folder)
    for _ in range(2):
        model.decode(lat, tiled=False)
    kernel_table(lambda: model.decode(lat, tiled=False), args.top, "ours: dc-ae-f32c32 32x32x32 bf16, eager")
    model = None
    vae = vae.to(torch.bfloat16)
    z = torch.from_numpy(lat / np.float32(vae.config.scaling_factor)).to("cuda", torch.bfloat16)
    with torch.inference_mode():
        vae.decode(z)
        kernel_table(lambda: vae.decode(z), args.top, "torch eager: AutoencoderDC 32x32x32 bf16")


def family_2026(args, rng, key: str) -> None:
    """One of the 2026 VAEs at its target size (benchmarks/gpu/gpu_families_2026.py's row), bf16:
    ours eager (no CUDA graphs: each kernel named), then the diffusers class from the same random
    weights on PyTorch eager and, for an image VAE, under torch.compile (the contender an image row
    is held to). Qwen-Image 2.1 1328^2 took 98.0 ms against compile's 93.6 (one H200, 2026-11-29)
    with 70 ms of kernels: its host copies, since removed. A video row decodes whole (untiled, uint8,
    as the benchmark's) and its PyTorch side runs without cuDNN's algorithm search (at 720p its
    search had not ended after 500 s)."""
    import tempfile

    import diffusers
    import torch
    from gpu_families_2026 import ROWS, pipeline_input

    from convkernels import get_backend
    from models import PRESETS, load_model

    row = next(r for r in ROWS if r.family == key)
    lat = rng.standard_normal(row.latents).astype(np.float32)
    with tempfile.TemporaryDirectory() as folder:
        with torch.device("cuda"):
            vae = getattr(diffusers, row.reference)(**PRESETS[row.preset].config).eval()
        vae.save_pretrained(folder)
        model = load_model(key, row.preset, get_backend("cuda", dtype="bfloat16", autotune=args.autotune,
                                                         cuda_options={"cuda_graphs": False}), weights=folder)
    kw = dict(tiled=False, uint8=True) if row.video else dict(tiled=False)
    for _ in range(1 if row.video else 2):
        model.decode(lat, **kw)
    kernel_table(lambda: model.decode(lat, **kw), args.top, f"ours: {row.preset} {row.pixels} bf16, eager")
    model = None
    import cupy as cp
    cp.get_default_memory_pool().free_all_blocks()
    vae = vae.to(torch.bfloat16)
    z = torch.from_numpy(np.ascontiguousarray(pipeline_input(row, vae, lat))).to("cuda", torch.bfloat16)
    torch.backends.cudnn.benchmark = not row.video
    with torch.inference_mode():
        vae.decode(z)
        kernel_table(lambda: vae.decode(z), args.top, f"torch eager: {row.reference} {row.pixels} bf16")
        if row.video:
            return
        compiled = torch.compile(vae.decode)
        for _ in range(2):
            compiled(z)
        kernel_table(lambda: compiled(z), args.top, f"torch.compile: {row.reference} {row.pixels} bf16")


def shard_path(args, rng) -> None:
    import time

    from convkernels import get_backend
    from convkernels.collectives.shard_comm import run_sharded
    from models import load_model, sharding

    t, h, w = map(int, args.wan21_latent.split("x"))
    lat = rng.standard_normal((1, 16, t, h, w)).astype(np.float32)
    model = load_model("wan", "wan2.1-vae", get_backend("cuda", dtype="bfloat16", autotune=args.autotune,
                                                   cuda_options={"cuda_graphs": False}))

    def unsharded():
        return model.decode(lat, tiled=False)

    def one_shard():  # the sharded path's layer walk, halo exchanges with no neighbours (zero rows)
        return run_sharded(1, lambda comm, r: sharding.decode_band(model, comm, lat, h))[0]

    for label, fn in (("unsharded", unsharded), ("sharded path, one shard", one_shard)):
        fn()
        fn()
        t0 = time.perf_counter()
        fn()
        print(f"{label}: {1e3 * (time.perf_counter() - t0):.1f} ms wall, latents 16x{t}x{h}x{w} bf16", flush=True)
        kernel_table(fn, args.top, f"ours, {label}: wan2.1 16x{t}x{h}x{w} bf16, eager")
    a, b = unsharded(), one_shard()
    print(f"max |unsharded - sharded path| = {float(np.abs(a - b).max()):.2e}")


if __name__ == "__main__":
    main()
