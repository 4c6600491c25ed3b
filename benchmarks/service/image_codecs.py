"""Single-thread cost of encoding one decoded image, per format and encoder, and how many cores keep
pace with the GPUs (one H100 decodes ~185 SD-VAE 512x512 images/s; 1-4 GPUs: 185-740 img/s).

Images (RGB uint8, 512x512 and 1024x1024): `smooth` -- gradients, hard-edged discs and boxes, mild
Gaussian noise (sigma 2 levels), a stand-in for a decoded picture; `noise` -- uniform random pixels,
the worst case for every encoder (nothing to predict). Decoded SD images lie between the two.

Each encoder is timed as the service would call it (PIL: Image.fromarray + save into a BytesIO +
getvalue, which is `service.codecs.image_bytes`), one thread, median of repeats after a warm-up.
Every output is decoded back with PIL: lossless outputs must equal the input; lossy ones report PSNR.
Encoders from other packages are measured when importable (simplejpeg, imagecodecs, fpng,
opencv-python-headless); install them in a scratch venv to include them.

--gil: the same encodes on 1 vs 2 threads of one process vs 2 processes, to see whether PIL
releases the GIL while it encodes (threads scale) on this box.

    python benchmarks/service/image_codecs.py                  # table + cores to keep pace
    python benchmarks/service/image_codecs.py --gil            # also the threads-vs-processes check
    python benchmarks/service/image_codecs.py --sizes 512 --quick
"""
from __future__ import annotations

import argparse
import io
import math
import multiprocessing
import os
import statistics
import sys
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
from PIL import Image, features

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo (benchmarks.machine)
from benchmarks.machine import describe_machine  # noqa: E402

RATES = (185, 740)  # img/s: one H100's SD-VAE 512x512 decode rate, and four


