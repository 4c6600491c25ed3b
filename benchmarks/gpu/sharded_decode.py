"""The sharded decode's rows: one decode (SD-VAE by default; Wan 2.1 with --preset wan2.1-vae --latent
16x21x60x104 --dtype bfloat16), untiled and exact, on 1 GPU and split by rows over 2 (and 4) GPUs,
in one run: wall time (the slowest rank, host latents to host pixels), the CuPy
pool's bytes per GPU (the recorded graphs' pools included), and the sharded output's distance
from the one-GPU decode.

The one-GPU row is model.decode(latents, tiled=False) as the service runs it (CUDA graphs where
the graph's pool stays under the bound); the sharded rows are service.worker.shard_group.decode_on_gpus
(one process per GPU, NCCL; Wan's steady chunks replay graphs that hold the collectives).
Weights: the same seeded random init on every GPU (timing; parity is tests/gpu/test_sharded_decode_gpus.py).

Run (repo root, a multi-GPU machine): PYTHONPATH=. python3 benchmarks/gpu/sharded_decode.py
[--size 4096] [--gpus 1,2,4] [--dtype float16] [--reps 3] [--plans 2e,3e,4e] (video: chunk plans side by side)
[--autotune] (timed cuDNN plans on every rank). Writes $OUT/sharded_decode_<preset>_<shape>_<dtype>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))  # the repo


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


class NoExchange:
    """Timing only (--no-exchange): a communicator whose collectives answer at once from the shard's
    own data, in the shapes a real one gives (its own edge rows for the neighbours', its own tokens
    for every shard's), so that a rank's time is what it computes apart from what it exchanges. Its
    output is not the decode's."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size

    def exchange_rows(self, top, bottom):
        return (top if self.rank > 0 else None), (bottom if self.rank < self.size - 1 else None)

    def allreduce_sum(self, a):
        return a

    def allgather(self, a, lengths=None):
        return [a] * self.size


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="sd-vae")
    ap.add_argument("--size", type=int, default=4096, help="image side in pixels (latent side = size / 8)")
    ap.add_argument("--latent", help="the latents' shape without the batch, e.g. 16x21x60x104 for Wan 2.1 "
                                     "81x480x832 (overrides --size)")
    ap.add_argument("--gpus", default="1,2,4", help="group sizes to run (those above the GPU count are skipped)")
    ap.add_argument("--dtype", default="float16")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--f32-reference", action="store_true",
                    help="also decode once in float32 on one GPU and give every row's distance from it "
                         "(a sharded half-precision decode is within the one-GPU decode's own error)")
    ap.add_argument("--no-graphs", action="store_true",
                    help="every rank (the one-GPU baseline too) without CUDA graphs: the lower-memory setting")
    ap.add_argument("--autotune", action="store_true",
                    help="every rank (the one-GPU baseline too) times its cuDNN plans per conv (the service's "
                         "CONVSERVE_CUDA_AUTOTUNE=1): the untimed first call takes the timing")
    ap.add_argument("--no-exchange", action="store_true",
                    help="also time each group size with NoExchange in place of NCCL: what the shards compute "
                         "apart from what they exchange")
    ap.add_argument("--plans", default="",
                    help="video only: comma-separated chunk plans to time on each group size above one, FRAMES "
                         "then g (graphed) or e (eager), e.g. 1e,1g,2e,2g (models.sharding.ChunkPlan); "
                         "default: the plan the bands choose")
    args = ap.parse_args()
    plans = [(int(p[:-1]), p[-1] == "g") for p in args.plans.split(",") if p] or [None]

    from service.worker.shard_group import decode_on_gpus

    visible = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True).stdout.strip().splitlines()
    shape = tuple(map(int, args.latent.split("x"))) if args.latent else (4, args.size // 8, args.size // 8)
    latents = np.random.default_rng(0).standard_normal((1, *shape)).astype(np.float32)
    what = f"latents {'x'.join(map(str, shape))}" if args.latent else f"{args.size}x{args.size}"
    rows, base = [], None
    f32 = decode_on_gpus(args.preset, latents, ["0"], "float32", whole=True).images if args.f32_reference else None
    runs = [(n, plan) for n in map(int, args.gpus.split(",")) for plan in (plans if n > 1 else [None])]
    for n, plan in runs:
        if n > len(visible):
            print(f"skipping {n} GPUs: {len(visible)} visible", flush=True)
            continue
        t0 = time.time()
        res = decode_on_gpus(args.preset, latents, [str(i) for i in range(n)], args.dtype, reps=args.reps,
                             whole=(n == 1), cuda_options={"cuda_graphs": not args.no_graphs, "autotune": args.autotune},
                             chunk_plan=plan)
        ms = 1e3 * statistics.median(res.seconds)
        if base is None:
            base = (ms, res.images, max(res.pool_bytes))
        err = rel_l2(res.images, base[1])
        row = dict(gpus=n, chunk_plan=plan, ms=ms, vs_one=ms / base[0], pool_gib_per_gpu=max(res.pool_bytes) / 2**30,
                   memory_vs_one=max(res.pool_bytes) / base[2], rel_l2_vs_one=err, bands=res.bands,
                   call_s=time.time() - t0, all_ms=[1e3 * s for s in res.seconds], graph_replays=res.graph_replays,
                   rel_l2_vs_f32=None if f32 is None else rel_l2(res.images, f32))
        rows.append(row)
        named = "" if plan is None else f" plan {plan[0]}{'g' if plan[1] else 'e'}"
        print(f"{args.preset} {what} {args.dtype}{' no graphs' if args.no_graphs else ''}{named} on {n} GPU(s): "
              f"{ms:9.1f} ms "
              f"({ms / base[0]:.2f}x one "
              f"GPU), pool {row['pool_gib_per_gpu']:.2f} GiB/GPU ({row['memory_vs_one']:.2f}x), rel L2 vs one GPU "
              f"{err:.2e}" + ("" if f32 is None else f", vs float32 {row['rel_l2_vs_f32']:.2e}")
              + f"  [call {row['call_s']:.0f} s, graph replays per rank {res.graph_replays}]", flush=True)
        if res.group_seconds and res.group_seconds[0]:  # a video: where a decode's time goes, group by group
            slowest = [1e3 * max(col) for col in zip(*res.group_seconds)]
            row["group_ms"] = slowest
            # a run of frames (a plan of 2 or more) hands out its groups together: the later groups'
            # mean per latent frame is what compares across plans, not their median
            print(f"    frame groups (slowest rank, ms): first {slowest[0]:.1f}, second {slowest[1]:.1f}, "
                  f"third {slowest[2]:.1f}, later ones {statistics.mean(slowest[3:]):.1f} per latent frame "
                  f"(max {max(slowest[3:]):.1f})", flush=True)
        if args.no_exchange and n > 1:
            bare = decode_on_gpus(args.preset, latents, [str(i) for i in range(n)], args.dtype, reps=args.reps,
                                  timing_comm="sharded_decode:NoExchange", cuda_options={"autotune": args.autotune},
                                  chunk_plan=plan)
            bare_ms = 1e3 * statistics.median(bare.seconds)
            row["no_exchange_ms"] = bare_ms
            line = f"    without the exchanges (NoExchange, output not the decode's): {bare_ms:.1f} ms"
            if bare.group_seconds and bare.group_seconds[0]:
                slow = [1e3 * max(col) for col in zip(*bare.group_seconds)]
                line += f"; frame groups first {slow[0]:.1f}, later ones {statistics.mean(slow[3:]):.1f} ms per latent frame"
            print(line, flush=True)
    env = dict(date=time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), gpus=visible, preset=args.preset,
               workload=what, dtype=args.dtype, cuda_graphs=not args.no_graphs, autotune=args.autotune)
    out = os.environ.get("OUT", "out")
    os.makedirs(out, exist_ok=True)
    tag = (f"{args.preset}_{'x'.join(map(str, shape))}_{args.dtype}" + ("_nographs" if args.no_graphs else "")
           + ("_autotune" if args.autotune else ""))
    with open(os.path.join(out, f"sharded_decode_{tag}.json"), "w") as f:
        json.dump(dict(env=env, rows=rows), f, indent=1)
    print(f"\n# sharded decode, {env['date']}, {len(visible)}x {visible[0] if visible else '?'}")
    print("| GPUs | chunk plan | ms | vs one GPU | pool GiB per GPU | memory vs one | rel L2 vs one GPU |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        plan = "bands'" if r["chunk_plan"] is None else f"{r['chunk_plan'][0]}{'g' if r['chunk_plan'][1] else 'e'}"
        print(f"| {r['gpus']} | {plan} | {r['ms']:.1f} | {r['vs_one']:.2f} | {r['pool_gib_per_gpu']:.2f} | "
              f"{r['memory_vs_one']:.2f} | {r['rel_l2_vs_one']:.2e} |")


if __name__ == "__main__":
    main()
