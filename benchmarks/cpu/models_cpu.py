"""Whole models on CPU: ours (NumPy backend, fp32) vs PyTorch CPU (diffusers / transformers) with
the same random weights, in the same run, interleaved rep by rep (the box is shared, so only the
ratio means anything). Prints a ratio table (peer / ours: > 1 means we are faster), each row's
parity error, and the machine.

    python benchmarks/cpu/models_cpu.py [--reps 3] [--only tiny-vae sd-vae taesd convnext] [--sizes 32 64] [--memory]
    python benchmarks/cpu/models_cpu.py --profile sd-vae   # cProfile of our 32x32 SD-VAE decode

--memory adds the 2048x2048 tiny-vae decode (256x256 latents) under a memory budget, peak RSS
measured in a fresh process.
"""
from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(ROOT))
from benchmarks.machine import describe_machine  # noqa: E402

from convkernels import get_backend  # noqa: E402
from models import PRESETS, load_model  # noqa: E402


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def interleaved(mine, peer, reps: int) -> tuple[float, float]:
    """Median seconds of mine and of peer, timed rep by rep in turn (the box is shared)."""
    tp, to = [], []
    for _ in range(reps):
        tp.append(timed(peer))
        time.sleep(0.2)  # let torch's OpenMP workers stop spinning before BLAS starts
        to.append(timed(mine))
    return statistics.median(to), statistics.median(tp)


def diffusers_vae(preset: str, folder: Path):
    import diffusers
    import torch
    torch.manual_seed(0)
    cfg = dict(PRESETS[preset].config)
    vae = diffusers.AutoencoderKL(**cfg).eval()
    vae.save_pretrained(folder)
    return vae


