"""Which JPEG bodies a model worker may decode (service/worker/jpeg_bodies.py), read from the
file's markers alone, before any pixel is decoded and without PIL.

Why here, and why so narrow: a front end that hands a body to its worker does not decode it, so
what it checks must be cheap (a walk over the header's markers, a few microseconds) and what it
passes must be a file the device's decoder and PIL read alike. So only the JPEGs most clients
send pass, and everything else takes the front end's own decode (service/codecs/images.py):
- baseline DCT (SOF0), 8-bit, three components with the JFIF ids 1, 2, 3 (YCbCr). Progressive,
  extended, lossless and arithmetic-coded files do not pass (the GPU's JPEG engines take
  baseline only), nor greyscale or CMYK ones, nor components named R, G, B (libjpeg then skips
  the colour transform);
- no Adobe APP14 segment: it may say the components are RGB, not YCbCr;
- ending with the end-of-image marker: a file cut short is PIL's to refuse;
- exactly the model's input size: those need no resize, and their pixels feed the uint8 path as
  they are (a body of any other size is resized on the front end's CPU anyway).
EXIF orientation is ignored on both sides, as PIL's decode here ignores it.
"""
from __future__ import annotations

_SOI, _SOF0, _SOS, _EOI, _APP14 = 0xD8, 0xC0, 0xDA, 0xD9, 0xEE
#: start-of-frame markers other than baseline: extended, progressive, lossless, arithmetic (not DHT,
#: JPG, DAC, which share the range)
_OTHER_SOF = frozenset(range(0xC1, 0xD0)) - {0xC4, 0xC8, 0xCC}
#: markers with no length field: TEM and the restart markers
_STANDALONE = frozenset({0x01, *range(0xD0, 0xD8)})
#: a header walk gives up after this many bytes (a real header's tables fit in a few KB; metadata
#: segments may be larger, and a body whose frame header lies past this decodes on the front end)
_HEADER_LIMIT = 1 << 20


def device_decodable_size(data) -> tuple[int, int] | None:
    """(height, width) of a JPEG the model worker may decode (the rules above), else None. `data`:
    the file's bytes, or any buffer of them (a uint8 array: read as bytes, its items Python ints)."""
    data = memoryview(data).cast("B")
    n = min(len(data), _HEADER_LIMIT)
    if n < 4 or data[0] != 0xFF or data[1] != _SOI or data[-2] != 0xFF or data[-1] != _EOI:
        return None  # not a JPEG, or one cut short (the engines decode what there is; PIL refuses it)
    i, adobe, size = 2, False, None
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None  # not a marker where one must be: let the front end's decode judge it
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte before a marker
            i += 1
            continue
        if marker in _STANDALONE:
            i += 2
            continue
        if marker == _SOS:  # the header ends: what it said stands (an APP14 anywhere before counts)
            return size if not adobe else None
        if marker in (_EOI, _SOI) or marker in _OTHER_SOF or (marker == _SOF0 and size is not None):
            return None  # the end before any scan, or another kind of frame (or a second one)
        length = (data[i + 2] << 8) | data[i + 3]
        if length < 2:
            return None
        if marker == _APP14:
            adobe = True
        elif marker == _SOF0:
            if i + 2 + length > n or length != 17:  # 8 bytes + 3 per component, three components
                return None
            seg = data[i + 4:i + 2 + length]
            precision, height, width, ncomp = seg[0], (seg[1] << 8) | seg[2], (seg[3] << 8) | seg[4], seg[5]
            if precision != 8 or ncomp != 3 or height == 0 or width == 0 or (seg[6], seg[9], seg[12]) != (1, 2, 3):
                return None
            size = (height, width)
        i += 2 + length
    return None
