"""service.codecs writes .npy bytes itself (header from numpy.lib.format, the data joined once):
they must be exactly what np.save writes, for every layout the service sends."""
from __future__ import annotations

import io

import numpy as np
import pytest

from service import codecs
from service.streaming import RECORD_HEADER, npy_record


def saved(arr) -> bytes:
    buf = io.BytesIO()
    np.save(buf, np.ascontiguousarray(arr), allow_pickle=False)
    return buf.getvalue()


@pytest.mark.parametrize("arr", [
    np.random.default_rng(0).random((1, 1, 37, 53, 3), dtype=np.float32),   # a video frame group
    np.asfortranarray(np.random.default_rng(1).random((5, 7))),               # Fortran order in
    np.random.default_rng(2).random((4, 6))[:, ::2],                          # a strided view in
    np.zeros((0, 3), np.float16),                                             # empty
    np.array(3.5),                                                            # 0-d
    np.arange(7, dtype=">i8"),                                                # big-endian
    np.zeros(2, np.dtype([(f"field{i}", "<f4") for i in range(6000)])),      # a header over 64 KiB: format 2.0
], ids=["frames", "fortran", "strided", "empty", "scalar", "big-endian", "header-2.0"])
def test_npy_bytes_are_what_np_save_writes(arr):
    assert codecs.npy_bytes(arr) == saved(arr)
    back = np.load(io.BytesIO(codecs.npy_bytes(arr)), max_header_size=1 << 20)
    np.testing.assert_array_equal(back, arr)


def test_an_npy_stream_record_is_its_length_then_the_file():
    group = np.random.default_rng(3).random((1, 4, 9, 11, 3)).astype(np.float64)  # sent as float32
    record = npy_record(group)
    (length,) = RECORD_HEADER.unpack(record[:RECORD_HEADER.size])
    assert length == len(record) - RECORD_HEADER.size
    assert record[RECORD_HEADER.size:] == saved(group.astype(np.float32))


def test_object_arrays_are_refused():
    with pytest.raises(ValueError, match="object arrays"):
        codecs.npy_bytes(np.array([{"a": 1}], dtype=object))
