"""Images in (JPEG/PNG/WebP, checked from the header before any pixel is decoded) and out
(PNG/JPEG/WebP, a zip for several), and the resize an encoder's input takes. Everything here
raises Problem with a 4xx on bad input; CPU-heavy parts run in the codec pool."""
from __future__ import annotations

import io
import math
import zipfile
import zlib

import numpy as np
from PIL import Image, UnidentifiedImageError

from ..problems import Problem

ZIP_MEDIA = "application/zip"

IMAGE_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg"),
                 "jpg": ("JPEG", "image/jpeg"), "webp": ("WEBP", "image/webp")}


# ---- in --------------------------------------------------------------------------------------------
def open_image(data: bytes, max_pixels: int, what: str = "image", max_aspect_ratio: float | None = None) -> np.ndarray:
    """Decode JPEG/PNG/WebP bytes to uint8 H,W,3. The size (and, for images to be resized, the
    aspect ratio) is checked from the header before the pixels are decoded, so a decompression
    bomb costs nothing."""
    try:
        img = Image.open(io.BytesIO(data))
    except Image.DecompressionBombError as exc:
        raise Problem(413, "image-too-large", f"{what}: {exc}") from exc
    except (UnidentifiedImageError, OSError) as exc:
        raise Problem(415, "undecodable-image", f"{what}: not a decodable JPEG/PNG/WebP image") from exc
    except Exception as exc:  # a plugin choking on hostile chunks (ValueError, struct.error...)
        if "too large" in str(exc):  # PIL's text/ICC chunk bomb limits
            raise Problem(413, "image-too-large", f"{what}: {exc}") from exc
        raise Problem(415, "undecodable-image", f"{what}: not a decodable JPEG/PNG/WebP image ({exc})") from exc
    w, h = img.size
    if w * h > max_pixels:
        raise Problem(413, "image-too-large", f"{what}: {w}x{h} = {w * h} pixels exceeds the limit of {max_pixels}")
    if max_aspect_ratio is not None:
        check_source_image(h, w, max_pixels, max_aspect_ratio, what)
    if img.format not in ("JPEG", "PNG", "WEBP"):
        raise Problem(415, "undecodable-image", f"{what}: format {img.format} not accepted (JPEG, PNG, WebP)")
    try:
        img.load()
        # convert() copies even an image that is RGB already (most JPEGs): a third of a small one's decode
        return np.asarray(img if img.mode == "RGB" else img.convert("RGB"), dtype=np.uint8)
    except Image.DecompressionBombError as exc:
        raise Problem(413, "image-too-large", f"{what}: {exc}") from exc
    except Exception as exc:  # truncated or corrupt data, whatever the decoder raises for it
        raise Problem(422, "undecodable-image", f"{what}: image data is corrupt ({exc.__class__.__name__}: {exc})") from exc


def check_source_image(height: int, width: int, max_pixels: int, max_aspect_ratio: float, what: str = "image") -> None:
    """Limits on an image before it is resized to a model's input: its pixels (what it costs to
    hold) and its aspect ratio (a 1xN strip is no picture; resized to fill the model's input it
    would be a long thin sliver of a single source row)."""
    if height * width > max_pixels:
        raise Problem(413, "image-too-large",
                      f"{what}: {width}x{height} = {width * height} pixels exceeds the limit of {max_pixels}")
    ratio = max(height, width) / max(min(height, width), 1)
    if ratio > max_aspect_ratio:
        raise Problem(422, "extreme-aspect-ratio",
                      f"{what}: {width}x{height} has an aspect ratio of {ratio:.4g}, above the limit of "
                      f"{max_aspect_ratio:g} (CONVSERVE_MAX_ASPECT_RATIO)")


