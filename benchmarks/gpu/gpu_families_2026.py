"""The GPU rows of the five newest VAE families (HunyuanVideo 1.5, LTX-2, SANA DC-AE, HunyuanImage 2.1,
Qwen-Image 2.1) on the CUDA backend against the diffusers class on PyTorch, in one process.

Both sides are built from our preset's config (the published checkpoint's, models/<family>/config.py)
with identical random weights: the diffusers class is made with its own init, saved as a diffusers
folder and loaded by ours, as each family's GPU test under tests/gpu/ does. So each row also reports
the relative L2 between the two decodes at the benchmark's dtype (a sanity check that both ran the
same computation; the parity criteria are the tests'). Both run in bfloat16 by default, the dtype the
published checkpoints ship in and gpu_families.py uses for FLUX.2, Qwen-Image and Wan 2.2 (the cuda
backend's own default is float16: --dtype float16).

Rows (latents batch 1; the pipeline's latent scaling is in ours, done on the host and untimed for PyTorch):
- hv15: HunyuanVideo 1.5 decode 32x31x45x80 -> 121x720x1280 (16x space, 4x time).
- ltx2: LTX-2 decode 128x16x22x40 -> 121x704x1280: 720 is not a multiple of its 32x factor (22.5
  latent rows), so 704, as LTX-2's own pipelines round heights to multiples of 32.
  Both video rows: ours to uint8 frames (what the service sends), torch eager; memory ours / torch;
  HunyuanVideo 1.5 also the streamed first frame group (its decoder is causal and chunked, as Wan's);
  LTX-2's decoder is not causal in time, so its first group waits for the whole clip (not timed apart).
  If diffusers' whole-clip decode runs out of memory, the row says OOM and (--torch-tiled, default on)
  times diffusers' own tiled decode once instead (torch tiled ms / GiB in the JSON and the log).
- dcae: DC-AE f32c32 decode 32x32x32 -> 1024^2 and 32x128x128 -> 4096^2.
- hyimage: HunyuanImage 2.1 decode 64x64x64 -> 2048^2.
- qwen21: Qwen-Image 2.1 decode 64x83x83 -> 1328^2 (ours serves RGB of the RGBA it decodes).
  The image rows: ours against torch eager and torch.compile (default mode, a fresh compile per row).

Timing as gpu_families.py: ours is model.decode from host latents to host pixels (both copies in);
PyTorch's is vae.decode(z).sample with z on the device and the output left there. One warm-up call,
then up to --reps timed calls (fewer where the warm-up says they would pass --row-budget-s); PyTorch's
video decode once more after its measured first call (--video-torch-reps). Memory: family_bench.py.
--budget-s bounds the run: a torch.compile, or a row, that would start past it is skipped and says so.
A row that fails (out of memory on either side, an error) prints why and the next row runs.

Run (repo root, CUDA machine; about 6-8 minutes on one H200, mostly torch.compile and PyTorch's video decodes):
  PYTHONPATH=. python3 benchmarks/gpu/gpu_families_2026.py [--only hv15,ltx2,dcae,hyimage,qwen21]
      [--dtype bfloat16] [--reps 3] [--no-compile] [--budget-s 480] [--tiny] [--max-side 2048]
      [--no-cudnn-benchmark]
--tiny runs every row on the family's tiny preset at small latents (a smoke test of the script);
`--backend numpy --tiny` runs it without a GPU (ours on NumPy in float32 against PyTorch on the CPU;
no memory columns, no torch.compile). Writes $OUT/gpu_families_2026[_tiny].json (OUT defaults to out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # this group's scripts; the repo (benchmarks.machine)
import benchmarks.machine  # noqa: E402,F401  (loads torch before convkernels, see machine.py)
from family_bench import (bench_env, cuda_sync, fmt, graph_pool_gib, ours_peak_gib, print_table,  # noqa: E402
                          release_device_memory, streamed_first_group_ms, torch_peak_gib, torch_sync, weights_gib)
from gpu_models import wall  # noqa: E402  (the shared wall-clock helper)

#: the brief's targets: eager / ours, ours / torch memory, the streamed first group
SPEED_TARGET, MEMORY_TARGET, FIRST_GROUP_TARGET_MS = 2.0, 0.7, 150.0


@dataclass(frozen=True)
class Row:
    family: str          # the --only key
    preset: str
    tiny_preset: str
    reference: str       # the diffusers class
    latents: tuple       # N, C, (T,) h, w
    tiny_latents: tuple
    pixels: str          # what the latents decode to, for the label

    @property
    def video(self) -> bool:
        return len(self.latents) == 5


ROWS = [
    Row("hv15", "hunyuanvideo1.5-vae", "tiny-hunyuanvideo1.5-vae", "AutoencoderKLHunyuanVideo15",
        (1, 32, 31, 45, 80), (1, 8, 3, 6, 10), "121x720x1280"),
    Row("ltx2", "ltx2-vae", "tiny-ltx2-vae", "AutoencoderKLLTX2Video", (1, 128, 16, 22, 40), (1, 8, 2, 3, 4),
        "121x704x1280"),
    Row("dcae", "dc-ae-f32c32", "tiny-dc-ae", "AutoencoderDC", (1, 32, 32, 32), (1, 8, 8, 8), "1024x1024"),
    Row("dcae", "dc-ae-f32c32", "tiny-dc-ae", "AutoencoderDC", (1, 32, 128, 128), (1, 8, 16, 16), "4096x4096"),
    Row("hyimage", "hunyuanimage2.1-vae", "tiny-hunyuanimage-vae", "AutoencoderKLHunyuanImage",
        (1, 64, 64, 64), (1, 16, 8, 8), "2048x2048"),
    Row("qwen21", "qwen-image2.1-vae", "tiny-qwen-image2.1-vae", "AutoencoderKLQwenImage21",
        (1, 64, 83, 83), (1, 8, 6, 6), "1328x1328"),
]
FAMILY_KEYS = sorted({r.family for r in ROWS})


def pipeline_input(row: Row, vae, lat: np.ndarray) -> np.ndarray:
    """What the family's pipeline hands vae.decode, from the latents ours takes (ours does this step
    itself; for PyTorch it runs on the host, untimed)."""
    cfg = vae.config
    if row.family == "ltx2":  # latents * latents_std / scaling_factor + latents_mean (the checkpoint's buffers)
        std, mean = (getattr(vae, n).detach().float().cpu().numpy().reshape(1, -1, 1, 1, 1)
                     for n in ("latents_std", "latents_mean"))
        return lat * std / np.float32(cfg.scaling_factor) + mean
    if row.family == "qwen21":  # latents * latents_std + latents_mean, as N, C, 1, h, w
        shape = (1, -1, 1, 1)
        return (lat * np.reshape(cfg.latents_std, shape) + np.reshape(cfg.latents_mean, shape))[:, :, None]
    return lat / np.float32(cfg.scaling_factor)


def torch_pixels(out):
    """vae.decode's output -> the pipeline's pixels in [0, 1], channels last, RGB (ours' layout)."""
    if out.ndim == 5 and out.shape[2] == 1 and out.shape[1] == 4:  # Qwen-Image 2.1: N, RGBA, 1, H, W
        out = out[:, :3, 0]
    out = (out.float() / 2 + 0.5).clamp(0, 1)
    return out.permute(0, 2, 3, 4, 1) if out.ndim == 5 else out.permute(0, 2, 3, 1)


def rel_l2(ours: np.ndarray, theirs) -> float:
    """||ours - theirs|| / ||theirs||, on theirs' device (a 720p clip is a few hundred million values)."""
    import torch
    a = torch.from_numpy(np.ascontiguousarray(ours)).to(theirs.device)
    a = a.float() / 255 if a.dtype == torch.uint8 else a.float()
    return float(torch.linalg.vector_norm(a - theirs) / torch.linalg.vector_norm(theirs))


def is_oom(exc: BaseException) -> bool:
    return "out of memory" in str(exc).lower() or type(exc).__name__ in ("OutOfMemoryError", "MemoryError")


def targets(r: dict) -> str:
    """Which of the brief's targets the row meets: speed (>= 2x eager; ahead of torch.compile where
    timed), memory (<= 0.7x PyTorch's, video rows), first group (<= 0.15 s, where streamed)."""
    marks = []
    if isinstance(r.get("vs_eager"), float) and r.get("video"):
        marks.append(f"speed {'ok' if r['vs_eager'] >= SPEED_TARGET else 'MISS'}")
    if isinstance(r.get("vs_compile"), float):
        marks.append(f"compile {'ok' if r['vs_compile'] >= 1 else 'MISS'}")
    if isinstance(r.get("memory_ratio"), float) and r.get("video"):
        marks.append(f"memory {'ok' if r['memory_ratio'] <= MEMORY_TARGET else 'MISS'}")
    if isinstance(r.get("first_group_ms"), float):
        marks.append(f"first group {'ok' if r['first_group_ms'] <= FIRST_GROUP_TARGET_MS else 'MISS'}")
    return ", ".join(marks) or "-"


def torch_tiled(vae, call, r: dict) -> None:
    """diffusers' own tiled decode, once (its kernels are the eager ones, already warm), where the
    whole-clip decode ran out of memory: the peer a user of that GPU would fall back to."""
    import torch

    vae.enable_tiling()
    try:
        with torch.inference_mode():
            t0 = time.perf_counter()
            r["torch_tiled_gib"] = torch_peak_gib(call)
            r["torch_tiled_ms"] = 1e3 * (time.perf_counter() - t0)
        print(f"  PyTorch tiled (diffusers' enable_tiling): {r['torch_tiled_ms']:.0f} ms, "
              f"{r['torch_tiled_gib']:.2f} GiB", flush=True)
    except Exception as exc:  # noqa: BLE001  (the row keeps what it has)
        if not is_oom(exc):
            raise
        r["torch_tiled_ms"] = "OOM"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", default=",".join(FAMILY_KEYS), help=f"families, of {','.join(FAMILY_KEYS)}")
    ap.add_argument("--backend", default="cuda", choices=["cuda", "numpy"],
                    help="ours' backend; numpy (with --tiny) compares against PyTorch on the CPU")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on numpy")
    ap.add_argument("--tiny", action="store_true", help="every row on the tiny preset at small latents (smoke test)")
    ap.add_argument("--reps", type=int, default=3, help="timed calls after one warm-up, at most")
    ap.add_argument("--video-torch-reps", type=int, default=1,
                    help="PyTorch's timed video decodes after its first (0: its first call's time, cuDNN's search in it)")
    ap.add_argument("--row-budget-s", type=float, default=40.0, help="fewer timed calls where they would take longer")
    ap.add_argument("--budget-s", type=float, default=480.0, help="skip compiles and rows that would start past it")
    ap.add_argument("--no-compile", dest="compile", action="store_false", help="no torch.compile column")
    ap.add_argument("--no-torch-tiled", dest="torch_tiled", action="store_false",
                    help="no diffusers tiled decode where its whole-clip video decode runs out of memory")
    ap.add_argument("--autotune", action="store_true", help="ours with timed cuDNN plans (the service's default is off)")
    ap.add_argument("--no-cudnn-benchmark", dest="cudnn_benchmark", action="store_false",
                    help="PyTorch with cuDNN's heuristic algorithms (no timing of every algorithm at its first call); "
                         "the video rows always run so")
    ap.add_argument("--max-side", type=int, default=0, help="only rows whose output side is at most this (0: all)")
    args = ap.parse_args()
    only = set(args.only.split(","))
    if only - set(FAMILY_KEYS):
        ap.error(f"unknown families {sorted(only - set(FAMILY_KEYS))}; choose of {FAMILY_KEYS}")
    cuda = args.backend == "cuda"
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    if cuda:
        from convkernels.registry import cuda_status
        ok, why = cuda_status()
        if not ok:
            sys.exit(f"gpu_families_2026.py: the cuda backend is not usable here ({why}). Without a GPU run "
                     f"`--backend numpy --tiny` (ours on NumPy against PyTorch on the CPU).")

    import diffusers
    import torch

    diffusers.utils.logging.set_verbosity_error()  # not its cast warning once per row

    from convkernels import get_backend
    from models import PRESETS, load_model

    started = time.time()
    device = "cuda" if cuda else "cpu"
    tdtype = getattr(torch, dtype)
    csync, tsync = (cuda_sync, torch_sync) if cuda else (lambda: None, lambda: None)
    if cuda:
        # PyTorch's fastest convs; its first call times every algorithm of each new conv shape, which
        # at DC-AE 4096^2 had not ended after ~145 s (one H200, 2026-11-29): --no-cudnn-benchmark.
        # The video rows never search (bench sets it per row): HunyuanVideo 1.5's 720p first call had
        # not ended after 500 s with it
        torch.backends.cudnn.benchmark = args.cudnn_benchmark
    else:
        torch.set_num_threads(1)  # a shared 2-core box: an oversubscribed pool runs diffusers' small ops far slower
    backend_options = dict(dtype=dtype, **(dict(autotune=args.autotune) if cuda else {}))
    rng = np.random.default_rng(0)
    rows: list[dict] = []

    def say(what: str) -> None:
        """Progress as it happens: a run cut off at a machine's time limit still shows how far each row got."""
        print(f"  [{time.time() - started:5.0f} s] {what}", flush=True)

    def left_s() -> float:
        return args.budget_s - (time.time() - started)

    def timed_ms(fn, sync) -> tuple[float, int]:
        """(median ms, calls timed): one warm-up call, then up to --reps, fewer where the warm-up's
        time says they would pass --row-budget-s."""
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        n = max(1, min(args.reps, int(args.row_budget_s / max(time.perf_counter() - t0, 1e-6))))
        return wall(fn, 0, n, sync), n

    def bench(row: Row, r: dict, folder: str) -> None:
        preset = row.tiny_preset if args.tiny else row.preset
        shape = row.tiny_latents if args.tiny else row.latents
        lat = rng.standard_normal(shape).astype(np.float32)
        with torch.device(device):  # init on the device: the big configs' CPU init takes minutes on few cores
            vae = getattr(diffusers, row.reference)(**PRESETS[preset].config).eval()
        vae.save_pretrained(folder)  # identical weights for ours
        vae = vae.to(tdtype)
        say(f"made and saved {row.reference}")
        r["torch_weights_gib"] = weights_gib(vae)

        # ---- ours ----
        model = load_model(row.family, preset, get_backend(args.backend, **backend_options), weights=folder)
        kw = dict(tiled=False, uint8=True) if row.video else dict(tiled=False)
        t0 = time.time()
        model.decode(lat, **kw)  # plans and kernel builds; an image decoder captures its graph on the next call
        r["first_call_s"] = time.time() - t0
        say(f"ours' first call {r['first_call_s']:.1f} s")
        kept = [None]  # the last timed call's pixels, for the comparison with PyTorch's

        def ours_call():
            kept[0] = None  # the previous call's freed first
            kept[0] = model.decode(lat, **kw)
        r["ours_ms"], r["ours_reps"] = timed_ms(ours_call, csync)
        ours_out = kept.pop()
        say(f"ours {r['ours_ms']:.0f} ms ({r['ours_reps']} calls)")
        if cuda:
            r["ours_gib"] = ours_peak_gib(lambda: model.decode(lat, **kw)) + graph_pool_gib(model)
        if row.family == "hv15":  # the causal chunked decoder streams its frame groups as Wan's does
            r["first_group_ms"] = streamed_first_group_ms(model, lat, csync)
        model = None  # ours' weights and pools freed before PyTorch's run (its video decode wants all it can get)
        release_device_memory()

        # ---- PyTorch ----
        if cuda:
            torch.backends.cudnn.benchmark = args.cudnn_benchmark and not row.video
        z = torch.from_numpy(np.ascontiguousarray(pipeline_input(row, vae, lat))).to(device, tdtype)

        def call():
            return vae.decode(z).sample

        oom = None
        with torch.inference_mode():
            try:
                if row.video:  # the measured first call is the warm-up (a second one costs seconds)
                    holder = []
                    t0 = time.perf_counter()
                    if cuda:
                        r["torch_gib"] = torch_peak_gib(lambda: holder.append(call()))
                    else:
                        holder.append(call())
                    r["torch_first_s"] = time.perf_counter() - t0
                    say(f"PyTorch's first call {r['torch_first_s']:.1f} s")
                    r["rel_l2"] = rel_l2(ours_out, torch_pixels(holder.pop()))
                    if args.video_torch_reps and left_s() > r["torch_first_s"] * args.video_torch_reps + 60:
                        r["torch_eager_ms"] = wall(call, 0, args.video_torch_reps, tsync)
                    else:  # none asked, or no time for another: the first call's (cuDNN's algorithm search in it)
                        r["torch_eager_ms"], r["torch_eager_note"] = 1e3 * r["torch_first_s"], "first call"
                else:
                    r["torch_eager_ms"], r["torch_reps"] = timed_ms(call, tsync)
                    say(f"PyTorch eager {r['torch_eager_ms']:.0f} ms")
                    r["rel_l2"] = rel_l2(ours_out, torch_pixels(call()))
                    if cuda:
                        r["torch_gib"] = torch_peak_gib(call)
            except Exception as exc:  # noqa: BLE001  (an OOM row still reports ours)
                if not is_oom(exc):
                    raise
                oom = str(exc).splitlines()[0][:160]
        if oom is not None:  # here, past the except block: its traceback no longer holds the failed call's tensors
            r["torch_eager_ms"] = "OOM"
            holder = None
            release_device_memory()
            print(f"  PyTorch eager: out of memory ({oom})", flush=True)
            if row.video and args.torch_tiled and cuda and left_s() > 120:
                torch_tiled(vae, call, r)
        if not row.video and cuda and args.compile:
            if left_s() < 90:
                r["torch_compile_ms"] = "skipped (time)"
            else:
                torch._dynamo.reset()  # a fresh compile per row: no recompiles, no dynamic shapes carried over
                compiled = torch.compile(call)
                with torch.inference_mode():
                    t0 = time.time()
                    compiled()
                    tsync()
                    r["compile_s"] = time.time() - t0
                    r["torch_compile_ms"], _ = timed_ms(compiled, tsync)

    for row in ROWS:
        if row.family not in only or (args.max_side and int(row.pixels.split("x")[-1]) > args.max_side):
            continue
        shape = row.tiny_latents if args.tiny else row.latents
        r = dict(workload=f"{row.tiny_preset if args.tiny else row.preset} decode {'x'.join(map(str, shape[1:]))}"
                          f"{'' if args.tiny else ' -> ' + row.pixels}", family=row.family, dtype=dtype,
                 video=row.video)
        rows.append(r)
        if left_s() < 30:
            r["error"] = "skipped (time)"
            print(f"{r['workload']}: skipped, past --budget-s", flush=True)
            continue
        t_row = time.time()
        try:
            with tempfile.TemporaryDirectory(prefix="families26_") as folder:
                bench(row, r, folder)
        except Exception as exc:  # noqa: BLE001  (one failing row never stops the others)
            r["error"] = ("OOM: " if is_oom(exc) else "") + f"{type(exc).__name__}: {exc}".splitlines()[0][:200]
        finally:
            release_device_memory()
        for k, peer in (("vs_eager", "torch_eager_ms"), ("vs_compile", "torch_compile_ms"),
                        ("vs_tiled", "torch_tiled_ms")):
            if isinstance(r.get(peer), float) and isinstance(r.get("ours_ms"), float):
                r[k] = r[peer] / r["ours_ms"]
        if isinstance(r.get("ours_gib"), float) and isinstance(r.get("torch_gib"), float) and r["torch_gib"] > 0:
            r["memory_ratio"] = r["ours_gib"] / r["torch_gib"]
        r["targets"] = targets(r)
        r["row_s"] = time.time() - t_row
        print(row_line(r), flush=True)

    env = bench_env(backend=args.backend, dtype=dtype, tiny=args.tiny, autotune=args.autotune,
                    torch_cudnn_benchmark=args.cudnn_benchmark, budget_s=args.budget_s, total_s=time.time() - started)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"gpu_families_2026{'_tiny' if args.tiny else ''}.json")
    with open(path, "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print_table(f"the newest VAE families, {env['date']}, {env['gpu']}, ours on {args.backend} ({dtype}); torch "
                f"{env['torch']}, diffusers {env['diffusers']}; ratios are PyTorch's time / ours (> 1: ours faster), "
                f"memory ours / PyTorch's", rows, COLUMNS)
    print(f"\n{len(rows)} rows in {time.time() - started:.0f} s; JSON: {path}")


