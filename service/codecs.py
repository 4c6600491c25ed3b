"""Payload codecs: tensors in (.npy, safetensors, JSON+base64), images in (JPEG/PNG/WebP),
images out (PNG/JPEG/WebP, zip for several), tensors out (.npy), ranked labels out (`top_k`).
Video lives in video.py. Everything here raises Problem with a 4xx on bad input; CPU-heavy parts
run in the codec pool."""
from __future__ import annotations

import base64
import binascii
import io
import json
import math
import operator
import zipfile
import zlib

import numpy as np
from PIL import Image, UnidentifiedImageError

from .npy_parse import parse_npy
from .problems import Problem

NPY_MEDIA = "application/x-npy"
SAFETENSORS_MEDIA = "application/vnd.safetensors"
ZIP_MEDIA = "application/zip"

IMAGE_FORMATS = {"png": ("PNG", "image/png"), "jpeg": ("JPEG", "image/jpeg"),
                 "jpg": ("JPEG", "image/jpeg"), "webp": ("WEBP", "image/webp")}

_DTYPES = {"float16": np.float16, "float32": np.float32, "float64": np.float64,
           "fp16": np.float16, "fp32": np.float32, "fp64": np.float64, "uint8": np.uint8}
_ST_DTYPES = {"F16": np.float16, "F32": np.float32, "F64": np.float64, "U8": np.uint8}