# ---- images ------------------------------------------------------------------------------------
def smooth_image(size: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    chans = [0.5 + 0.35 * np.sin(2 * np.pi * (rng.uniform(0.3, 1.5) * x + rng.uniform(0.3, 1.5) * y)
                                 + rng.uniform(0, 2 * np.pi)) for _ in range(3)]
    img = np.stack(chans, axis=-1)
    for _ in range(10):  # discs with a shaded interior, hard edges
        cx, cy, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.04, 0.2)
        d2 = (x - cx) ** 2 + (y - cy) ** 2
        m = d2 < r * r
        shade = 1.0 - 0.5 * d2[m] / (r * r)
        img[m] = rng.uniform(0, 1, 3) * shade[:, None]
    for _ in range(6):  # flat boxes
        x0, y0 = rng.integers(0, size - 8, 2)
        w, h = rng.integers(8, size // 4, 2)
        img[y0:y0 + h, x0:x0 + w] = rng.uniform(0, 1, 3)
    img = img * 255.0 + rng.normal(0.0, 2.0, img.shape)
    return np.clip(img + 0.5, 0, 255).astype(np.uint8)


def noise_image(size: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (size, size, 3), dtype=np.uint8)


# ---- encoders: name -> (kind, fn(rgb) -> bytes) ---------------------------------------------------
def _pil(fmt: str, **kw):
    def enc(rgb: np.ndarray) -> bytes:
        buf = io.BytesIO()
        Image.fromarray(rgb, mode="RGB").save(buf, format=fmt, **kw)
        return buf.getvalue()
    return enc


def encoders(quick: bool) -> dict[str, tuple[str, callable]]:
    e: dict[str, tuple[str, callable]] = {}
    for lvl in ((1,) if quick else (0, 1, 2, 6)):
        e[f"PIL PNG level {lvl}"] = ("png", _pil("PNG", compress_level=lvl))
    e["PIL PNG level 1 Z_RLE"] = ("png", _pil("PNG", compress_level=1, compress_type=zlib.Z_RLE))
    if not quick:
        e["PIL PNG level 1 Z_HUFFMAN_ONLY"] = ("png", _pil("PNG", compress_level=1, compress_type=zlib.Z_HUFFMAN_ONLY))
    try:  # the service's own writer (NumPy SUB filter + the standard library's zlib)
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
        from service.codecs import png_bytes
        e["convserve png_bytes (SUB, zlib 1, Z_RLE)"] = ("png", png_bytes)
        if not quick:
            e["convserve png_bytes (SUB, zlib 1, default)"] = (
                "png", lambda a: png_bytes(a, strategy=zlib.Z_DEFAULT_STRATEGY))
    except ImportError:
        pass
    e["PIL JPEG q90"] = ("jpeg", _pil("JPEG", quality=90))
    for m in ((0, 4) if quick else range(7)):
        e[f"PIL WebP q90 method {m}"] = ("webp", _pil("WEBP", quality=90, method=m))
    try:
        import simplejpeg
        e["simplejpeg q90 420"] = ("jpeg", lambda a: simplejpeg.encode_jpeg(
            a, quality=90, colorspace="RGB", colorsubsampling="420", fastdct=False))
        e["simplejpeg q90 420 fastdct"] = ("jpeg", lambda a: simplejpeg.encode_jpeg(
            a, quality=90, colorspace="RGB", colorsubsampling="420", fastdct=True))
    except ImportError:
        pass
    try:
        import imagecodecs
        e["imagecodecs png level 1"] = ("png", lambda a: imagecodecs.png_encode(a, level=1))
        e["imagecodecs png level 1 RLE SUB"] = ("png", lambda a: imagecodecs.png_encode(a, level=1, strategy=3, filter=16))
        e["imagecodecs spng level 1"] = ("png", lambda a: imagecodecs.spng_encode(a, level=1))
        e["imagecodecs jpeg8 q90 420"] = ("jpeg", lambda a: imagecodecs.jpeg8_encode(a, level=90, subsampling="420"))
        e["imagecodecs webp q90 method 0"] = ("webp", lambda a: imagecodecs.webp_encode(a, level=90, lossless=False, method=0))
    except ImportError:
        pass
    try:
        import fpng
        e["fpng"] = ("png", fpng.from_ndarray)
    except ImportError:
        pass
    try:
        import cv2
        cv2.setNumThreads(1)
        e["opencv png level 1"] = ("png", lambda a: cv2.imencode(
            ".png", cv2.cvtColor(a, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_PNG_COMPRESSION, 1])[1].tobytes())
        e["opencv jpeg q90"] = ("jpeg", lambda a: cv2.imencode(
            ".jpg", cv2.cvtColor(a, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 90])[1].tobytes())
    except ImportError:
        pass
    return e


# ---- measurement ---------------------------------------------------------------------------------
def time_encode(fn, img: np.ndarray, min_s: float, min_reps: int = 3, max_reps: int = 60) -> tuple[float, bytes]:
    out = fn(img)  # warm-up
    times = []
    deadline = time.perf_counter() + min_s
    while len(times) < min_reps or (time.perf_counter() < deadline and len(times) < max_reps):
        t0 = time.perf_counter()
        fn(img)
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, out


def check(kind: str, img: np.ndarray, data: bytes) -> str:
    back = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    if back.shape != img.shape:
        return "BAD SHAPE"
    if kind == "png":
        return "exact" if np.array_equal(back, img) else "DIFFERS"
    mse = np.mean((back.astype(np.float64) - img) ** 2)
    return "inf" if mse == 0 else f"{10 * math.log10(255 ** 2 / mse):.1f} dB"


def to_uint8_ms(size: int) -> float:
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    try:
        from service.codecs import to_uint8
    except ImportError:  # a scratch venv without the service's dependencies: the same expression
        def to_uint8(images01):
            return (np.clip(images01, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)
    x = np.random.default_rng(0).random((1, size, size, 3), dtype=np.float32)
    return time_encode(to_uint8, x, 0.3)[0]


def _worker(args):
    name, size, n = args
    fn = encoders(quick=False)[name][1]
    img = smooth_image(size)
    t0 = time.perf_counter()
    for _ in range(n):
        fn(img)
    return time.perf_counter() - t0


def gil_check(names: list[str], size: int, seconds: float) -> None:
    """~`seconds` of encodes per thread: one thread; two threads of one process; two processes.
    "2-thread CPU" = process CPU time / wall time while two threads encode: ~1.0 when the encoder
    holds the GIL, up to 2.0 when it releases it (less on a loaded box, for every row alike)."""
    print(f"\n## threads vs processes, {size}x{size} smooth, wall seconds for the same encodes "
          f"(x = speed-up vs 1 thread; 2.0 = perfect on 2 cores); load average {os.getloadavg()[0]:.2f}")
    print("| encoder | encodes | 1 thread s | 2 threads s | threads x | 2-thread CPU | 2 processes s | processes x |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    enc = encoders(quick=False)
    img = smooth_image(size)
    ctx = multiprocessing.get_context("fork")
    for name in names:
        fn = enc[name][1]
        n = max(5, int(seconds / time_encode(fn, img, 0.2)[0] * 1e3))
        t0 = time.perf_counter()
        for _ in range(2 * n):
            fn(img)
        t1 = time.perf_counter() - t0
        with ThreadPoolExecutor(2) as ex:
            list(ex.map(lambda _: fn(img), range(4)))  # warm the threads
            t0, c0 = time.perf_counter(), time.process_time()
            list(ex.map(lambda _: [fn(img) for _ in range(n)], range(2)))
            t2, c2 = time.perf_counter() - t0, time.process_time() - c0
        with ctx.Pool(2) as pool:
            pool.map(_worker, [(name, size, 1)] * 2)
            t0 = time.perf_counter()
            pool.map(_worker, [(name, size, n)] * 2)
            tp = time.perf_counter() - t0
        print(f"| {name} | {2 * n} | {t1:.2f} | {t2:.2f} | {t1 / t2:.2f} | {c2 / t2:.2f} | {tp:.2f} | {t1 / tp:.2f} |",
              flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--min-s", type=float, default=0.4, help="seconds of repeats per cell (at least 3)")
    ap.add_argument("--quick", action="store_true", help="fewer PNG levels and WebP methods")
    ap.add_argument("--gil", action="store_true", help="also time 1 vs 2 threads vs 2 processes")
    ap.add_argument("--gil-s", type=float, default=1.0, help="seconds of encodes per thread in --gil")
    ap.add_argument("--gil-only", action="store_true", help="only the threads-vs-processes check")
    ap.add_argument("--only", nargs="*", help="encoder names containing any of these substrings")
    args = ap.parse_args()

    print(f"machine: {describe_machine()}")
    print(f"load average before: {os.getloadavg()[0]:.2f}; Pillow {Image.__version__}, "
          f"libjpeg-turbo {getattr(Image.core, 'libjpeg_turbo_version', '?')}, libwebp {features.version('webp')}, "
          f"Pillow's deflate: zlib-ng {getattr(Image.core, 'zlib_ng_version', None)} (HAVE_ZLIBNG="
          f"{getattr(Image.core, 'HAVE_ZLIBNG', None)}, zlib {features.version('zlib')}), "
          f"Python's zlib {zlib.ZLIB_VERSION}")
    gil_names = [n for n in ("PIL PNG level 1", "convserve png_bytes (SUB, zlib 1, Z_RLE)", "PIL JPEG q90",
                             "PIL WebP q90 method 4", "PIL WebP q90 method 0", "simplejpeg q90 420",
                             "imagecodecs png level 1 RLE SUB", "fpng") if n in encoders(quick=False)]
    if args.gil_only:
        gil_check(gil_names, 512, args.gil_s)
        return
    enc = encoders(args.quick)
    if args.only:
        enc = {k: v for k, v in enc.items() if any(s.lower() in k.lower() for s in args.only)}
    images = {(kind, s): f(s) for s in args.sizes for kind, f in (("smooth", smooth_image), ("noise", noise_image))}
    cols = [(k, s) for s in args.sizes for k in ("smooth", "noise")]
    print("\nms = median single-thread ms per image; KB = output size (raw RGB: "
          + ", ".join(f"{s}x{s} {s * s * 3 // 1024} KB" for s in args.sizes) + ")")
    for s in args.sizes:
        print(f"to_uint8 (float32 [0,1] -> uint8, done before any encoder) {s}x{s}: {to_uint8_ms(s):.2f} ms")
    head = " | ".join(f"{k} {s} ms | KB | check" for k, s in cols)
    print(f"\n| encoder | {head} |")
    print("|" + " --- |" * (1 + 3 * len(cols)))
    results: dict[str, dict] = {}
    for name, (kind, fn) in enc.items():
        row = {}
        for c in cols:
            ms, data = time_encode(fn, images[c], args.min_s)
            row[c] = (ms, len(data), check(kind, images[c], data))
        results[name] = row
        print(f"| {name} | " + " | ".join(f"{row[c][0]:.2f} | {row[c][1] / 1024:.0f} | {row[c][2]}" for c in cols)
              + " |", flush=True)

    s = 512 if 512 in args.sizes else args.sizes[0]
    print(f"\n## cores to keep pace ({s}x{s}, single-thread ms from the table; cores = rate x ms / 1000, "
          f"on this box's cores; smooth / noise)")
    print("| encoder | " + " | ".join(f"{r} img/s" for r in RATES) + " | one core img/s |")
    print("| --- |" + " --- |" * (len(RATES) + 1))
    for name, row in results.items():
        ms_s, ms_n = row[("smooth", s)][0], row[("noise", s)][0]
        cells = [f"{r * ms_s / 1000:.1f} / {r * ms_n / 1000:.1f}" for r in RATES]
        print(f"| {name} | " + " | ".join(cells) + f" | {1000 / ms_s:.0f} / {1000 / ms_n:.0f} |")
    print(f"load average after: {os.getloadavg()[0]:.2f}")

    if args.gil:
        gil_check(gil_names, 512, args.gil_s)


if __name__ == "__main__":
    main()
