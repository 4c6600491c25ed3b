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
from benchmarks.machine import describe_machine  # noqa: E402


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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--size", type=int, default=512)
    ap.add_argument("--quality", type=int, default=90)
    ap.add_argument("--seconds", type=float, default=3.0)
    args = ap.parse_args()

    print(f"machine: {describe_machine()}")
    try:
        import cupy as cp
        cp.cuda.runtime.getDeviceCount()
    except Exception as exc:  # ImportError, or CuPy without a usable GPU/driver
        print(f"gpu_jpeg: CuPy with a CUDA GPU is needed ({exc.__class__.__name__}: {exc}); nothing measured.")
        return 2
    try:
        from nvidia import nvimgcodec
    except Exception as exc:
        print(f"gpu_jpeg: nvImageCodec is not importable ({exc.__class__.__name__}: {exc}); install "
              f"nvidia-nvimgcodec-cu13 (or -cu12 to match CUDA). Nothing measured.")
        return 2
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    print(f"gpu: {name}, CuPy {cp.__version__}, nvImageCodec {getattr(nvimgcodec, '__version__', '?')}")

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


if __name__ == "__main__":
    sys.exit(main())