def _resize_box(img: np.ndarray, size: int, box: tuple[float, float, float, float]) -> np.ndarray:
    """Bicubic resize of the source region `box` (left, top, right, bottom; fractional) of uint8 or
    float H,W,C to size x size x C, float32 in [0,1] (PIL 'F' mode keeps full precision). Only the
    rows and columns the filter reaches are converted to float, a channel at a time."""
    h, w = img.shape[:2]
    left, top, right, bottom = box
    # bicubic support is 2 source pixels per output pixel, scaled when downsampling; +2 for rounding
    reach_x, reach_y = 2 * max((right - left) / size, 1.0) + 2, 2 * max((bottom - top) / size, 1.0) + 2
    x0, x1 = max(0, math.floor(left - reach_x)), min(w, math.ceil(right + reach_x))
    y0, y1 = max(0, math.floor(top - reach_y)), min(h, math.ceil(bottom + reach_y))
    region = img[y0:y1, x0:x1]
    local = (left - x0, top - y0, right - x0, bottom - y0)
    scale = np.float32(1 / 255.0) if img.dtype == np.uint8 else np.float32(1.0)
    return np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(region[..., c], dtype=np.float32) * scale,
                                                mode="F").resize((size, size), Image.BICUBIC, box=local))
                     for c in range(img.shape[-1])], axis=-1)


def preprocess(img: np.ndarray, input_size: int, crop_pct: float = 0.875) -> np.ndarray:
    """uint8 or float [0,1] H,W,3 -> float32 input_size x input_size x 3 in [0,1]: shortest side
    resized to input_size / crop_pct, then a centre crop (the ConvNeXt evaluation transform).
    Mean/std normalisation is the model's own job.

    The crop is taken before the resize: only the source region under the crop is resampled,
    straight to input_size x input_size (PIL's filter reads past the region's edges, so the
    pixels are those of resize-then-crop). Resizing the whole image first would allocate the
    resized image, which for a 1xN strip is input_size^2 * N pixels, whatever the body size."""
    h, w = img.shape[:2]
    if (h, w) == (input_size, input_size):
        x = img.astype(np.float32) / 255.0 if img.dtype == np.uint8 else img.astype(np.float32)
        return np.clip(x, 0.0, 1.0)
    short = max(input_size, int(round(input_size / crop_pct)))
    scale = short / min(h, w)
    nh, nw = max(input_size, round(h * scale)), max(input_size, round(w * scale))
    top, left = (nh - input_size) // 2, (nw - input_size) // 2
    sy, sx = h / nh, w / nw  # source pixels per resized pixel, as the full resize would use
    box = (left * sx, top * sy, (left + input_size) * sx, (top + input_size) * sy)
    return np.clip(_resize_box(img, input_size, box), 0.0, 1.0)


def model_pixels(images: list[np.ndarray], input_size: int) -> np.ndarray:
    """Images (uint8, or float in [0,1], any size) -> the batch an encoder takes: uint8 N,S,S,3
    when every image already is uint8 at the model's size (it travels to the device as it is,
    a quarter of float32's bytes, and is converted there), else float32 through `preprocess`."""
    if all(im.dtype == np.uint8 and im.shape[:2] == (input_size, input_size) for im in images):
        # one image (most requests): a view; the front end copies it into shared memory next anyway
        return images[0][None] if len(images) == 1 else np.stack(images)
    return np.stack([preprocess(im, input_size) for im in images])