def vae_rows(preset: str, sizes, reps: int, backend):
    import torch
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        vae = diffusers_vae(preset, Path(tmp))
        ours = load_model(preset, preset, backend, weights=tmp)
        sf, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
        for s in sizes:
            lat = np.random.default_rng(s).standard_normal((1, ours.latent_channels, s, s)).astype(np.float32)
            zt = torch.from_numpy(lat) / sf + shift

            def peer():
                with torch.no_grad():
                    return (vae.decode(zt).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()

            def mine():
                return ours.decode(lat, tiled=False)

            err = rel_l2(mine(), peer())  # also the warm-up of both
            to, tp = interleaved(mine, peer, reps)
            rows.append((f"{preset} decode {s}x{s} -> {s * 8}x{s * 8}", to, tp, "diffusers AutoencoderKL", err))
    return rows


def taesd_rows(sizes, reps: int, backend):
    """TAESD (diffusers AutoencoderTiny, its default config = madebyollin/taesd) at each latent size."""
    import diffusers
    import torch
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        vae = diffusers.AutoencoderTiny().eval()
        vae.save_pretrained(tmp)
        ours = load_model("taesd", "taesd", backend, weights=tmp)
        for s in sizes:
            lat = np.random.default_rng(s).standard_normal((1, 4, s, s)).astype(np.float32)
            zt = torch.from_numpy(lat) / vae.config.scaling_factor + vae.config.shift_factor

            def peer():
                with torch.no_grad():
                    return (vae.decode(zt).sample / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()

            def mine():
                return ours.decode(lat, tiled=False)

            err = rel_l2(mine(), peer())
            to, tp = interleaved(mine, peer, reps)
            rows.append((f"taesd decode {s}x{s} -> {s * 8}x{s * 8}", to, tp,
                         "diffusers AutoencoderTiny", err))
    return rows


def convnext_rows(presets, reps: int, backend):
    import torch
    import transformers
    rows = []
    for preset in presets:
        if preset not in PRESETS:
            print(f"# {preset}: not registered (family unavailable: {PRESETS.unavailable})")
            continue
        cfg = PRESETS[preset].config
        size = cfg.get("input_size", 224)
        with tempfile.TemporaryDirectory() as tmp:
            torch.manual_seed(0)
            hf_cfg = transformers.ConvNextConfig(depths=list(cfg["depths"]), hidden_sizes=list(cfg["dims"]),
                                                 num_labels=cfg.get("num_classes", 1000), image_size=size)
            ref = transformers.ConvNextModel(hf_cfg).eval()
            ref.save_pretrained(tmp)
            ours = load_model(preset, preset, backend, weights=tmp)
            img = np.random.default_rng(1).uniform(0, 1, (1, size, size, 3)).astype(np.float32)
            mean, std = np.asarray(ours.mean, np.float32), np.asarray(ours.std, np.float32)
            xt = torch.from_numpy(((img - mean) / std).transpose(0, 3, 1, 2).copy())

            def peer():
                with torch.no_grad():
                    return ref(pixel_values=xt).pooler_output.numpy()

            def mine():
                return ours.encode(img)["embedding"]

            err = rel_l2(mine(), peer())
            to, tp = interleaved(mine, peer, reps)
            rows.append((f"{preset} {size} batch 1 (embedding)", to, tp,
                         "transformers ConvNextModel", err))
    return rows


MEMORY_CODE = textwrap.dedent("""
    import sys, time, numpy as np
    from convkernels import get_backend
    from models import load_model, tiling
    from models.autoencoder_kl import AutoencoderKLOptions
    budget = int(sys.argv[1])

    def status(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

    m = load_model("t", "tiny-vae", get_backend("numpy"), options=AutoencoderKLOptions(memory_budget_bytes=budget))
    lat = np.random.default_rng(0).standard_normal((1, 4, 256, 256)).astype(np.float32)
    m.decode(lat[:, :, :8, :8])
    plan = tiling.plan_decode(m, (1, 256, 256, 4), None)
    open("/proc/self/clear_refs", "w").write("5")  # reset the peak-RSS mark (ru_maxrss survives exec)
    base = status("VmRSS")
    t0 = time.perf_counter()
    img = m.decode(lat)
    dt = time.perf_counter() - t0
    peak = status("VmHWM")
    est = tiling.estimate_decode_peak_bytes(m, 1, 256, 256)
    print(f"{img.shape} in {dt:.1f} s, tiles of {plan.tile_latent} latents; peak RSS {peak / 2**20:.0f} MiB "
          f"(+{(peak - base) / 2**20:.0f} MiB over the {base / 2**20:.0f} MiB before the call), "
          f"budget {budget / 2**20:.0f} MiB; untiled estimate {est / 2**20:.0f} MiB")
""")


def memory_row(budget: int) -> str:
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    res = subprocess.run([sys.executable, "-c", MEMORY_CODE, str(budget)], capture_output=True, text=True,
                         env=env, cwd=ROOT)
    return res.stdout.strip() or res.stderr.strip()


def profile(preset: str) -> None:
    import cProfile
    import pstats
    backend = get_backend("numpy")
    m = load_model(preset, preset, backend)
    lat = np.random.default_rng(0).standard_normal((1, m.latent_channels, 32, 32)).astype(np.float32)
    m.decode(lat)
    cProfile.runctx("m.decode(lat)", globals(), {"m": m, "lat": lat}, "/tmp/models_cpu.prof")
    pstats.Stats("/tmp/models_cpu.prof").sort_stats("tottime").print_stats(20)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", nargs="*", default=["tiny-vae", "sd-vae", "convnext"])
    ap.add_argument("--sizes", nargs="*", type=int, default=[32, 64], help="VAE latent sizes")
    ap.add_argument("--memory", action="store_true")
    ap.add_argument("--memory-budget-mib", type=int, default=256)
    ap.add_argument("--profile")
    args = ap.parse_args()
    if args.profile:
        profile(args.profile)
        return
    import torch
    backend = get_backend("numpy")
    print(f"# models_cpu — {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}")
    print(f"# machine: {describe_machine()}")
    print(f"# torch intra-op threads {torch.get_num_threads()}; ours: NumPy backend fp32 "
          f"(BLAS threads as numpy's default); median of {args.reps} interleaved reps")
    print()
    print("| workload | ours (numpy) | PyTorch CPU | peer | peer/ours | rel L2 vs peer |")
    print("| --- | --- | --- | --- | --- | --- |", flush=True)

    def emit(rows):  # rows print as they finish: a slow box still shows the early ones
        for name, ours_s, peer_s, peer, err in rows:
            print(f"| {name} | {ours_s * 1e3:.0f} ms | {peer_s * 1e3:.0f} ms | {peer} | {peer_s / ours_s:.2f}x "
                  f"| {err:.1e} |", flush=True)

    for preset in ("tiny-vae", "sd-vae"):
        if preset in args.only:
            for size in args.sizes:
                emit(vae_rows(preset, (size,), args.reps, backend))
    if "taesd" in args.only:
        emit(taesd_rows(args.sizes, args.reps, backend))
    if "convnext" in args.only:
        emit(convnext_rows(("tiny-convnext", "convnext-tiny"), args.reps, backend))
    if args.memory:
        print()
        print(f"2048x2048 tiny-vae decode, auto tiling: {memory_row(args.memory_budget_mib << 20)}", flush=True)


if __name__ == "__main__":
    main()
