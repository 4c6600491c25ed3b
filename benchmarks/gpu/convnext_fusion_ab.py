"""A/B of the ConvNeXt block fusions on the CUDA backend: ConvNeXt-T 224 fp16,
graphed, pixels already on the device, at batch 1, 32 and 128, with each switch on and off in one
run, against PyTorch eager (timm convnext_tiny, else transformers ConvNextModel; fp16,
channels-last) on the same GPU. Prints median ms, images/s, ratio ours / PyTorch (below 1 = we are
faster), summed GPU kernel time (CUPTI) and the kernel launches per forward.

Switches (CudaOptions fields; every configuration gets a fresh backend and model;
a server takes them as CONVSERVE_CUDA_<NAME> settings):
- lt_epilogues: fc1 bias + GELU and fc2 bias + residual inside cuBLASLt's GEMM
  (cuda/blas_lt.py) instead of cuBLAS + the `epilogue` kernel
- lt_gelu_approx: cuBLASLt's tanh GELU for ConvNeXt's erf GELU (off: fc1 unfused)
- ln_vec: LayerNorm with the row in registers (ln_rows_vec) instead of ln_rows
- dw_bias_in_ln: the depthwise conv runs without its bias, which the LayerNorm
  kernel adds as it reads the conv output (instead of cuDNN fusing it, or not)
- dw_ln (off by default): the block's depthwise conv + bias and its LayerNorm as
  one kernel (dw_ln, a warp per pixel) instead of cuDNN's conv + ln_rows_vec

Run: PYTHONPATH=. python3 benchmarks/gpu/convnext_fusion_ab.py [--reps 20] [--batches 1,32,128]
Writes $OUT/convnext_fusion_ab.json when OUT is set.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time

import numpy as np

CONFIGS = [  # name, CudaOptions fields (the rest at their defaults)
    ("all fusions (default)", {}),
    ("exact GELU (fc1 unfused)", {"lt_gelu_approx": False}),
    ("no cuBLASLt epilogues", {"lt_epilogues": False}),
    ("no vectorised LayerNorm", {"ln_vec": False}),
    ("dw bias in the conv, not the norm", {"dw_bias_in_ln": False}),
    ("+ dw conv + LayerNorm fused", {"dw_ln": True}),
    ("none (main before the fusions)", {"lt_epilogues": False, "ln_vec": False, "dw_bias_in_ln": False}),
]


def device_ms(fn, reps, cp):
    for _ in range(3):
        fn()
    cp.cuda.get_current_stream().synchronize()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        cp.cuda.get_current_stream().synchronize()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def kernels(fn, sync):
    """(summed kernel ms, kernel launches) of one call, from CUPTI (copies and memsets excluded)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        sync()
    us, count = 0.0, 0
    for ev in prof.key_averages():
        if ev.key.startswith(("Memcpy", "Memset")) or "memcpy" in ev.key.lower():
            continue
        us += getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
        count += ev.count
    return us / 1e3, count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--batches", default="1,32,128")
    args = ap.parse_args()
    import cupy as cp
    import torch

    from convkernels.backends.cuda.backend import CudaBackend
    from convkernels.backends.cuda.options import CudaOptions
    from models import load_model

    batches = [int(b) for b in args.batches.split(",")]
    rng = np.random.default_rng(0)
    pixels = {n: rng.random((n, 224, 224, 3), dtype=np.float32) for n in batches}
    gpu = torch.cuda.get_device_name()
    print(f"ConvNeXt-T 224 fp16 on {gpu}, graphed forward, pixels on the device; median of {args.reps}")

    peer = {}
    try:
        import timm
        net, peer_name = timm.create_model("convnext_tiny", pretrained=False), "timm convnext_tiny"
    except Exception:
        import transformers
        net, peer_name = transformers.ConvNextModel(transformers.ConvNextConfig()), "transformers ConvNextModel"
    net = net.to("cuda", torch.half).to(memory_format=torch.channels_last).eval()
    tsync = torch.cuda.synchronize
    with torch.inference_mode():
        for n in batches:
            x = torch.from_numpy(pixels[n]).permute(0, 3, 1, 2).to("cuda", torch.half).contiguous(
                memory_format=torch.channels_last)
            for _ in range(3):
                net(x)
            tsync()
            ts = []
            for _ in range(args.reps):
                t0 = time.perf_counter()
                net(x)
                tsync()
                ts.append(1e3 * (time.perf_counter() - t0))
            peer[n] = (statistics.median(ts), *kernels(lambda: net(x), tsync))
            print(f"  PyTorch eager ({peer_name}) n{n}: {peer[n][0]:.3f} ms, kernels {peer[n][1]:.3f} ms "
                  f"({peer[n][2]} launches), {n / peer[n][0] * 1e3:.0f} img/s", flush=True)
    net = None  # frees its memory before our runs
    torch.cuda.empty_cache()

    rows = []
    for name, options in CONFIGS:
        be = CudaBackend(CudaOptions(dtype="float16", cuda_graphs=True, **options))
        model = load_model("cnx", "convnext-tiny", be)
        for n in batches:
            xd = be.asarray(pixels[n])
            ms = device_ms(lambda: model._encode_device(xd), args.reps, cp)
            kms, launches = kernels(lambda: model._encode_device(xd), cp.cuda.get_current_stream().synchronize)
            row = dict(config=name, batch=n, ms=ms, img_s=n / ms * 1e3, kernel_ms=kms, launches=launches,
                       peer_ms=peer[n][0], peer_kernel_ms=peer[n][1], ratio=ms / peer[n][0],
                       kernel_ratio=kms / peer[n][1], graph=model._encode_device.stats()["ungraphable"] == {})
            rows.append(row)
            print(f"{name:28s} n{n:<4d} {ms:8.3f} ms {row['img_s']:8.0f} img/s  ours/PyTorch {row['ratio']:.2f}  "
                  f"kernels {kms:.3f} ms ({launches} launches) ours/PyTorch {row['kernel_ratio']:.2f}"
                  f"{'' if row['graph'] else '  NOT CAPTURED'}", flush=True)
        model = be = None
        gc.collect()
        cp.get_default_memory_pool().free_all_blocks()
    out = os.environ.get("OUT")
    if out:
        with open(os.path.join(out, "convnext_fusion_ab.json"), "w") as f:
            json.dump(dict(gpu=gpu, peer=peer_name, rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
