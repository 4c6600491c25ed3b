"""JPEG encode on the GPU (nvImageCodec, images already in GPU memory as CuPy arrays) vs PIL's
libjpeg-turbo on one CPU core, 512x512 RGB uint8 at quality 90, 4:2:0 (PIL's default at q90; the
nvImageCodec default would be 4:4:4 and larger files).

For batch 1, 8, 32: one `Encoder.encode(list_of_cupy_images, "jpeg", params)` call per batch
(it returns host bytes, so the call includes the copy back and the wait), repeated for --seconds;
prints img/s, the host CPU ms spent per image (process time: what the front-end's cores pay), mean
bytes, and the ratio to PIL on one core. The first output of each batch is decoded with PIL and its
PSNR against the source printed, beside PIL's own.

Needs: an NVIDIA GPU, CuPy, and nvImageCodec (`pip install nvidia-nvimgcodec-cu13` or the carried
wheel); without them it says what is missing and exits 2. Written for CUDA 13 / CuPy 14 /
Python 3.12 on an H100; not run on the CPU-only development box.

    python benchmarks/service/gpu_jpeg.py [--batches 1 8 32] [--seconds 3] [--quality 90]

`--decode` measures the other direction: where an encode request's JPEG body decodes fastest, the
front end's own path (`service/codecs/images.open_image`: PIL's libjpeg-turbo, one thread) or
the GPU (nvImageCodec, a batch of bodies in one `Decoder.decode(list_of_bytes)` call, into GPU
memory, the stream synchronised after each), for each of nvImageCodec's backends: HW_GPU_ONLY
(the GPU's hardware JPEG engines, NVJPG: A100, H100, H200), GPU_ONLY (CUDA kernels) and
HYBRID_CPU_GPU (Huffman decoding on the CPU). The bodies are what `service_throughput.py
--workload encode --format jpeg` sends: photo-like 224x224 RGB at q90 (its `photo_like`). Printed:
img/s, the host CPU microseconds per image (process time, the decoder's own threads included:
what a front end or worker would pay), and how far the GPU's pixels are from PIL's.

    python benchmarks/service/gpu_jpeg.py --decode [--batches 1 8 32 128] [--size 224]
"""
from __future__ import annotations

import argparse
import io
import math
import sys
import time
from pathlib import Path

import numpy as np
from PIL import Image

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parents[1])]  # this group's scripts; the repo (benchmarks.machine)
from image_codecs import smooth_image  # noqa: E402
from service_throughput import photo_like  # noqa: E402
from benchmarks.machine import describe_machine  # noqa: E402
from service.codecs.images import open_image  # noqa: E402


def psnr(a: np.ndarray, jpeg: bytes) -> float:
    b = np.asarray(Image.open(io.BytesIO(jpeg)).convert("RGB"), dtype=np.float64)
    mse = np.mean((b - a) ** 2)
    return math.inf if mse == 0 else 10 * math.log10(255 ** 2 / mse)


def pil_jpeg(rgb: np.ndarray, quality: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb, mode="RGB").save(buf, format="JPEG", quality=quality)
    return buf.getvalue()


def run_for(fn, seconds: float) -> tuple[int, float, float]:
    """Calls fn until `seconds` have passed (at least 3 calls): calls, wall s, process CPU s."""
    fn()  # warm-up (first call allocates the encoder's buffers)
    calls, w0, c0 = 0, time.perf_counter(), time.process_time()
    while calls < 3 or time.perf_counter() - w0 < seconds:
        fn()
        calls += 1
    return calls, time.perf_counter() - w0, time.process_time() - c0


def encode_params(nvimgcodec, quality: int):
    css = nvimgcodec.ChromaSubsampling.CSS_420
    try:  # nvImageCodec >= 0.5
        return nvimgcodec.EncodeParams(quality_type=nvimgcodec.QualityType.QUALITY, quality_value=float(quality),
                                       chroma_subsampling=css)
    except (AttributeError, TypeError):  # older releases took quality= directly
        return nvimgcodec.EncodeParams(quality=float(quality), chroma_subsampling=css)


