"""One decode across several GPUs: a group of processes, one per GPU and narrowed to
it as the service's model workers are, joined by NCCL (convkernels.collectives.nccl), each decoding its
band of latent rows with the model's own decode on a row shard (models.sharding.decode_band /
frame_groups_band); the bands' pixels are joined here.

This is the standalone form (a fresh group per call: `convserve decode --shards`, the GPU tests and
benchmarks/gpu/sharded_decode.py use it); the service's `shards=` requests use its per-GPU workers,
led by the first (service/worker/shard_leader.py).
Every rank loads the same model: the same weights file, or the same seeded random init.

A rank that fails fails the call: its error comes back, and the group's other processes, which
would wait in NCCL for it forever, are killed.
"""
from __future__ import annotations

import importlib
import multiprocessing as mp
import os
import queue as queue_errors
import time
from dataclasses import dataclass, field

import numpy as np

#: how long a rank may take to load, decode and answer before the group is given up (seconds)
DEFAULT_TIMEOUT_S = 600.0


@dataclass
class ShardedResult:
    images: np.ndarray              # N, (F,) H, W, 3 float32 in [0, 1], as model.decode(latents, tiled=False)
                                    # (alpha: N, H, W, 4, as model.decode_rgba)
    seconds: list[float]            # per timed repeat: the slowest rank's wall time
    pool_bytes: list[int]           # per rank: the CuPy pool's bytes after the decodes (its high-water mark),
                                    # the recorded graphs' pools included
    bands: list[tuple[int, int]] = field(default_factory=list)  # latent rows per rank
    graph_replays: list[int] = field(default_factory=list)  # per rank: sharded steady steps replayed from a graph
    group_seconds: list[list[float]] = field(default_factory=list)  # videos, per rank: each frame group's interval
                                                                    # in the last timed decode (a group is waited
                                                                    # for after the next is queued: its throughput)


def _rank_main(rank: int, size: int, gpu: str, uid, job: dict, answers) -> None:
    os.environ["CUDA_VISIBLE_DEVICES"] = gpu  # before CuPy is imported: this process sees one GPU
    try:
        from convkernels import get_backend
        from convkernels.collectives.nccl import NcclShards
        from models import ModelOptions, load_model, sharding
        from models.wan_vae.model import joined_groups

        backend = get_backend("cuda", dtype=job["dtype"], cuda_options=job["cuda_options"])
        model = load_model("sharded", job["preset"], backend, weights=job["weights"],
                           options=ModelOptions(seed=job["seed"]))
        rows, total = job["rows"], job["total_rows"]
        plan = sharding.ChunkPlan(*job["chunk_plan"]) if job.get("chunk_plan") else None
        nccl = comm = NcclShards.join(uid, rank, size) if size > 1 else None
        if comm is not None and job.get("timing_comm"):  # benchmarks only: "module:Class", made (rank, size)
            module, _, name = job["timing_comm"].partition(":")
            comm = getattr(importlib.import_module(module), name)(rank, size)
        if job.get("fail_rank") == rank:  # test-only fault: this rank dies while the others wait in NCCL
            raise RuntimeError("injected failure (fail_rank)")

        intervals: list[float] = []

        def timed(groups):
            """A video's frame groups joined in time as model.decode joins them (each copied in as it
            lands, while the device works on the next), each group's interval (from the previous
            one's landing) kept in `intervals`."""
            intervals.clear()

            def stamped():
                t = time.perf_counter()
                for g in groups:
                    now = time.perf_counter()
                    intervals.append(now - t)
                    t = now
                    yield g

            return joined_groups(stamped(), model.output_frames(rows.shape[2]))

        def once():
            video = sharding.check(model).video  # Qwen-Image's latents may be N,C,1,h,w too
            if comm is None and job["whole"]:  # the single-GPU baseline, as served
                if video:
                    return timed(model.decode_frames(rows, tiled=False))
                return model.decode_rgba(rows, tiled=False) if job["alpha"] else model.decode(rows, tiled=False)
            from convkernels.collectives.shard_comm import run_sharded

            def one(c):
                if video:
                    return timed(sharding.frame_groups_band(model, c, rows, total, plan=plan))
                return sharding.decode_band(model, c, rows, total, alpha=job["alpha"])
            return one(comm) if comm is not None else run_sharded(1, lambda c, r: one(c))[0]

        once()  # builds the plans
        out = once()  # the whole decode captures its CUDA graph on its second call
        times = []
        for _ in range(job["reps"]):
            if comm is not None:
                comm.allreduce_sum(np.zeros(1))  # every rank starts together (a host result: synchronised)
            backend.synchronize()
            t0 = time.perf_counter()
            out = once()
            times.append(time.perf_counter() - t0)
        replays = sum(getattr(step, "replays", 0) for step in getattr(model, "sharded_steps", {}).values())
        held = backend.describe()
        answers.put((rank, "ok", out, times, held.get("pool_bytes", 0) + held.get("graph_pool_bytes", 0), replays,
                     list(intervals)))
        if nccl is not None:  # a timing communicator stood in for it, or not: the group is closed
            nccl.close()
    except BaseException as e:  # the parent reports it and stops the others
        answers.put((rank, "error", f"{type(e).__name__}: {e}", [], 0, 0, []))