# ---- out -------------------------------------------------------------------------------------------
def to_uint8(images01: np.ndarray) -> np.ndarray:
    """Float pixels in [0,1] -> uint8 (what the device's own conversion computes); uint8 pixels
    (converted on the device already) pass as they are."""
    if images01.dtype == np.uint8:
        return images01
    return (np.clip(images01, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _png_chunk(tag: bytes, data) -> list:
    return [len(data).to_bytes(4, "big"), tag, data, zlib.crc32(data, zlib.crc32(tag)).to_bytes(4, "big")]


def png_bytes(rgb: np.ndarray, strategy: int = zlib.Z_RLE) -> bytes:
    """uint8 H,W,3 -> an 8-bit RGB PNG (H,W,4: RGBA, alpha last, unpremultiplied). Every row gets PNG filter 1 (SUB: each byte minus the byte
    one pixel to its left, mod 256; one NumPy subtract for the whole image), then a single deflate
    at level 1 with Z_RLE (the "fast" settings of OpenCV's and imagecodecs' PNG writers).

    PIL's PNG writer spends most of its time choosing a filter per row (level 0 cost 16 of level 1's
    25 ms on a 512x512 image); this writes that image in 7 ms, 362 KB vs PIL's 426 KB, with the
    standard library's zlib (benchmarks/service/image_codecs.py, HISTORY.md "image codecs"). Z_RLE only
    repeats the previous byte: exact synthetic gradients (period-3 patterns) come out far larger than
    PIL's, still below a quarter of the raw pixels; decoded images, never noise-free, come out smaller."""
    h, w, c = rgb.shape
    rows = np.ascontiguousarray(rgb).reshape(h, w * c)
    filtered = np.empty((h, w * c + 1), dtype=np.uint8)
    filtered[:, 0] = 1  # filter type: SUB
    filtered[:, 1:1 + c] = rows[:, :c]
    np.subtract(rows[:, c:], rows[:, :-c], out=filtered[:, 1 + c:])  # uint8: wraps mod 256
    z = zlib.compressobj(1, zlib.DEFLATED, 15, 8, strategy)
    idat = memoryview(z.compress(filtered) + z.flush())
    color_type = PNG_COLOR_TYPES[c]  # 8 bits a channel, no interlace
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes((8, color_type, 0, 0, 0))
    parts = [b"\x89PNG\r\n\x1a\n", *_png_chunk(b"IHDR", ihdr)]
    for i in range(0, len(idat), _IDAT_MAX):  # a chunk's length must stay below 2**31
        parts += _png_chunk(b"IDAT", idat[i:i + _IDAT_MAX])
    parts += _png_chunk(b"IEND", b"")
    return b"".join(parts)


_IDAT_MAX = 1 << 30
#: channels -> PNG colour type: truecolour (RGB), truecolour with alpha (RGBA)
PNG_COLOR_TYPES = {3: 2, 4: 6}
# WebP method (0 fastest .. 6 smallest): 0 encoded a 512x512 image in 6 ms vs method 4's (PIL's
# default) 27 ms, for 11-15 % more bytes at the same PSNR (benchmarks/service/image_codecs.py).
WEBP_METHOD = 0


def image_bytes(rgb: np.ndarray, fmt: str, quality: int) -> bytes:
    """uint8 H,W,3 (or H,W,4: RGBA, for PNG and WebP; JPEG holds no alpha) -> the file's bytes."""
    pil_fmt = IMAGE_FORMATS[fmt][0]
    if pil_fmt == "PNG" and rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] in PNG_COLOR_TYPES and rgb.size:
        return png_bytes(rgb)
    buf = io.BytesIO()
    kwargs = ({"quality": quality} if pil_fmt == "JPEG" else
              {"quality": quality, "method": WEBP_METHOD} if pil_fmt == "WEBP" else {"compress_level": 1})
    Image.fromarray(rgb, mode="RGBA" if rgb.shape[-1] == 4 else "RGB").save(buf, format=pil_fmt, **kwargs)
    return buf.getvalue()


def zip_bytes(files: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in files:
            zf.writestr(name, data)
    return buf.getvalue()


def encode_images(images01: np.ndarray, fmt: str, quality: int) -> tuple[bytes, str]:
    """N,H,W,3 (or RGBA N,H,W,4) in [0,1] -> one image's bytes, or a zip of image_000.<ext>, image_001.<ext>..."""
    rgb = to_uint8(images01)
    if rgb.shape[0] == 1:
        return image_bytes(rgb[0], fmt, quality), IMAGE_FORMATS[fmt][1]
    ext = "jpg" if fmt == "jpeg" else fmt
    return zip_bytes([(f"image_{i:03d}.{ext}", image_bytes(im, fmt, quality))
                      for i, im in enumerate(rgb)]), ZIP_MEDIA
