"""The GPU rows of the 2026 VAE families (TAESD, FLUX.2, Qwen-Image, Wan 2.2) on the CUDA
backend against the diffusers class on PyTorch, eager and torch.compile, in one process.

Both sides use random weights (timing only; parity is in the GPU tests of each family, tests/gpu/).
The diffusers classes are built with their default configs, which are the published checkpoints'
(AutoencoderTiny = taesd, AutoencoderKLFlux2 = FLUX.2-dev, AutoencoderKLQwenImage = Qwen-Image), and
Wan 2.2 with the TI2V-5B config our preset holds.

What is timed: ours is `model.decode(latents)` from host latents to host pixels (uint8 where the
service would send uint8: Wan 2.2), so it includes both copies; PyTorch's is `vae.decode(z)` with z
on the device and the output left there. Memory: ours is the CuPy pool's peak in use during the call
plus the bytes the model's CUDA graphs hold in their own pool; PyTorch's is max_memory_allocated;
both less what was in use before.

Run (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/gpu/gpu_families.py [--only taesd,flux2,qwen,wan22]
[--compile] [--wan22-latent 31x44x80] [--reps 5] [--autotune] [--upsample-form auto]. Writes
$OUT/gpu_families_<sections>[_autotune][_<form>].json. --autotune times the candidate cuDNN plans
of every conv key on the first decode (the service's CONVSERVE_CUDA_AUTOTUNE; off by default
there and here); --upsample-form picks the upsamplers' form (CONVSERVE_CUDA_UPSAMPLE_FORM,
convkernels/backends/cuda/upsample.py).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # this group's scripts; the repo (benchmarks.machine)
import benchmarks.machine  # noqa: E402,F401  (loads torch before convkernels, see machine.py)
from family_bench import (FAMILY_COLUMNS, bench_env, graph_pool_gib, ours_peak_gib, print_table,  # noqa: E402
                          streamed_first_group_ms, torch_peak_gib, weights_gib)
from gpu_models import wall  # noqa: E402  (shared timing helper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="taesd,flux2,qwen,wan22")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (default mode)")
    ap.add_argument("--wan22-latent", default="31x44x80", help="T x h x w (31x44x80 = 121x704x1280)")
    ap.add_argument("--wan22-eager-reps", type=int, default=1)
    ap.add_argument("--autotune", action="store_true", help="ours with timed cuDNN plans (the service's default is off)")
    ap.add_argument("--upsample-form", default="auto", choices=["auto", "phases", "transposed"],
                    help="the upsamplers' form (the service's default: auto)")
    args = ap.parse_args()
    only = set(args.only.split(","))

    import cupy as cp
    import diffusers
    import torch

    from convkernels import get_backend
    from models import load_model

    torch.backends.cudnn.benchmark = True
    pool = cp.get_default_memory_pool()
    rng = np.random.default_rng(0)
    rows: list[dict] = []

    def csync():
        cp.cuda.get_current_stream().synchronize()

    def tsync():
        torch.cuda.synchronize()

    def row(name, ours_ms, eager_ms, compiled_ms=None, ours_gib=None, torch_gib=None, **extra):
        r = dict(workload=name, ours_ms=ours_ms, torch_eager_ms=eager_ms, torch_compile_ms=compiled_ms,
                 vs_eager=eager_ms / ours_ms, vs_compile=None if compiled_ms is None else compiled_ms / ours_ms,
                 ours_gib=ours_gib, torch_gib=torch_gib, **extra)
        rows.append(r)
        comp = f"  compile {compiled_ms:9.2f} ms ({compiled_ms / ours_ms:5.2f}x)" if compiled_ms else ""
        mem = f"  GiB ours {ours_gib:.2f} / torch {torch_gib:.2f}" if ours_gib is not None else ""
        print(f"{name:40s} ours {ours_ms:9.2f} ms  torch eager {eager_ms:9.2f} ms ({eager_ms / ours_ms:5.2f}x)"
              f"{comp}{mem}", flush=True)

    def compiled_ms(fn) -> float | None:
        if not args.compile:
            return None
        fc = torch.compile(fn)
        t0 = time.time()
        with torch.inference_mode():
            fc()
            tsync()
            print(f"  torch.compile first call {time.time() - t0:.1f} s", flush=True)
            return wall(fc, 2, args.reps, tsync)

    def image_family(label, preset, dtype, ref_vae, latent_shape, torch_latents=None, ours_kw=None):
        """One image decoder: ours vs the diffusers class at one shape, batch 1."""
        be = get_backend("cuda", dtype=dtype, autotune=args.autotune, upsample_form=args.upsample_form)
        model = load_model(label, preset, be)
        lat = rng.standard_normal(latent_shape).astype(np.float32)
        kw = ours_kw or {}
        t0 = time.time()
        model.decode(lat, tiled=False, **kw)  # plans, then the capture on the second call
        first_s = time.time() - t0
        ours = wall(lambda: model.decode(lat, tiled=False, **kw), 2, args.reps, csync)
        ours_gib = ours_peak_gib(lambda: model.decode(lat, tiled=False, **kw)) + graph_pool_gib(model)
        tdt = dict(float16=torch.float16, bfloat16=torch.bfloat16, float32=torch.float32)[dtype]
        vae = ref_vae.to("cuda", tdt).eval()
        z = torch.from_numpy(torch_latents(lat) if torch_latents else lat).to("cuda", tdt)
        with torch.inference_mode():
            eager = wall(lambda: vae.decode(z).sample, 2, args.reps, tsync)
            tgib = torch_peak_gib(lambda: vae.decode(z).sample)
        comp = compiled_ms(lambda: vae.decode(z).sample)
        row(f"{preset} decode {'x'.join(map(str, latent_shape))} {dtype}", ours, eager, comp, ours_gib, tgib,
            first_call_s=first_s, torch_weights_gib=weights_gib(vae))
        vae = model = None  # both freed before the next family's
        torch.cuda.empty_cache()
        csync()
        pool.free_all_blocks()

    if "taesd" in only:
        # 1024x1024 previews: batch 1 (a UI after each step), fp16
        image_family("taesd", "taesd", "float16", diffusers.AutoencoderTiny(), (1, 4, 128, 128))
    if "flux2" in only:
        # our input is the pipeline's patchified, normalised grid (N, 128, h/16, w/16); diffusers'
        # AutoencoderKLFlux2.decode takes the unpatchified (N, 32, h/8, w/8) latents: the pipeline's
        # BN de-normalisation and unpatchify are a few element-wise ops not timed on its side
        def unpatchify(g):
            n, c, h, w = g.shape
            return g.reshape(n, c // 4, 2, 2, h, w).transpose(0, 1, 4, 2, 5, 3).reshape(n, c // 4, 2 * h, 2 * w)
        image_family("flux2", "flux2-vae", "bfloat16", diffusers.AutoencoderKLFlux2(), (1, 128, 64, 64),
                     torch_latents=unpatchify)
    if "qwen" in only:
        # 1328x1328 (Qwen-Image's largest published size); diffusers takes N, 16, 1, h, w
        image_family("qwen", "qwen-image-vae", "bfloat16", diffusers.AutoencoderKLQwenImage(), (1, 16, 166, 166),
                     torch_latents=lambda x: x[:, :, None])

    if "wan22" in only:
        from models.wan22_vae import PRESETS as WAN22

        t, h, w = map(int, args.wan22_latent.split("x"))
        lat = rng.standard_normal((1, 48, t, h, w)).astype(np.float32)
        label = f"wan2.2-vae decode 48x{t}x{h}x{w} bf16 ({1 + 4 * (t - 1)}x{16 * h}x{16 * w})"
        vae = diffusers.AutoencoderKLWan(**WAN22["wan2.2-vae"]).to("cuda", torch.bfloat16).eval()
        z = torch.from_numpy(lat).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            tgib = torch_peak_gib(lambda: vae.decode(z).sample)  # also the warm-up call
            eager = wall(lambda: vae.decode(z).sample, 0, args.wan22_eager_reps, tsync)
        vae = z = None
        torch.cuda.empty_cache()
        be = get_backend("cuda", dtype="bfloat16", autotune=args.autotune,
                         upsample_form=args.upsample_form)
        model = load_model("wan22", "wan2.2-vae", be)
        t0 = time.time()
        model.decode(lat, tiled=False, uint8=True)
        first_s = time.time() - t0
        ours = wall(lambda: model.decode(lat, tiled=False, uint8=True), 1, max(2, args.reps // 2), csync)
        ours_gib = ours_peak_gib(lambda: model.decode(lat, tiled=False, uint8=True)) + graph_pool_gib(model)

        first = streamed_first_group_ms(model, lat, csync)
        row(label, ours, eager, None, ours_gib, tgib, first_call_s=first_s, first_group_ms=first,
            memory_ratio=ours_gib / tgib)
        print(f"  streamed first frame group {first:.1f} ms; memory ours/torch {ours_gib / tgib:.2f}", flush=True)

    env = bench_env(cupy=cp.__version__, autotune=args.autotune, upsample_form=args.upsample_form)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"gpu_families_{'_'.join(sorted(only))}{'_autotune' if args.autotune else ''}"
                           f"{'' if args.upsample_form == 'auto' else '_' + args.upsample_form}.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print_table(f"2026 VAE families, {env['date']}, {env['gpu']}; torch {env['torch']}, diffusers "
                f"{env['diffusers']}; ratios are PyTorch's time / ours (> 1: ours faster)", rows, FAMILY_COLUMNS)


if __name__ == "__main__":
    main()