def decode_on_gpus(preset: str, latents: np.ndarray, gpus: list[str], dtype: str = "float16", *,
                   weights: str | None = None, seed: int = 0, reps: int = 0, whole: bool = False,
                   timeout_s: float = DEFAULT_TIMEOUT_S, fail_rank: int | None = None,
                   timing_comm: str | None = None, cuda_options: dict | None = None,
                   chunk_plan: tuple[int, bool] | None = None, alpha: bool = False) -> ShardedResult:
    """model.decode(latents, tiled=False) of `preset` split by latent rows over `gpus` (their
    CUDA_VISIBLE_DEVICES entries), one process each. whole=True with one GPU: the unsharded
    decode (the baseline). reps: timed repeats after the first call. fail_rank: a test-only fault.
    timing_comm: "module:Class" of a communicator each rank uses instead of its NCCL one, for timing
    what the shards compute apart from what they exchange (benchmarks/gpu/sharded_decode.py --no-exchange:
    its output is not the decode's). cuda_options: every rank's CUDA backend options (CudaOptions
    fields: the server's are Settings.backend_options()["cuda_options"]; {"cuda_graphs": False} runs
    every rank eagerly, {"autotune": True} times each new conv's cuDNN plans on the first call).
    chunk_plan: (frames, graphed), how a sharded video's ranks step their latent frames
    (models.sharding.ChunkPlan; by default their bands decide). alpha: an AlphaDecoder's RGBA
    (model.decode_rgba, models/contract.py) instead of its RGB."""
    from convkernels.collectives.nccl import NcclShards
    from convkernels.collectives.shard_comm import split, split_rows
    from models.sharding import LATENT_ROWS, PIXEL_ROWS

    lat = np.ascontiguousarray(latents, np.float32)
    size = len(gpus)
    if whole and size != 1:
        raise ValueError("whole=True is the one-GPU baseline: give one GPU")
    bands = split_rows(lat.shape[LATENT_ROWS], size)
    parts = split(lat, bands, axis=LATENT_ROWS)
    ctx = mp.get_context("spawn")
    answers = ctx.Queue()
    uid = NcclShards.unique_id() if size > 1 else None
    procs = [ctx.Process(target=_rank_main, daemon=True, args=(
        r, size, gpus[r], uid, dict(preset=preset, dtype=dtype, weights=weights, seed=seed, rows=parts[r],
                                    total_rows=lat.shape[LATENT_ROWS], reps=reps, whole=whole, fail_rank=fail_rank,
                                    timing_comm=timing_comm, cuda_options=dict(cuda_options or {}),
                                    chunk_plan=chunk_plan, alpha=alpha),
        answers)) for r in range(size)]
    for p in procs:
        p.start()
    got: dict[int, tuple] = {}
    deadline = time.monotonic() + timeout_s
    try:
        while len(got) < size:
            try:
                answer = answers.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue_errors.Empty:
                raise TimeoutError(f"sharded decode: ranks {sorted(set(range(size)) - set(got))} gave no answer "
                                   f"in {timeout_s:.0f} s") from None
            rank, status, out, times, pool, replays, intervals = answer
            if status != "ok":
                raise RuntimeError(f"sharded decode: rank {rank} (GPU {gpus[rank]}) failed: {out}")
            got[rank] = (out, times, pool, replays, intervals)
    finally:
        for p in procs:
            p.join(timeout=5 if len(got) == size else 0)
            if p.is_alive():
                p.kill()
    images = np.concatenate([got[r][0] for r in range(size)], axis=PIXEL_ROWS)  # N,(F,)H,W,3
    seconds = [max(got[r][1][i] for r in range(size)) for i in range(reps)]
    return ShardedResult(images, seconds, [got[r][2] for r in range(size)], bands, [got[r][3] for r in range(size)],
                         [got[r][4] for r in range(size)])
