"""The one .npy reader of every path that takes .npy bytes: REST decode and encode, streaming
decode, remote-VAE encode and the CLI's input files (all through codecs.read_npy or
codecs.read_tensor_body).

Everything the header declares is checked against the bytes present before any array exists:
the array is then a read-only view of the body itself (no copy), so a 128-byte file declaring
2^64 elements costs nothing. np.load is never called: on an in-memory stream it allocates the
declared size before reading a byte of data (149 GiB for a 128-byte body), and with an object
dtype it would unpickle. Each problem is one 400 `bad-npy` with a one-line detail."""
from __future__ import annotations

import ast
import math

import numpy as np

from ..problems import Problem

MAGIC = b"\x93NUMPY"
#: format version -> (bytes of the little-endian header length, the header's text encoding)
_VERSIONS = {(1, 0): (2, "latin1"), (2, 0): (4, "latin1"), (3, 0): (4, "utf8")}
#: the longest header read. np.save's header for any plain dtype and up to 64 dimensions is far
#: shorter; only dtypes with thousands of fields need more, and the service takes none of them.
#: literal_eval's time and memory grow with the text, so it is bounded before it runs.
MAX_HEADER_BYTES = 1 << 16
_KEYS = {"descr", "fortran_order", "shape"}
#: the largest byte size an array can have (numpy's own limit: its sizes are intp)
_MAX_NBYTES = np.iinfo(np.intp).max


def _bad(what: str, detail: str) -> Problem:
    return Problem(400, "bad-npy", f"{what}: {detail}")


def _short(text: str, limit: int = 80) -> str:
    """Text from the client's bytes on one line and cut short, whatever they hold."""
    text = " ".join(text.split())
    return text if len(text) <= limit else text[:limit] + "..."


def _header_text(body, what: str) -> tuple[bytes, str, int]:
    """The header's bytes, their encoding and the offset where the data starts."""
    if len(body) == 0:
        raise _bad(what, "empty, not a .npy file")
    if bytes(body[:len(MAGIC)]) != MAGIC:
        raise _bad(what, "not a .npy file (it does not begin with the .npy magic bytes \\x93NUMPY)")
    if len(body) < len(MAGIC) + 2:
        raise _bad(what, f"truncated .npy: {len(body)} bytes end inside the format version")
    version = (body[6], body[7])
    if version not in _VERSIONS:
        raise _bad(what, f".npy format version {version[0]}.{version[1]} is not one of 1.0, 2.0, 3.0")
    width, encoding = _VERSIONS[version]
    start = 8 + width
    if len(body) < start:
        raise _bad(what, f"truncated .npy: {len(body)} bytes end inside the header length")
    length = int.from_bytes(body[8:start], "little")
    if length > MAX_HEADER_BYTES:
        raise _bad(what, f"the .npy header declares {length} bytes, over the limit of {MAX_HEADER_BYTES}")
    if start + length > len(body):
        raise _bad(what, f"truncated .npy header: it declares {length} bytes, {len(body) - start} follow")
    return bytes(body[start:start + length]), encoding, start + length


def _header(text: bytes, encoding: str, what: str) -> dict:
    try:
        header = ast.literal_eval(text.decode(encoding))
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError, UnicodeDecodeError) as exc:
        raise _bad(what, f"the .npy header is not a Python literal ({exc.__class__.__name__}: {_short(str(exc))})") from None
    if not isinstance(header, dict) or header.keys() != _KEYS:
        keys = sorted(map(str, header)) if isinstance(header, dict) else type(header).__name__
        raise _bad(what, f"the .npy header must be a dict of exactly descr, fortran_order and shape, got {_short(repr(keys))}")
    return header


def _dtype(descr, what: str) -> np.dtype:
    try:
        dt = np.lib.format.descr_to_dtype(descr)
    except (ValueError, TypeError, KeyError, IndexError) as exc:
        raise _bad(what, f"the .npy descr {_short(repr(descr))} is not a dtype ({_short(str(exc))})") from None
    if dt.hasobject:
        raise _bad(what, f"object arrays (descr {_short(repr(descr))}) are refused: reading one would unpickle its data")
    if dt.shape != () or dt.itemsize == 0:
        raise _bad(what, f"the .npy descr {_short(repr(descr))} is a subarray or empty dtype, not accepted")
    return dt


def _layout(text: bytes, encoding: str, what: str) -> tuple[bool, tuple, np.dtype]:
    """(fortran_order, shape, dtype) of a header, every check of the header alone made."""
    header = _header(text, encoding, what)
    fortran, shape = header["fortran_order"], header["shape"]
    if not isinstance(fortran, bool):
        raise _bad(what, f"the .npy fortran_order must be True or False, got {_short(repr(fortran))}")
    if not isinstance(shape, tuple) or not all(type(s) is int and s >= 0 for s in shape):
        raise _bad(what, f"the .npy shape must be a tuple of non-negative ints, got {_short(repr(shape))}")
    dt = _dtype(header["descr"], what)
    # Python ints: no overflow. Dimensions of zero still count: numpy refuses a shape whose other
    # dimensions multiply past its sizes even when it has no elements.
    if math.prod(max(s, 1) for s in shape) * dt.itemsize > _MAX_NBYTES:
        raise _bad(what, f"the .npy shape {_short(repr(shape))} of {dt} is larger than any array can be")
    return fortran, shape, dt


# Headers already read and found good, by their bytes. A service's clients send the same few
# headers over and over (one image a request: the same shape and dtype each time), and reading
# one (literal_eval, descr_to_dtype) cost about a tenth of a front end's CPU per one-image encode
# request. Only short headers are kept (np.save's for any plain dtype are 118 bytes or less), and
# at most LAYOUT_CACHE of them: a client sending a new shape each time costs a lookup, no memory.
LAYOUT_CACHE = 256
_MAX_CACHED_HEADER = 256
_layouts: dict[tuple[bytes, str], tuple[bool, tuple, np.dtype]] = {}


def _cached_layout(text: bytes, encoding: str, what: str) -> tuple[bool, tuple, np.dtype]:
    key = (text, encoding)
    found = _layouts.get(key)
    if found is None:
        found = _layout(text, encoding, what)  # raises for a bad header: only good ones are kept
        if len(text) <= _MAX_CACHED_HEADER:
            if len(_layouts) >= LAYOUT_CACHE:
                _layouts.pop(next(iter(_layouts)))  # the oldest entry (dicts keep insertion order)
            _layouts[key] = found
    return found


def parse_npy(body, what: str = "body") -> np.ndarray:
    """The array a .npy body holds, as a read-only view of the body, or a 400 `bad-npy` naming the
    first problem: truncation, an unknown version, a header that is no literal dict, an object
    dtype (never unpickled), a shape that is no tuple of non-negative ints or that no array can
    have, or data bytes other than the header declares. Any byte order and Fortran order are read
    as they are (the validation after converts dtypes)."""
    text, encoding, offset = _header_text(body, what)
    fortran, shape, dt = _cached_layout(text, encoding, what)
    declared, present = math.prod(shape) * dt.itemsize, len(body) - offset
    if declared != present:
        raise _bad(what, f"the .npy header declares {declared} bytes of data (shape {_short(repr(shape))} of {dt}), "
                         f"{present} follow")
    flat = np.frombuffer(body, dtype=dt, count=math.prod(shape), offset=offset)
    try:
        return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)
    except ValueError as exc:  # more dimensions than numpy makes
        raise _bad(what, f"the .npy shape {_short(repr(shape))} is not a possible array ({_short(str(exc))})") from None