COLUMNS = [("workload", "workload"), ("ours ms", "ours_ms"), ("torch eager ms", "torch_eager_ms"),
           ("eager / ours", "vs_eager"), ("torch.compile ms", "torch_compile_ms"), ("compile / ours", "vs_compile"),
           ("ours GiB", "ours_gib"), ("torch GiB", "torch_gib"), ("ours / torch GiB", "memory_ratio"),
           ("first group ms", "first_group_ms", "{:.1f}"), ("rel L2", "rel_l2", "{:.1e}"), ("targets", "targets"), ("error", "error")]


def row_line(r: dict) -> str:
    parts = [f"{r['workload']:48s}", f"ours {fmt(r.get('ours_ms'))} ms", f"eager {fmt(r.get('torch_eager_ms'))} ms "
             f"({fmt(r.get('vs_eager'))}x)"]
    if r.get("torch_compile_ms") is not None:
        parts.append(f"compile {fmt(r['torch_compile_ms'])} ms ({fmt(r.get('vs_compile'))}x)")
    if r.get("ours_gib") is not None:
        parts.append(f"GiB ours {fmt(r['ours_gib'])} / torch {fmt(r.get('torch_gib'))}")
    if r.get("first_group_ms") is not None:
        parts.append(f"first group {fmt(r['first_group_ms'], '{:.1f}')} ms")
    parts.append(f"rel L2 {fmt(r.get('rel_l2'), '{:.1e}')}")
    if r.get("error"):
        parts.append(f"ERROR {r['error']}")
    return "  ".join(parts) + f"  [{r['targets']}] ({r.get('row_s', 0):.0f} s)"


if __name__ == "__main__":
    main()
