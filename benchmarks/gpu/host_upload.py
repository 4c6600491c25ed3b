"""How a large host batch is fastest put on the GPU: the ways a ConvNeXt-T b128 float32 batch
(128 x 224 x 224 x 3, 77 MB) could cross, each timed alone, then our encode of it from the host
beside the same encode from device pixels.

Why: ConvNeXt-T b128 from host float32 pixels took 21.4 ms on an H100 where the network itself takes
7.2 ms (2026-11-25): the crossing, not the model, is most of the call. Above the pinned staging
slots' 64 MB an upload takes CuPy's path for pageable memory.

Ways, each the median of --reps after a warm-up, synchronised:
- cupy.asarray: CuPy's own upload of a pageable array (what a batch above the staging slots takes);
- pageable memcpy: one cudaMemcpyAsync straight from the pageable array (the driver stages it);
- pinned, 1 thread: np.copyto into a pinned buffer, then one DMA;
- pinned, k threads: the copy into the pinned buffer split over k threads, each part's DMA queued
  as it lands (copies overlap DMAs);
- registered: cudaHostRegister of the array's pages, one DMA, cudaHostUnregister;
- DMA only: from a pinned buffer already holding the batch (the floor of every way);
- ours: the CUDA backend's asarray in float16 (ParallelUpload, convkernels/backends/cuda/transfer.py, then
  the cast on the device).

Run (repo root, CUDA machine): PYTHONPATH=. python3 benchmarks/gpu/host_upload.py [--batch 128] [--reps 7]
"""
from __future__ import annotations

import argparse
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(os.path.dirname(HERE))]  # this group's scripts; the repo
from benchmarks.machine import describe_machine  # noqa: E402
from gpu_models import wall  # noqa: E402  (median ms of reps calls after warm-ups, synchronised)


def timed(fn, reps: int, sync) -> float:
    return wall(fn, 1, reps, sync)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()

    import cupy as cp
    import cupyx

    rt = cp.cuda.runtime
    stream = cp.cuda.get_current_stream()
    px = np.random.default_rng(0).random((args.batch, 224, 224, 3), dtype=np.float32)
    flat = px.reshape(-1).view(np.uint8)
    dev = cp.empty(px.shape, np.float32)
    pinned = cupyx.empty_pinned(px.shape, np.float32)
    pinned_flat = pinned.reshape(-1).view(np.uint8)
    np.copyto(pinned, px)
    print(describe_machine(), cp.cuda.runtime.getDeviceProperties(0)["name"].decode(),
          f"batch {px.shape}, {px.nbytes / 2**20:.0f} MiB float32", flush=True)

    def dma(src_ptr: int, off: int, n: int) -> None:
        rt.memcpyAsync(dev.data.ptr + off, src_ptr + off, n, rt.memcpyHostToDevice, stream.ptr)

    rows = {"DMA only (pinned already)": lambda: dma(pinned.ctypes.data, 0, px.nbytes),
            "cupy.asarray": lambda: cp.asarray(px),
            "pageable memcpy": lambda: dma(px.ctypes.data, 0, px.nbytes)}

    def pinned_copy(threads: int, parts: int):
        pool = ThreadPoolExecutor(threads) if threads > 1 else None
        bounds = np.linspace(0, px.nbytes, parts + 1).astype(np.int64) // 64 * 64
        bounds[-1] = px.nbytes

        def part(i: int) -> None:
            a, b = int(bounds[i]), int(bounds[i + 1])
            np.copyto(pinned_flat[a:b], flat[a:b])
            dma(pinned.ctypes.data, a, b - a)

        def run() -> None:
            if pool is None:
                np.copyto(pinned, px)
                dma(pinned.ctypes.data, 0, px.nbytes)
            else:
                list(pool.map(part, range(parts)))
        return run

    rows["pinned, 1 thread"] = pinned_copy(1, 1)
    for k in (2, 4, 8):
        rows[f"pinned, {k} threads, {4 * k} parts"] = pinned_copy(k, 4 * k)

    def registered() -> None:
        rt.hostRegister(px.ctypes.data, px.nbytes, 0)
        try:
            dma(px.ctypes.data, 0, px.nbytes)
            stream.synchronize()
        finally:
            rt.hostUnregister(px.ctypes.data)
    rows["registered (register, DMA, unregister)"] = registered

    print("| way | ms | GB/s |\n| --- | --- | --- |")
    for name, fn in rows.items():
        ms = timed(fn, args.reps, stream.synchronize)
        print(f"| {name} | {ms:.2f} | {px.nbytes / ms / 1e6:.1f} |", flush=True)

    from convkernels import get_backend
    from models import load_model

    be = get_backend("cuda", dtype="float16")
    ms = timed(lambda: be.asarray(px), args.reps, stream.synchronize)
    print(f"| ours: asarray to float16 (threads {be.arrays.large.threads}) | {ms:.2f} | {px.nbytes / ms / 1e6:.1f} |")
    model = load_model("cnx", "convnext-tiny", be)
    model.encode(px)
    model.encode(px)  # records the graph
    xd = be.asarray(px)
    host_ms = timed(lambda: model.encode(px), args.reps, stream.synchronize)
    dev_ms = timed(lambda: model._encode_device(xd), args.reps, stream.synchronize)
    print(f"\nconvnext-tiny b{args.batch} fp16: encode from host float32 {host_ms:.2f} ms, "
          f"the graphed forward from device pixels {dev_ms:.2f} ms")


if __name__ == "__main__":
    main()
