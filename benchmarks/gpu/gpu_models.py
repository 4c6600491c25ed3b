"""GPU model benchmark, the docs/peers.md workloads: our CUDA backend (models/ on CuPy + cuDNN frontend)
with every forward replayed as a CUDA graph (the default) and without (eager), vs the PyTorch
reference implementation of the same architecture, eager and (with --compile) torch.compile, on the
same GPU in the same run, printed as ratios (ours / peer; below 1 = we are faster), wall time and
GPU kernel time side by side.

- SD-VAE decode (diffusers AutoencoderKL, fp16, channels-last): 1x4x64x64, 4x4x64x64, 1x4x128x128
- ConvNeXt-Tiny 224 (peer: timm convnext_tiny if importable, else transformers ConvNextModel), fp16:
  batch 1, 32, 128
- Wan 2.1 VAE decode (diffusers AutoencoderKLWan, bf16): 1x16x5x60x104 -> 17x480x832 (the chunks
  from the third on replay one graphed step)

Both sides use random weights (timing only; parity is tests/gpu/test_models_gpu.py). Ours is
timed end to end through model.decode / model.encode: latents in host memory, images back in
host memory (PyTorch's time excludes those copies; at 512x512 they are ~0.3 ms). "kernel ms" is
the summed duration of the GPU kernels of one call (CUPTI through torch.profiler, which sees
CuPy's and cuDNN's kernels and a graph's replayed ones alike; copies excluded): wall minus kernel
time is what the host costs. Peak GPU memory: ours = the bytes the CuPy memory pool holds after a
call from an emptied pool (blocks in use and blocks cached for reuse) plus the graph pools; peer =
torch.cuda.max_memory_allocated (in use only; until 2026-11-25 the only peer column, not like for
like) and, in the JSON, peer_reserved_gib = torch.cuda.max_memory_reserved from an emptied cache,
the comparable figure.

Run: PYTHONPATH=. python3 benchmarks/gpu/gpu_models.py [--only sd,convnext,wan] [--reps N] [--compile]
`--only sd,convnext` takes ~2-3 min on an H100 without --compile; torch.compile adds its compile
time per shape (~2 min for an SD-VAE decode shape).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np


# work of the reference architectures (2 x multiply-adds): the SD-VAE figure is the CUDA targets' (diffusers'
# nearest-upsample + 3x3 decoder; our sub-pixel upsampling does fewer), ConvNeXt-T is 4.47 GMAC/image
SD_VAE_512_TFLOP = 2.48
CONVNEXT_T_224_TFLOP = 2 * 4.47e-3
DENSE_PEAK_TFLOPS = 800.0  # bf16/fp16 dense matmul measured on this H100 (769-798 TFLOPS measured on the H100 machines)

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


def pool_in_use_peak(fn) -> tuple[int, int]:
    """(bytes CuPy's pool had in use before fn, the most it had in use at once during fn):
    torch.cuda.max_memory_allocated's counterpart (the pool's total also counts cached free blocks)."""
    import cupy as cp
    from cupy.cuda import memory_hook

    pool = cp.get_default_memory_pool()

    class Peak(memory_hook.MemoryHook):
        name = "in_use_peak"

        def __init__(self):
            self.peak = pool.used_bytes()

        def malloc_postprocess(self, **kw):
            self.peak = max(self.peak, pool.used_bytes())

    cp.cuda.get_current_stream().synchronize()
    hook = Peak()
    base = hook.peak
    with hook:
        fn()
        cp.cuda.get_current_stream().synchronize()
    return base, hook.peak


def kernel_ms(fn, sync, reps=3, top=None):
    """Summed GPU kernel time of one call of fn (mean of reps calls), from CUPTI. `top`: a list that
    receives the 30 costliest kernels as (name, launches per call, us per call), to explain a missed target."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    sync()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        sync()
    total_us, rows = 0.0, []
    for ev in prof.key_averages():
        if ev.key.startswith(("Memcpy", "Memset")) or "memcpy" in ev.key.lower():
            continue
        us = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0.0)
        total_us += us
        rows.append((ev.key[:120], ev.count / reps, us / reps))
    if top is not None:
        top.extend(sorted(rows, key=lambda r: -r[2])[:30])
    return total_us / 1e3 / reps


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--only", default="sd,convnext,wan")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--autotune", type=int, default=1)
    ap.add_argument("--autotune-plans", type=int, default=4, help="cuDNN plans timed per conv key")
    ap.add_argument("--compile", action="store_true", help="also time torch.compile (adds its compile time)")
    ap.add_argument("--compile-limit", type=int, default=99,
                    help="torch.compile only each model's first K shapes (each costs minutes of compiling)")
    ap.add_argument("--compile-mode", default="reduce-overhead")
    ap.add_argument("--wan-autotune", action="store_true", help="also time Wan with autotuned cuDNN plans")
    ap.add_argument("--kernels", type=int, default=1, help="0: skip the GPU kernel time (profiler) columns")
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

    def ours_in_use_peak(fn):
        return pool_in_use_peak(fn)[1] / 2**30

    def peer_peak(fn):
        """PyTorch's peak GiB of one call from an emptied cache: (allocated, reserved)."""
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        fn()
        return torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30

    def compiled_call(fn_c, kernels, top_key=None):
        """torch.compile'd fn_c: its first call (the compile) reported, then timed; kernel ms into `kernels`."""
        t1 = time.time()
        fn_c()
        print(f"torch.compile({args.compile_mode}) first call {time.time() - t1:.1f} s", flush=True)
        kernels["compiled"] = kern(fn_c, tsync, top_key)
        return wall(fn_c, 3, args.reps, tsync)

    def kern(fn, sync, top_key=None):
        """Kernel ms of fn; with top_key, its costliest kernels go to details["kernels_top"][top_key]."""
        if not args.kernels:
            return None
        top = details.setdefault("kernels_top", {}).setdefault(top_key, []) if top_key else None
        return kernel_ms(fn, sync, top=top)

    def record(name, graphs_ms, eager_ms, peer_ms, compiled_ms=None, kernels=None, ours_gib=None, peer_gib=None,
               extra=None, tflop=None):
        """tflop: the reference architecture's work (2 x multiply-adds), for achieved TFLOP/s."""
        results[name] = dict(ours_ms=graphs_ms, ours_eager_ms=eager_ms, peer_ms=peer_ms, compiled_ms=compiled_ms,
                             ratio=graphs_ms / peer_ms, ratio_compiled=None if compiled_ms is None else graphs_ms / compiled_ms,
                             kernels_ms=kernels or {}, ours_peak_gib=ours_gib, peer_peak_gib=peer_gib, tflop=tflop,
                             **(extra or {}))
        comp = f"  compile {compiled_ms:8.2f} ms ({graphs_ms / compiled_ms:5.2f})" if compiled_ms else ""
        print(f"{name:44s} graphs {graphs_ms:8.2f} ms  eager {eager_ms:8.2f} ms  torch {peer_ms:8.2f} ms "
              f"({graphs_ms / peer_ms:5.2f}){comp}", flush=True)

    def backend(dtype, autotune=bool(args.autotune)):
        return get_backend("cuda", dtype=dtype, autotune=autotune, autotune_max_plans=args.autotune_plans)

    def pair(name, loader, be):
        """The same model twice on one backend (shared plan cache): graphed, and eager."""
        graphed = loader(name)
        be.cuda_graphs = False  # models built now get the eager forward
        try:
            eager = loader(name + "-eager")
        finally:
            be.cuda_graphs = True
        return graphed, eager

    def compiled(fn):
        return torch.compile(fn, mode=args.compile_mode) if args.compile else None

    if "sd" in only:
        from diffusers import AutoencoderKL
        be = backend("float16")
        t0 = time.time()
        model, model_eager = pair("sd", lambda n: load_model(n, "sd-vae", be), be)
        vae = AutoencoderKL(block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4,
                            down_block_types=("DownEncoderBlock2D",) * 4,
                            up_block_types=("UpDecoderBlock2D",) * 4).to("cuda", torch.half)
        vae = vae.to(memory_format=torch.channels_last).eval()
        vae_c = compiled(lambda z: vae.decode(z).sample)
        for shape_i, (n, s) in enumerate(((1, 64), (4, 64), (1, 128))):
            lat = rng.standard_normal((n, 4, s, s)).astype(np.float32)
            t1 = time.time()
            model.decode(lat, tiled=False)  # builds (and autotunes) the plans of this shape
            first_s = time.time() - t1
            t1 = time.time()
            model.decode(lat, tiled=False)  # captures the graph
            capture_s = time.time() - t1
            ours = wall(lambda: model.decode(lat, tiled=False), 1, args.reps, csync)
            ours_e = wall(lambda: model_eager.decode(lat, tiled=False), 1, args.reps, csync)
            gib = ours_peak(lambda: model.decode(lat, tiled=False)) + model._decode_device.stats()["pool_bytes"] / 2**30
            latd = be.asarray(lat.transpose(0, 2, 3, 1))
            kernels = dict(ours=kern(lambda: model._decode_device(latd), csync, f"sd n{n} {s} ours"))
            z = torch.from_numpy(lat).to("cuda", torch.half).to(memory_format=torch.channels_last)
            comp = None
            with torch.inference_mode():
                peer = wall(lambda: vae.decode(z).sample, 2, args.reps, tsync)
                kernels["torch"] = kern(lambda: vae.decode(z).sample, tsync, f"sd n{n} {s} torch")
                pgib, preserved = peer_peak(lambda: vae.decode(z))
                if vae_c is not None and shape_i < args.compile_limit:
                    comp = compiled_call(lambda: vae_c(z), kernels, f"sd n{n} {s} compiled")
            record(f"sd-vae decode n{n} {s}x{s}->{8 * s}x{8 * s} fp16", ours, ours_e, peer, comp, kernels, gib, pgib,
                   dict(first_call_s=first_s, capture_call_s=capture_s, graph=model._decode_device.stats(),
                        peer_reserved_gib=preserved),
                   tflop=SD_VAE_512_TFLOP * n * (s / 64) ** 2)
        be.flush_timings()
        details["sd"] = dict(plan_cache=be.plan_cache_stats(), setup_s=time.time() - t0)
        del vae, vae_c
        torch.cuda.empty_cache()

    if "convnext" in only:
        be = backend("float16")
        model, model_eager = pair("cnx", lambda n: load_model(n, "convnext-tiny", be), be)
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
        call_c = compiled(call)
        for shape_i, n in enumerate((1, 32, 128)):
            px = rng.random((n, 224, 224, 3), dtype=np.float32)
            t1 = time.time()
            model.encode(px)
            first_s = time.time() - t1
            model.encode(px)  # captures the graph
            ours = wall(lambda: model.encode(px), 1, args.reps, csync)
            ours_e = wall(lambda: model_eager.encode(px), 1, args.reps, csync)
            xd = be.asarray(px)
            kernels = dict(ours=kern(lambda: model._encode_device(xd), csync))
            # the network alone, pixels already on the device, no copy back: graphed and eager
            ours_dev = wall(lambda: model._encode_device(xd), 2, args.reps, csync)
            ours_dev_e = wall(lambda: model_eager._encode_device(xd), 2, args.reps, csync)
            x = torch.from_numpy(px).permute(0, 3, 1, 2).to("cuda", torch.half).contiguous(
                memory_format=torch.channels_last)
            comp = None
            with torch.inference_mode():
                peer = wall(lambda: call(x), 3, args.reps, tsync)
                kernels["torch"] = kern(lambda: call(x), tsync)
                if call_c is not None and shape_i < args.compile_limit:
                    comp = compiled_call(lambda: call_c(x), kernels)
            record(f"convnext-tiny 224 n{n} fp16", ours, ours_e, peer, comp, kernels, tflop=CONVNEXT_T_224_TFLOP * n,
                   extra=dict(peer=peer_name, ours_img_s=n / ours * 1e3, first_call_s=first_s,
                              graph=model._encode_device.stats()))
            record(f"convnext-tiny 224 n{n} fp16, on device", ours_dev, ours_dev_e, peer, comp,
                   tflop=CONVNEXT_T_224_TFLOP * n,
                   extra=dict(note="device pixels in, device outputs; the peers' rows are the same calls"))
            # like for like with ours' first row: the peer also starts from the host's float32 NHWC
            # array (pageable, as ours gets it) and ends with its output on the host
            def up(a):
                return torch.from_numpy(a).to("cuda").permute(0, 3, 1, 2).to(torch.half).contiguous(
                    memory_format=torch.channels_last)
            with torch.inference_mode():
                peer_h = wall(lambda: call(up(px)).float().cpu(), 2, args.reps, tsync)
                pinned = torch.from_numpy(px).pin_memory().numpy()
                peer_pinned = wall(lambda: call(up(pinned)).float().cpu(), 2, args.reps, tsync)
                comp_h = (wall(lambda: call_c(up(px)).float().cpu(), 2, args.reps, tsync)
                          if call_c is not None and shape_i < args.compile_limit else None)
            record(f"convnext-tiny 224 n{n} fp16, host pixels both", ours, ours_e, peer_h, comp_h,
                   tflop=CONVNEXT_T_224_TFLOP * n,
                   extra=dict(note="host float32 pixels in, host outputs, on both sides",
                              peer_pinned_source_ms=peer_pinned))
            print(f"  torch eager from a pinned copy of the pixels: {peer_pinned:.2f} ms", flush=True)
        details["convnext"] = dict(plan_cache=be.plan_cache_stats())
        del peer_model, call_c
        torch.cuda.empty_cache()

    if "wan" in only:
        from diffusers import AutoencoderKLWan
        vae = AutoencoderKLWan().to("cuda", torch.bfloat16).eval()
        lat = rng.standard_normal((1, 16, 5, 60, 104)).astype(np.float32)
        z = torch.from_numpy(lat).to("cuda", torch.bfloat16)
        with torch.inference_mode():
            peer = wall(lambda: vae.decode(z).sample, 1, max(1, args.reps // 2), tsync)
            peer_kernels = kern(lambda: vae.decode(z).sample, tsync, "wan torch")
            pgib, preserved = peer_peak(lambda: vae.decode(z))
        del vae
        torch.cuda.empty_cache()
        # heuristic plans are the service's default (CONVSERVE_CUDA_AUTOTUNE off); --wan-autotune
        # adds a row with autotuned plans (its first decode times every key's candidates)
        for tuned in (False, True) if args.wan_autotune else (False,):
            # what earlier sections left alive (their models, backends' workspaces) is not Wan's
            csync()
            pool.free_all_blocks()
            base = pool.used_bytes() / 2**30
            be = backend("bfloat16", autotune=tuned)
            model, model_eager = pair("wan", lambda n: load_model(n, "wan2.1-vae", be), be)
            t1 = time.time()
            model.decode(lat)  # chunks 3-5 repeat their shapes: the 4th is captured, the 5th replays
            warm_s = time.time() - t1
            print(f"wan first decode (plan builds included, autotune {tuned}) {warm_s:.1f} s", flush=True)
            # one more untimed decode: a capture gives the shared pool's blocks back, and the call after
            # it allocates them again (2026-11-25: 358 ms timed without it, 340 ms eager, same route)
            ours = wall(lambda: model.decode(lat), 1, max(1, args.reps // 2), csync)
            ours_e = wall(lambda: model_eager.decode(lat), 1, max(1, args.reps // 2), csync)
            held = model._steady_step.stats()["pool_bytes"] / 2**30
            gib = ours_peak(lambda: model.decode(lat)) + held - base
            in_use = ours_in_use_peak(lambda: model.decode(lat)) + held - base
            wan_kernels = dict(ours=kern(lambda: model.decode(lat), csync, f"wan ours{' autotuned' if tuned else ''}"),
                               torch=peer_kernels)
            record(f"wan2.1-vae decode 16x5x60x104 bf16{', autotuned plans' if tuned else ''}", ours, ours_e, peer,
                   kernels=wan_kernels, ours_gib=gib, peer_gib=pgib,
                   extra=dict(first_call_s=warm_s, graph=model._steady_step.stats(), peer_reserved_gib=preserved,
                              ours_in_use_gib=in_use,
                              note="ours GiB: the CuPy pool's bytes (reserved); ours_in_use_gib: its peak in "
                                   "use, as torch's max_memory_allocated (peer GiB); both less what was in use "
                                   "before the Wan model was loaded", baseline_gib=base))
            details[f"wan{' autotuned' if tuned else ''}"] = dict(
                plan_cache=be.plan_cache_stats(), small_kd={str(k.x_shape): v for k, v in be.measurements.items()})
            print(f"wan peak GiB: ours pool {gib:.2f}, in use {in_use:.2f}; torch allocated {pgib:.2f}, "
                  f"reserved {preserved:.2f}", flush=True)
            del model, model_eager
            csync()
            pool.free_all_blocks()

    import cudnn
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpu=torch.cuda.get_device_name(),
               torch=torch.__version__, torch_cudnn=torch.backends.cudnn.version(), cupy=cp.__version__,
               cuda_runtime=cp.cuda.runtime.runtimeGetVersion(), cudnn=cudnn.backend_version(),
               cudnn_frontend=getattr(cudnn, "__version__", "?"), python=sys.version.split()[0],
               autotune=bool(args.autotune), autotune_plans=args.autotune_plans,
               compile_mode=args.compile_mode if args.compile else None)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "gpu_models.json"), "w") as f:
        json.dump(dict(env=env, results=results, details=details), f, indent=1, default=str)
    print(f"\n# GPU models, {env['date']}, {env['gpu']}: convserve CUDA backend (CUDA graphs on = 'graphs', off = "
          f"'eager') vs PyTorch {env['torch']} eager and torch.compile({args.compile_mode if args.compile else 'not run'}),"
          f" one process; cuDNN {env['cudnn']}, frontend {env['cudnn_frontend']}, CuPy {env['cupy']}, "
          f"CUDA runtime {env['cuda_runtime']}; autotune {env['autotune']} ({args.autotune_plans} plans/key)")

    def f(v, fmt="{:.2f}"):
        return "-" if v is None else fmt.format(v)

    print("| workload | ours graphs ms | ours eager ms | torch eager ms | torch.compile ms | graphs / torch eager |"
          " graphs / compile | kernel ms: ours / eager torch / compile | ours GiB | torch GiB | ours TF/s (peak %) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for k, v in results.items():
        km = v["kernels_ms"]
        kern_s = " / ".join(f(km.get(x), "{:.3f}") for x in ("ours", "torch", "compiled")) if km else "-"
        roof = "-"
        if v.get("tflop"):
            tf = v["tflop"] / (v["ours_ms"] / 1e3)
            roof = f"{tf:.1f} ({100 * tf / DENSE_PEAK_TFLOPS:.1f}%)"
        print(f"| {k} | {f(v['ours_ms'])} | {f(v['ours_eager_ms'])} | {f(v['peer_ms'])} | {f(v['compiled_ms'])} | "
              f"{f(v['ratio'])} | {f(v['ratio_compiled'])} | {kern_s} | {f(v['ours_peak_gib'])} | "
              f"{f(v['peer_peak_gib'])} | {roof} |")
    for key, rows in details.get("kernels_top", {}).items():
        print(f"\n## costliest kernels, {key} (launches per call, us per call)")
        for name, count, us in rows[:12]:
            print(f"{us:10.1f} us {count:7.1f}x  {name}")


if __name__ == "__main__":
    main()