def bf16_to_f32(raw: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32: bf16 is the top half of an fp32."""
    return (raw.astype(np.uint32) << 16).view(np.float32)


def load_json(data, what: str, kind: str = "bad-json"):
    """json.loads as a request parser needs it: malformed JSON and JSON nested too deeply for the
    parser (a RecursionError, not a ValueError) are both a 400 naming `what`."""
    try:
        return json.loads(data)
    except RecursionError:
        raise Problem(400, kind, f"{what} is nested too deeply to parse") from None
    except ValueError as exc:
        raise Problem(400, kind, f"{what} is not JSON ({exc})") from exc


def shape_text(shape) -> str:
    """A declared shape for an error message, cut short: a hostile one may have thousands of entries."""
    text = str(list(shape))
    return text if len(text) <= 120 else f"{text[:100]}... ({len(shape)} dimensions)"


def reshape(arr: np.ndarray, shape, what: str) -> np.ndarray:
    """arr.reshape(shape) for a client-declared shape: whatever numpy cannot make (more than its
    maximum of dimensions, a dimension or total size beyond what an array can index, even with
    no elements) is a 400, not a ValueError escaping as a 500."""
    try:
        return arr.reshape(shape)
    except (ValueError, TypeError, OverflowError) as exc:
        raise Problem(400, "bad-tensor", f"{what}: shape {shape_text(shape)} is not a possible array ({exc})") from None


def _frombuffer(buf: bytes, dtype_name: str, shape, what: str) -> np.ndarray:
    try:
        shape = tuple(operator.index(s) for s in shape)
    except TypeError:
        raise Problem(400, "bad-tensor", f"{what}: shape must be a list of ints, got {shape!r:.200}") from None
    if any(s < 0 for s in shape):
        raise Problem(400, "bad-tensor", f"{what}: negative dimension in shape {shape_text(shape)}")
    if dtype_name in ("bfloat16", "bf16", "BF16"):
        dt = np.dtype("<u2")
    elif dtype_name.lower() in _DTYPES:
        dt = np.dtype(_DTYPES[dtype_name.lower()]).newbyteorder("<")
    else:
        raise Problem(415, "unsupported-dtype",
                      f"{what}: dtype {dtype_name!r} is not supported; use float32, float16, bfloat16 or float64")
    n = math.prod(shape)  # Python ints: a fuzzed huge shape must not overflow int64
    if n * dt.itemsize != len(buf):
        raise Problem(400, "bad-tensor",
                      f"{what}: {len(buf)} bytes do not hold shape {shape_text(shape)} of {dtype_name} "
                      f"({n * dt.itemsize} bytes)")
    arr = reshape(np.frombuffer(buf, dtype=dt), shape, what)
    return bf16_to_f32(arr) if dt == np.dtype("<u2") else arr


def read_npy(body: bytes, what: str = "body", takes_images: bool = False) -> np.ndarray:
    """A .npy body (npy_parse.parse_npy: sizes checked before anything is made, no pickles); an
    image sent as one is named in a 415 saying which Content-Type to use instead."""
    refuse_misnamed(body, NPY_MEDIA, takes_images)
    return parse_npy(body, what)


def read_safetensors(body: bytes, prefer: str) -> np.ndarray:
    """The tensor named `prefer` (or the only tensor) from safetensors bytes; bf16 upcast."""
    if len(body) < 8:
        raise Problem(400, "bad-safetensors", "safetensors body shorter than its 8-byte header length")
    n = int.from_bytes(body[:8], "little")
    if n > len(body) - 8:
        raise Problem(400, "bad-safetensors", f"safetensors header length {n} exceeds the body")
    header = load_json(body[8:8 + n], "safetensors header", "bad-safetensors")
    if not isinstance(header, dict):
        raise Problem(400, "bad-safetensors", "safetensors header is not a JSON object")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    if prefer in tensors:
        name = prefer
    elif len(tensors) == 1:
        name = next(iter(tensors))
    else:
        raise Problem(400, "bad-safetensors",
                      f"safetensors body holds {sorted(tensors)}; name the tensor {prefer!r} or send one tensor")
    info = tensors[name]
    try:
        begin, end = (int(v) for v in info["data_offsets"])
        st_dtype, shape = info["dtype"], info["shape"]
        if not isinstance(st_dtype, str) or not isinstance(shape, list):
            raise TypeError("dtype must be a string and shape a list")
    except (KeyError, TypeError, ValueError) as exc:
        raise Problem(400, "bad-safetensors", f"safetensors entry {name!r} is malformed") from exc
    base = 8 + n
    if not 0 <= begin <= end <= len(body) - base:
        raise Problem(400, "bad-safetensors", f"safetensors offsets of {name!r} lie outside the body")
    dtype_name = "bfloat16" if st_dtype == "BF16" else (
        np.dtype(_ST_DTYPES[st_dtype]).name if st_dtype in _ST_DTYPES else st_dtype)
    return _frombuffer(body[base + begin:base + end], dtype_name, shape, f"tensor {name!r}")


def read_json_tensor(body: bytes) -> tuple[np.ndarray, dict]:
    """{"data": base64 little-endian bytes, "shape": [...], "dtype": "float32"}; other keys are
    returned as options."""
    doc = load_json(body, "body")
    if not isinstance(doc, dict) or not {"data", "shape"} <= doc.keys():
        raise Problem(400, "bad-json", 'JSON body must be {"data": base64, "shape": [...], "dtype": "float32"}')
    try:
        raw = base64.b64decode(doc["data"], validate=True)
    except (binascii.Error, TypeError, ValueError) as exc:
        raise Problem(400, "bad-json", f"data is not valid base64 ({exc})") from exc
    if not isinstance(doc["shape"], list):
        raise Problem(400, "bad-json", "shape must be a list of ints")
    arr = _frombuffer(raw, str(doc.get("dtype", "float32")), doc["shape"], "data")
    opts = {k: v for k, v in doc.items() if k not in ("data", "shape", "dtype")}
    return arr, opts


def media_type(content_type: str | None) -> str:
    return (content_type or "").split(";")[0].strip().lower()


#: Content-Types that say nothing about the body: none, octet-stream, and curl's default for
#: `--data-binary` (form-urlencoded). Bodies sent with them are recognised by their first bytes.
GENERIC_MEDIA = ("", "application/octet-stream", "application/x-www-form-urlencoded")
TENSOR_MEDIA_TEXT = f"{NPY_MEDIA}, {SAFETENSORS_MEDIA} or application/json"
IMAGE_MEDIA_TEXT = "image/jpeg, image/png, image/webp"


def sniff(body: bytes) -> str | None:
    """The media type a body's magic bytes show: image/png, image/jpeg, image/webp, .npy, or
    safetensors (an 8-byte little-endian header length that fits the body, then a JSON object);
    None when none fits."""
    head = bytes(body[:16])
    if head.startswith(b"\x89PNG\r\n\x1a\n"):
        return "image/png"
    if head.startswith(b"\xff\xd8\xff"):
        return "image/jpeg"
    if head[:4] == b"RIFF" and head[8:12] == b"WEBP":
        return "image/webp"
    if head.startswith(b"\x93NUMPY"):
        return NPY_MEDIA
    if len(head) > 8 and head[8:9] == b"{" and int.from_bytes(head[:8], "little") <= len(body) - 8:
        return SAFETENSORS_MEDIA
    return None


def refuse_misnamed(body: bytes, mt: str, takes_images: bool = False) -> None:
    """A 415 for a body whose magic bytes (`sniff`) contradict how it would be read as `mt`: an
    image sent to a tensor reader, named, with the Content-Type that takes it (takes_images) or the
    tensor types this route takes; a .npy file sent as JSON or safetensors (which would otherwise
    fail as undecodable UTF-8 or a header length past the body, with no hint of the cause)."""
    sniffed = sniff(body)
    if sniffed is None:
        return
    said = "" if mt in GENERIC_MEDIA else f", not the {mt} its Content-Type says"
    if sniffed.startswith("image/"):
        fix = (f"send it with Content-Type: {sniffed}" if takes_images
               else f"this route takes tensors, not images: send {TENSOR_MEDIA_TEXT}")
        raise Problem(415, "unsupported-media-type", f"the body is a {sniffed.split('/')[1].upper()} image{said}; {fix}")
    if sniffed == NPY_MEDIA and mt not in (NPY_MEDIA, "application/npy", *GENERIC_MEDIA):
        raise Problem(415, "unsupported-media-type",
                      f"the body looks like a .npy file{said}; send it with Content-Type: {NPY_MEDIA}")


def read_tensor_body(body: bytes, content_type: str | None, prefer: str,
                     takes_images: bool = False) -> tuple[np.ndarray, dict]:
    """Latents (or pixels) from a request body by its Content-Type; a body whose Content-Type
    says nothing (GENERIC_MEDIA) is recognised by its magic bytes (.npy, else safetensors). A body
    whose magic bytes contradict its Content-Type (an image, a .npy sent as JSON) is named in a 415
    (refuse_misnamed) instead of failing in the wrong parser; takes_images: the route also takes
    image files (the 415 then names the image's own Content-Type)."""
    mt = media_type(content_type)
    refuse_misnamed(body, mt, takes_images)
    if mt in GENERIC_MEDIA:
        sniffed = sniff(body)
        if sniffed is not None or mt != "application/x-www-form-urlencoded":
            mt = sniffed or SAFETENSORS_MEDIA  # unrecognised bytes: safetensors' parser names what is wrong
    if mt == "application/json":
        return read_json_tensor(body)
    if mt in (NPY_MEDIA, "application/npy"):
        return parse_npy(body), {}
    if mt == SAFETENSORS_MEDIA:
        return read_safetensors(body, prefer), {}
    raise Problem(415, "unsupported-media-type", f"Content-Type {mt!r} not accepted; send {TENSOR_MEDIA_TEXT}")


def npy_parts(arr: np.ndarray) -> tuple[bytes, memoryview]:
    """The .npy header np.save writes for arr, and a byte view of its data (C order): joined,
    the file's bytes, with the data copied once (np.save into a BytesIO and getvalue() copied it
    twice, plus the buffer's growth: 7-38 ms for one 480x832 video frame on a 2-core box)."""
    arr = np.ascontiguousarray(arr)
    if arr.dtype.hasobject:
        raise ValueError("npy: object arrays are not written (no pickles)")
    return _npy_head(np.lib.format.header_data_from_array_1_0(arr)), memoryview(arr.reshape(-1)).cast("B")


def npy_header(shape: tuple[int, ...], dtype: np.dtype) -> bytes:
    """The .npy header np.save writes for a C-order array of this shape and dtype (the data,
    shape-many items, follows it): for answers whose data is sent in parts."""
    return _npy_head({"descr": np.lib.format.dtype_to_descr(np.dtype(dtype)), "fortran_order": False,
                      "shape": tuple(int(s) for s in shape)})


def _npy_head(header: dict) -> bytes:
    head = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(head, header)
    except ValueError:  # a header over 64 KiB: format 2.0, as np.save would choose
        head = io.BytesIO()
        np.lib.format.write_array_header_2_0(head, header)
    return head.getvalue()


def npy_bytes(arr: np.ndarray) -> bytes:
    return b"".join(npy_parts(arr))


# ---- images ----------------------------------------------------------------------------------------
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
        return np.asarray(img.convert("RGB"), dtype=np.uint8)
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
        return np.stack(images)
    return np.stack([preprocess(im, input_size) for im in images])


def to_uint8(images01: np.ndarray) -> np.ndarray:
    """Float pixels in [0,1] -> uint8 (what the device's own conversion computes); uint8 pixels
    (converted on the device already) pass as they are."""
    if images01.dtype == np.uint8:
        return images01
    return (np.clip(images01, 0.0, 1.0) * 255.0 + 0.5).astype(np.uint8)


def _png_chunk(tag: bytes, data) -> list:
    return [len(data).to_bytes(4, "big"), tag, data, zlib.crc32(data, zlib.crc32(tag)).to_bytes(4, "big")]


def png_bytes(rgb: np.ndarray, strategy: int = zlib.Z_RLE) -> bytes:
    """uint8 H,W,3 -> an 8-bit RGB PNG. Every row gets PNG filter 1 (SUB: each byte minus the byte
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
    ihdr = w.to_bytes(4, "big") + h.to_bytes(4, "big") + bytes((8, 2, 0, 0, 0))  # 8-bit RGB, no interlace
    parts = [b"\x89PNG\r\n\x1a\n", *_png_chunk(b"IHDR", ihdr)]
    for i in range(0, len(idat), _IDAT_MAX):  # a chunk's length must stay below 2**31
        parts += _png_chunk(b"IDAT", idat[i:i + _IDAT_MAX])
    parts += _png_chunk(b"IEND", b"")
    return b"".join(parts)


_IDAT_MAX = 1 << 30
# WebP method (0 fastest .. 6 smallest): 0 encoded a 512x512 image in 6 ms vs method 4's (PIL's
# default) 27 ms, for 11-15 % more bytes at the same PSNR (benchmarks/service/image_codecs.py).
WEBP_METHOD = 0


def image_bytes(rgb: np.ndarray, fmt: str, quality: int) -> bytes:
    pil_fmt = IMAGE_FORMATS[fmt][0]
    if pil_fmt == "PNG" and rgb.dtype == np.uint8 and rgb.ndim == 3 and rgb.shape[2] == 3 and rgb.size:
        return png_bytes(rgb)
    buf = io.BytesIO()
    kwargs = ({"quality": quality} if pil_fmt == "JPEG" else
              {"quality": quality, "method": WEBP_METHOD} if pil_fmt == "WEBP" else {"compress_level": 1})
    Image.fromarray(rgb, mode="RGB").save(buf, format=pil_fmt, **kwargs)
    return buf.getvalue()


def zip_bytes(files: list[tuple[str, bytes]]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", compression=zipfile.ZIP_STORED) as zf:
        for name, data in files:
            zf.writestr(name, data)
    return buf.getvalue()


def encode_images(images01: np.ndarray, fmt: str, quality: int) -> tuple[bytes, str]:
    """N,H,W,3 in [0,1] -> one image's bytes, or a zip of image_000.<ext>, image_001.<ext>..."""
    rgb = to_uint8(images01)
    if rgb.shape[0] == 1:
        return image_bytes(rgb[0], fmt, quality), IMAGE_FORMATS[fmt][1]
    ext = "jpg" if fmt == "jpeg" else fmt
    return zip_bytes([(f"image_{i:03d}.{ext}", image_bytes(im, fmt, quality))
                      for i, im in enumerate(rgb)]), ZIP_MEDIA


def top_k(logits: np.ndarray, k: int, labels: list[str] | None) -> list[list[dict]]:
    """Per row, the k largest softmax probabilities with their class index and label."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    k = min(k, p.shape[1])
    out = []
    for row in p:
        idx = np.argsort(-row, kind="stable")[:k]
        out.append([{"index": int(i), "label": labels[i] if labels and i < len(labels) else None,
                     "score": float(row[i])} for i in idx])
    return out