def gpu_and_codec():
    """(cupy, nvimgcodec) where both work here, else None (with the reason printed)."""
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or CuPy without a usable GPU/driver
        print(f"gpu_jpeg: CuPy with a CUDA GPU is needed ({exc.__class__.__name__}: {exc}); the GPU is not measured.")
        return None
    try:
        from nvidia import nvimgcodec
    except Exception as exc:
        print(f"gpu_jpeg: nvImageCodec is not importable ({exc.__class__.__name__}: {exc}); install "
              f"nvidia-nvimgcodec-cu13 (or -cu12 to match CUDA). The GPU is not measured.")
        return None
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"gpu: {name}, CuPy {cp.__version__}, nvImageCodec {getattr(nvimgcodec, '__version__', '?')}")
    return cp, nvimgcodec


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--decode", action="store_true", help="time decoding encode bodies instead of encoding")
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 1 8 32 (decode: 1 8 32 128)")
    ap.add_argument("--size", type=int, default=None, help="default: 512 (decode: 224)")
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()
    args.batches = args.batches or ([1, 8, 32, 128] if args.decode else [1, 8, 32])
    args.size = args.size or (224 if args.decode else 512)

    print(f"machine: {describe_machine()}")
    if args.decode:
        return decode(args)
    found = gpu_and_codec()
    if found is None:
        return 2
    cp, nvimgcodec = found

    n_distinct = max(args.batches)
    host = [smooth_image(args.size, seed=i) for i in range(min(n_distinct, 8))]
    host = [host[i % len(host)] for i in range(n_distinct)]
    dev_batch = cp.asarray(np.stack(host))  # N,H,W,3 uint8 on the GPU, as a decoder's output would be
    dev = [dev_batch[i] for i in range(n_distinct)]  # views, C-contiguous each
    cp.cuda.get_current_stream().synchronize()
    stream = cp.cuda.get_current_stream().ptr

    try:
        encoder = nvimgcodec.Encoder(backend_kinds=[nvimgcodec.BackendKind.GPU_ONLY])
    except (AttributeError, TypeError):
        encoder = nvimgcodec.Encoder()
        print("note: could not restrict the encoder to GPU backends; it may fall back to the CPU")
    params = encode_params(nvimgcodec, args.quality)

    # PIL on one CPU core, the same pixels
    ref = pil_jpeg(host[0], args.quality)
    calls, wall, _ = run_for(lambda: pil_jpeg(host[0], args.quality), args.seconds)
    pil_ips = calls / wall
    print(f"\nPIL JPEG q{args.quality} (libjpeg-turbo, 1 thread): {pil_ips:.0f} img/s, {1e3 * wall / calls:.2f} ms/img, "
          f"{len(ref) / 1024:.1f} KB, PSNR {psnr(host[0], ref):.1f} dB")

    print("\n| batch | GPU img/s | host CPU ms/img | KB/img | PSNR dB | GPU / PIL 1 core |")
    print("| --- | --- | --- | --- | --- | --- |")
    for b in args.batches:
        imgs = dev[:b]
        out = encoder.encode(imgs, "jpeg", params=params, cuda_stream=stream)
        if out is None or len(out) != b or any(o is None for o in out):
            print(f"| {b} | encode returned {0 if out is None else len(out)} of {b} images: failed |  |  |  |  |")
            continue
        calls, wall, cpu = run_for(lambda: encoder.encode(imgs, "jpeg", params=params, cuda_stream=stream), args.seconds)
        ips = b * calls / wall
        kb = sum(len(o) for o in out) / b / 1024
        print(f"| {b} | {ips:.0f} | {1e3 * cpu / (b * calls):.2f} | {kb:.1f} | {psnr(host[0], bytes(out[0])):.1f} | "
              f"{ips / pil_ips:.1f}x |", flush=True)
    print("\nGPU / PIL 1 core = how many CPU cores of PIL JPEG one GPU encoder replaces (on this host's cores).")
    return 0


def bodies(size: int, quality: int, n: int = 64) -> list[bytes]:
    rng = np.random.default_rng(1)
    out = []
    for _ in range(n):
        buf = io.BytesIO()
        Image.fromarray(photo_like(rng, size)).save(buf, format="JPEG", quality=quality)
        out.append(buf.getvalue())
    return out


def decode(args) -> int:
    """--decode: the front end's PIL against nvImageCodec's backends (the docstring above)."""
    data = bodies(args.size, args.quality)
    print(f"bodies: {len(data)} photo-like {args.size}x{args.size} JPEGs at q{args.quality}, {np.mean([len(d) for d in data]) / 1024:.1f} KB")

    # the service's own path, one thread
    k = [0]

    def cpu_one():
        k[0] += 1
        return open_image(data[k[0] % len(data)], max_pixels=1 << 26)

    calls, wall, cpu = run_for(cpu_one, args.seconds)
    cpu_ips = calls / wall
    print(f"\nfront end's decode (open_image, PIL, 1 thread): {cpu_ips:.0f} img/s, {1e6 * cpu / calls:.0f} us CPU an image")

    found = gpu_and_codec()
    if found is None:
        return 2
    cp, nvimgcodec = found
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
