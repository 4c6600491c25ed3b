"""Tensors in request bodies, beside .npy (npy_parse.py): safetensors and JSON with base64 data,
and the checks every tensor reader shares: a client-declared shape and dtype against the bytes
present (a 400, never an array numpy cannot make), bfloat16 upcast, JSON that parses or is a 400."""
from __future__ import annotations

import base64
import binascii
import json
import math
import operator

import numpy as np

from ..problems import Problem

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
