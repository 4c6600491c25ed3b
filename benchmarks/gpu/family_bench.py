"""What the VAE-family benchmarks (gpu_families.py, gpu_families_2026.py) share: memory measured the same
way on both sides, the row table they print and the JSON header they write.

Memory: ours is the CuPy pool's peak in use during a call plus the bytes the model's CUDA graphs keep
in their own pool; PyTorch's is max_memory_allocated; both less what was in use before the call. On a
machine without CUDA (a smoke run on the numpy backend against PyTorch on the CPU) both are None.
"""
from __future__ import annotations

import statistics
import time

from gpu_models import pool_in_use_peak  # the CuPy pool's in-use peak (benchmarks/gpu/ is the scripts' folder)


def cuda_sync() -> None:
    import cupy as cp
    cp.cuda.get_current_stream().synchronize()


def torch_sync() -> None:
    import torch
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def ours_peak_gib(fn) -> float:
    """The most bytes the CuPy pool had handed out at once during fn, less what was in use before."""
    base, peak = pool_in_use_peak(fn)
    return (peak - base) / 2**30


def torch_peak_gib(fn) -> float:
    import torch
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**30


def graph_pool_gib(model) -> float:
    """The bytes a model's CUDA graphs keep in their own pool, which the CuPy pool's count misses
    (2026-11-26's first run reported 0.02 GiB for the graphed image decoders without it). 0 for a
    model that replays no graph (a chunked video decoder run eagerly, or a CPU backend)."""
    # an image decoder's whole forward, Qwen-Image's one-frame forward, or a video decoder's steady step
    forward = next((f for f in (getattr(model, n, None) for n in ("_decode_device", "_frame_device", "_steady_step"))
                    if f is not None), None)
    stats = getattr(forward, "stats", None)
    return stats()["pool_bytes"] / 2**30 if stats is not None else 0.0


def streamed_first_group_ms(model, lat, sync) -> float:
    """How long a streamed video decode takes to hand out its first frame group (uint8, untiled):
    the median of 3 after one warm-up; the rest of each decode is abandoned unrun."""
    def once() -> float:
        sync()
        t0 = time.perf_counter()
        frames = model.decode_frames(lat, tiled=False, uint8=True)
        next(frames)
        ms = 1e3 * (time.perf_counter() - t0)
        frames.close()
        sync()
        return ms
    once()
    return statistics.median(once() for _ in range(3))


def weights_gib(vae) -> float:
    return sum(p.numel() * p.element_size() for p in vae.parameters()) / 2**30


def release_device_memory() -> None:
    """Both pools emptied of cached blocks, so the next family starts from what is really in use."""
    import gc

    import torch
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        import cupy as cp
        cuda_sync()
        cp.get_default_memory_pool().free_all_blocks()


def bench_env(**extra) -> dict:
    """The run's header in the JSON: date, GPU, machine, library versions and the caller's switches."""
    import diffusers
    import torch

    from benchmarks.machine import describe_machine

    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               gpu=torch.cuda.get_device_name() if torch.cuda.is_available() else "none (CPU)",
               machine=describe_machine(), torch=torch.__version__, diffusers=diffusers.__version__)
    try:
        import cupy as cp
        env["cupy"] = cp.__version__
    except ImportError:
        pass
    return {**env, **extra}


def fmt(v, spec: str = "{:.2f}") -> str:
    return "-" if v is None else v if isinstance(v, str) else spec.format(v)


def print_table(title: str, rows: list[dict], columns: list[tuple]) -> None:
    """A Markdown table of rows: columns are (header, key) or (header, key, format); a missing key or
    None prints '-', a string (e.g. 'OOM') as it is."""
    print(f"\n# {title}")
    print("| " + " | ".join(c[0] for c in columns) + " |")
    print("|" + " --- |" * len(columns))
    for r in rows:
        print("| " + " | ".join(fmt(r.get(c[1]), *c[2:]) for c in columns) + " |")


#: gpu_families.py's columns
FAMILY_COLUMNS = [("workload", "workload"), ("ours ms", "ours_ms"), ("torch eager ms", "torch_eager_ms"),
                  ("eager / ours", "vs_eager"), ("torch.compile ms", "torch_compile_ms"),
                  ("compile / ours", "vs_compile"), ("ours GiB", "ours_gib"), ("torch GiB", "torch_gib")]
