"""Where a JPEG encode body is decoded fastest: the front end's CPU (the service's own path,
`service/codecs/images.open_image`: PIL's libjpeg-turbo, one thread) or the GPU (nvImageCodec,
a batch of bodies in one call, decoded into GPU memory).

The bodies are what `service_throughput.py --workload encode --format jpeg` sends: photo-like
224x224 RGB at quality 90 (its `photo_like`), 64 distinct ones. For each batch size, one
`Decoder.decode(list_of_bytes)` call per batch, repeated for --seconds, the stream synchronised
after each (the pixels are on the device, as the model wants them), for each of nvImageCodec's
backends: HW_GPU_ONLY (the GPU's hardware JPEG engines, NVJPG: A100, H100, H200), GPU_ONLY (CUDA
kernels) and HYBRID_CPU_GPU (Huffman decoding on the CPU). Printed: img/s, the host CPU
microseconds per image (process time, the decoder's own threads included: what a front end or
worker would pay), and how far the GPU's pixels are from PIL's (decoders may round their IDCT
differently).

Needs: an NVIDIA GPU, CuPy, and nvImageCodec (`pip install nvidia-nvimgcodec-cu13`, with
nvidia-nvjpeg for CUDA 13); without them it says what is missing and exits 2.

    python benchmarks/service/gpu_jpeg_decode.py [--batches 1 8 32 128] [--seconds 3] [--size 224]
"""
from __future__ import annotations

import argparse
import io
import sys
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo
from gpu_jpeg import run_for  # noqa: E402
from service_throughput import photo_like  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from service.codecs.images import open_image  # noqa: E402


def bodies(size: int, n: int = 64) -> list[bytes]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(photo_like(rng, size)).save(buf, format="JPEG", quality=90)
        out.append(buf.getvalue())
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    print(f"machine: {describe_machine()}")
    data = bodies(args.size)
    print(f"bodies: {len(data)} photo-like {args.size}x{args.size} JPEGs at q90, {np.mean([len(d) for d in data]) / 1024:.1f} KB")

    # the service's own path, one thread
    k = [0]

    def cpu_one():
        k[0] += 1
        return open_image(data[k[0] % len(data)], max_pixels=1 << 26)

    calls, wall, cpu = run_for(cpu_one, args.seconds)
    cpu_ips = calls / wall
    print(f"\nfront end's decode (open_image, PIL, 1 thread): {cpu_ips:.0f} img/s, {1e6 * cpu / calls:.0f} us CPU an image")

    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
        from nvidia import nvimgcodec
    except Exception as exc:
        print(f"gpu_jpeg_decode: CuPy with a GPU and nvImageCodec are needed ({exc.__class__.__name__}: {exc}); "
              f"the GPU side is not measured.")
        return 2
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"gpu: {name}, CuPy {cp.__version__}, nvImageCodec {getattr(nvimgcodec, '__version__', '?')}")
    stream = cp.cuda.get_current_stream()
    ref = open_image(data[0], max_pixels=1 << 26)
    print("\n| backend | batch | GPU img/s | host CPU us an image | GPU / one CPU thread | max / mean abs diff to PIL |")
    print("| --- | --- | --- | --- | --- | --- |")
    for kind in ("HW_GPU_ONLY", "GPU_ONLY", "HYBRID_CPU_GPU"):
        try:
            decoder = nvimgcodec.Decoder(backends=[nvimgcodec.Backend(getattr(nvimgcodec.BackendKind, kind))])
            first = decoder.decode(data[:1])
            gpu0 = cp.asnumpy(cp.asarray(first[0]))
        except Exception as exc:  # a backend this GPU or build does not have
            print(f"| {kind} | - | not available: {exc.__class__.__name__}: {str(exc)[:120]} | | | |")
            continue
        diff = np.abs(gpu0.astype(np.int16) - ref.astype(np.int16))
        for b in args.batches:
            batch = [data[i % len(data)] for i in range(b)]

            def gpu():
                out = decoder.decode(batch, cuda_stream=stream.ptr)
                stream.synchronize()
                return out

            out = gpu()
            if out is None or len(out) != b or any(o is None for o in out):
                print(f"| {kind} | {b} | decode gave {0 if out is None else len(out)} of {b} images: failed | | | |")
                continue
            calls, wall, cpu = run_for(gpu, args.seconds)
            ips = b * calls / wall
            print(f"| {kind} | {b} | {ips:.0f} | {1e6 * cpu / (b * calls):.1f} | {ips / cpu_ips:.1f}x "
                  f"| {diff.max()} / {diff.mean():.3f} |", flush=True)
    print("\nGPU / one CPU thread: how many front-end threads of JPEG decode one GPU decoder replaces.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
