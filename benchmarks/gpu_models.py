"""GPU model benchmark, PEERS.md workloads: our CUDA backend (models/ on CuPy + cuDNN frontend)
vs the PyTorch reference implementation of the same architecture, eager, on the same GPU in the
same run, printed as a ratio (ours / peer; below 1 = we are faster).

- SD-VAE decode (diffusers AutoencoderKL, fp16, channels-last): 1x4x64x64, 4x4x64x64, 1x4x128x128
- Wan 2.1 VAE decode (diffusers AutoencoderKLWan, bf16): 1x16x5x60x104 -> 17x480x832
- ConvNeXt-Tiny 224 (peer: timm convnext_tiny if importable, else transformers ConvNextModel), fp16

Both sides use random weights (timing only; parity is tests/gpu/test_models_gpu.py). Ours is
timed end to end through model.decode / model.encode: latents in host memory, images back in
host memory (PyTorch's time excludes those copies; at 512x512 they are ~0.3 ms). Peak GPU memory:
ours = the CuPy memory pool's high-water mark, peer = torch.cuda.max_memory_allocated.

Run: PYTHONPATH=. python3 benchmarks/gpu_models.py [--only sd,wan,convnext] [--reps N]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


# work of the reference architectures (2 x multiply-adds): the SD-VAE figure is issue #11's (diffusers'
# nearest-upsample + 3x3 decoder; our sub-pixel upsampling does fewer), ConvNeXt-T is 4.47 GMAC/image
SD_VAE_512_TFLOP = 2.48
CONVNEXT_T_224_TFLOP = 2 * 4.47e-3
DENSE_PEAK_TFLOPS = 800.0  # bf16/fp16 dense matmul measured on this H100 (KINDS.md: 769-798)


def wall(fn, warm, reps, sync):
    for _ in range(warm):
        fn()
    sync()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(ts)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="sd,convnext,wan")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--autotune", type=int, default=1)
    ap.add_argument("--graphs", type=int, default=0, help="1: replay each forward as a CUDA graph")
    args = ap.parse_args()
    only = set(args.only.split(","))

    import cupy as cp
    import torch

    from convkernels import get_backend
    from models import load_model

    torch.backends.cudnn.benchmark = True
    pool = cp.get_default_memory_pool()
    results, details = {}, {}
    rng = np.random.default_rng(0)

    def tsync():
        torch.cuda.synchronize()

    def csync():
        cp.cuda.get_current_stream().synchronize()

    def ours_peak(fn):
        csync()
        pool.free_all_blocks()
        fn()
        csync()
        return pool.total_bytes() / 2**30

    def record(name, ours_ms, peer_ms, ours_gib=None, peer_gib=None, extra=None, tflop=None):
        """tflop: the reference architecture's work (2 x multiply-adds), for achieved TFLOP/s."""
        results[name] = dict(ours_ms=ours_ms, peer_ms=peer_ms, ratio=ours_ms / peer_ms, ours_peak_gib=ours_gib,
                             peer_peak_gib=peer_gib, tflop=tflop, **(extra or {}))
        print(f"{name:48s} ours {ours_ms:9.2f} ms  peer {peer_ms:9.2f} ms  ratio {ours_ms / peer_ms:6.2f}", flush=True)

    def backend(dtype, autotune=bool(args.autotune)):
        return get_backend("cuda", dtype=dtype, autotune=autotune, autotune_max_plans=8,
                           cuda_graphs=bool(args.graphs))

    if "sd" in only:
        from diffusers import AutoencoderKL
        be = backend("float16")
        t0 = time.time()
        model = load_model("sd", "sd-vae", be)
        vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                            down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4).to("cuda", torch.half)
        vae = vae.to(memory_format=torch.channels_last).eval()
        for n, s in ((1, 64), (4, 64), (1, 128)):
            lat = rng.standard_normal((n, 4, s, s)).astype(np.float32)
            t1 = time.time()
            model.decode(lat, tiled=False)  # builds (and autotunes) the plans of this shape
            warm_s = time.time() - t1
            ours = wall(lambda: model.decode(lat, tiled=False), 1, args.reps, csync)
            gib = ours_peak(lambda: model.decode(lat, tiled=False))
            if args.graphs:  # the graphs' private pools hold their activations
                gib += model._decode_device.stats()["pool_bytes"] / 2**30
            z = torch.from_numpy(lat).to("cuda", torch.half).to(memory_format=torch.channels_last)
            with torch.inference_mode():
                peer = wall(lambda: vae.decode(z).sample, 2, args.reps, tsync)
                torch.cuda.reset_peak_memory_stats()
                vae.decode(z)
                pgib = torch.cuda.max_memory_allocated() / 2**30
            record(f"sd-vae decode n{n} {s}x{s}->{8 * s}x{8 * s} fp16", ours, peer, gib, pgib,
                   dict(first_call_s=warm_s), tflop=SD_VAE_512_TFLOP * n * (s / 64) ** 2)
        be.flush_timings()
        details["sd"] = dict(plan_cache=be.plan_cache_stats(), setup_s=time.time() - t0)
        del vae
        torch.cuda.empty_cache()

    if "convnext" in only:
        be = backend("float16")
        model = load_model("cnx", "convnext-tiny", be)
        try:
            import timm
            peer_model = timm.create_model("convnext_tiny", pretrained=False)
            peer_name = "timm convnext_tiny"
            call = peer_model
        except Exception:
            import transformers
            peer_model = transformers.ConvNextModel(transformers.ConvNextConfig())
            peer_name = "transformers ConvNextModel"
            call = peer_model
        peer_model = peer_model.to("cuda", torch.half).to(memory_format=torch.channels_last).eval()
        for n in (1, 32, 128):
            px = rng.random((n, 224, 224, 3), dtype=np.float32)
            model.encode(px)
            ours = wall(lambda: model.encode(px), 1, args.reps, csync)
            x = torch.from_numpy(px).permute(0, 3, 1, 2).to("cuda", torch.half).contiguous(
                memory_format=torch.channels_last)
            with torch.inference_mode():
                peer = wall(lambda: call(x), 3, args.reps, tsync)
            record(f"convnext-tiny 224 n{n} fp16", ours, peer, tflop=CONVNEXT_T_224_TFLOP * n, extra=dict(peer=peer_name,
                                                                          ours_img_s=n / ours * 1e3))
            # the same network without the host side (pixels already on the device, no copy back)
            xd = be.asarray(px)  # features() takes [0, 1] pixels: the normalisation is folded into the stem
            ours_dev = wall(lambda: model.features(xd), 2, args.reps, csync)
            record(f"convnext-tiny 224 n{n} fp16 features(), on device", ours_dev, peer, tflop=CONVNEXT_T_224_TFLOP * n,
                   extra=dict(note="stem..last stage on a device input; peer is the whole forward"))
        details["convnext"] = dict(plan_cache=be.plan_cache_stats())
        del peer_model
        torch.cuda.empty_cache()

    if "wan" in only:
        from diffusers import AutoencoderKLWan
        # heuristic plans: the chunked causal decode meets dozens of conv shapes, and autotuning
        # each (all plans + the small_kd_2d measurement) costs minutes of warm-up
        be = backend("bfloat16", autotune=False)
        model = load_model("wan", "wan2.1-vae", be)
        vae = AutoencoderKLWan().to("cuda", torch.bfloat16).eval()
        lat = rng.standard_normal((1, 16, 5, 60, 104)).astype(np.float32)
        t1 = time.time()
        model.decode(lat)
        warm_s = time.time() - t1
        print(f"wan first decode (plan builds included) {warm_s:.1f} s", flush=True)
        ours = wall(lambda: model.decode(lat), 0, max(1, args.reps // 2), csync)
        gib = ours_peak(lambda: model.decode(lat))
        z = torch.from_numpy(lat).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            peer = wall(lambda: vae.decode(z).sample, 1, max(1, args.reps // 2), tsync)
            torch.cuda.reset_peak_memory_stats()
            vae.decode(z)
            pgib = torch.cuda.max_memory_allocated() / 2**30
        record("wan2.1-vae decode 16x5x60x104 bf16", ours, peer, gib, pgib, dict(first_call_s=warm_s))
        details["wan"] = dict(plan_cache=be.plan_cache_stats(),
                              small_kd={str(k.x_shape): v for k, v in be.measurements.items()})

    env = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, cudnn=torch.backends.cudnn.version(),
               cupy=cp.__version__, python=sys.version.split()[0], autotune=bool(args.autotune))
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_models.json"), "w") as f:
        json.dump(dict(env=env, results=results, details=details), f, indent=1, default=str)
    print(f"# GPU models on {env['gpu']}: ours (convserve CUDA backend) vs PyTorch {env['torch']} eager, same run")
    print(f"{'workload':48s} {'ours ms':>9s} {'peer ms':>9s} {'ratio':>6s} {'ours GiB':>8s} {'peer GiB':>8s}"
          f" {'ours TF/s':>9s} {'peak %':>6s} {'peer TF/s':>9s}")
    for k, v in results.items():
        og = f"{v['ours_peak_gib']:.2f}" if v["ours_peak_gib"] is not None else "-"
        pg = f"{v['peer_peak_gib']:.2f}" if v["peer_peak_gib"] is not None else "-"
        roof = "-".rjust(9) + " " + "-".rjust(6) + " " + "-".rjust(9)
        if v.get("tflop"):
            ours_tf, peer_tf = v["tflop"] / (v["ours_ms"] / 1e3), v["tflop"] / (v["peer_ms"] / 1e3)
            roof = f"{ours_tf:9.1f} {100 * ours_tf / DENSE_PEAK_TFLOPS:5.1f}% {peer_tf:9.1f}"
        print(f"{k:48s} {v['ours_ms']:9.2f} {v['peer_ms']:9.2f} {v['ratio']:6.2f} {og:>8s} {pg:>8s} {roof}")


if __name__ == "__main__":
    main()
