"""Where the wall time of one graphed forward goes on the GPU (wall minus kernel time).

For SD-VAE decode 1x4x64x64 -> 512x512 and ConvNeXt-T 224 (batch 1 and 32), fp16, CUDA graphs on,
each stage of `model.decode` / `model.encode` is timed on its own (host clock, device synchronised
after each stage, median of --reps): host pre-processing, host -> device copy + cast, the graph
replay, device -> host copy, host post-processing. The sum is close to gpu_models.py's wall time;
the replay row against gpu_models.py's kernel time is the launch and gap cost of the graph.

Run: PYTHONPATH=. python3 benchmarks/gpu/gpu_breakdown.py [--reps 30]
"""
from __future__ import annotations

import argparse
import statistics
import time

import numpy as np


def stage_times(stages, sync, reps):
    """stages: [(name, fn(state) -> state)] run in order; returns {name: median ms}."""
    times = {name: [] for name, _ in stages}
    for _ in range(reps + 2):
        state = None
        for name, fn in stages:
            sync()
            t0 = time.perf_counter()
            state = fn(state)
            sync()
            times[name].append(1e3 * (time.perf_counter() - t0))
    return {name: statistics.median(ts[2:]) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    import cupy as cp

    from convkernels import get_backend
    from models import load_model

    be = get_backend("cuda", dtype="float16")
    sync = cp.cuda.get_current_stream().synchronize
    rng = np.random.default_rng(0)
    rows = []

    sd = load_model("sd", "sd-vae", be)
    lat = rng.standard_normal((1, 4, 64, 64)).astype(np.float32)
    sd.decode(lat, tiled=False)
    sd.decode(lat, tiled=False)
    stages = [
        ("host pre", lambda _: np.ascontiguousarray(lat.transpose(0, 2, 3, 1)) / np.float32(sd.scaling_factor)),
        ("to device", lambda z: be.asarray(z)),
        ("graph replay", lambda z: sd._decode_device(z)),
        # conv_out maps x / 2 + 0.5 and the widening kernel clips: the copy is all that is left
        ("to host", lambda y: be.to_host_async(y, (0.0, 1.0)).result()),
        ("host post", lambda y: y),
    ]
    t = stage_times(stages, sync, args.reps)
    whole = statistics.median([_timed(lambda: sd.decode(lat, tiled=False), sync) for _ in range(args.reps)])
    rows.append(("sd-vae decode 1x4x64x64 fp16", t, whole))

    enc = load_model("enc", "convnext-tiny", be)
    for n in (1, 32):
        px = rng.random((n, 224, 224, 3), dtype=np.float32)
        enc.encode(px)
        enc.encode(px)
        stages = [
            ("host pre", lambda _: enc._host_input(px)),
            ("to device", lambda x: be.asarray(x)),
            ("graph replay", lambda x: enc._encode_device(x)),
            ("to host", lambda out: [be.to_host(o) for o in out if o is not None]),
            ("host post", lambda out: [o.astype(np.float32, copy=False) for o in out]),
        ]
        t = stage_times(stages, sync, args.reps)
        whole = statistics.median([_timed(lambda: enc.encode(px), sync) for _ in range(args.reps)])
        rows.append((f"convnext-tiny 224 n{n} fp16", t, whole))

    names = [name for name, _ in stages]
    print(f"# stage breakdown (ms, median of {args.reps}), {be.describe().get('gpu')}, CUDA graphs on")
    print("| workload | " + " | ".join(names) + " | sum | whole call |")
    print("| --- |" + " --- |" * (len(names) + 2))
    for name, t, whole in rows:
        print(f"| {name} | " + " | ".join(f"{t[k]:.3f}" for k in names) + f" | {sum(t.values()):.3f} | {whole:.3f} |")


def _timed(fn, sync) -> float:
    sync()
    t0 = time.perf_counter()
    fn()
    sync()
    return 1e3 * (time.perf_counter() - t0)


if __name__ == "__main__":
    main()
