"""service.codecs writes .npy bytes itself (header from numpy.lib.format, the data joined once):
they must be exactly what np.save writes, for every layout the service sends. And it reads them
with one parser (service/codecs/npy_parse.py) that checks every declared size against the bytes present
before anything is allocated, never unpickles, and answers each problem with one 400 bad-npy line."""
from __future__ import annotations

import io
import pickle
import tracemalloc

import numpy as np
import pytest

from service import codecs
from service.problems import Problem
from service.frontend.group_encoders import RECORD_HEADER, npy_record


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
# NumPy notes that a format-2.0 file needs NumPy >= 1.9 whenever it writes one: expected here
@pytest.mark.filterwarnings("ignore:Stored array in format 2.0:UserWarning")
def test_npy_bytes_are_what_np_save_writes(arr):
    assert codecs.npy_bytes(arr) == saved(arr)
    back = np.load(io.BytesIO(codecs.npy_bytes(arr)), max_header_size=1 << 20)
    np.testing.assert_array_equal(back, arr)


def test_an_npy_stream_record_is_its_length_then_the_file():
    group = np.random.default_rng(3).random((1, 4, 9, 11, 3)).astype(np.float64)  # sent as float32
    record = b"".join(npy_record(group))  # sent as its parts, one after the other
    (length,) = RECORD_HEADER.unpack(record[:RECORD_HEADER.size])
    assert length == len(record) - RECORD_HEADER.size
    assert record[RECORD_HEADER.size:] == saved(group.astype(np.float32))


def test_object_arrays_are_refused():
    with pytest.raises(ValueError, match="object arrays"):
        codecs.npy_bytes(np.array([{"a": 1}], dtype=object))


# ---- reading: the one parser (service/codecs/npy_parse.py) -------------------------------------------------
def npy_with_header(header: str | bytes, payload: bytes = b"", version: int = 1) -> bytes:
    """A .npy file with a hand-written header (which may lie), in format 1.0, 2.0 or 3.0."""
    h = header if isinstance(header, bytes) else header.encode("utf8" if version == 3 else "latin1")
    width = 2 if version == 1 else 4
    h += b" " * (63 - (8 + width + len(h)) % 64) + b"\n"
    return b"\x93NUMPY" + bytes((version, 0)) + len(h).to_bytes(width, "little") + h + payload


def npy(arr, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def header(descr="'<f4'", fortran="False", shape="(2,)") -> str:
    return f"{{'descr': {descr}, 'fortran_order': {fortran}, 'shape': {shape}, }}"


#: the 128-byte file of the overflow report: its dimensions multiply past int64, with a zero among them
ROW2 = npy_with_header(header(shape="(4294967296, 4294967296, 1, 0)"))


def test_the_reported_file_is_128_bytes():
    assert len(ROW2) == 128


# (id, body, words the one-line detail must hold)
HOSTILE = [
    ("overflow-with-zero-dim", ROW2, "larger than any array"),
    ("overflow-no-zero", npy_with_header(header(shape=f"({2 ** 62},)")), "larger than any"),
    ("declares-more", npy_with_header(header(shape="(1, 4, 100000, 100000)"), b"\0" * 64), "160000000000 bytes"),
    ("declares-fewer", npy_with_header(header(), b"\0" * 12), "declares 8 bytes"),
    ("negative-dim", npy_with_header(header(shape="(-1, 4)")), "non-negative ints"),
    ("float-dim", npy_with_header(header(shape="(1.5,)")), "non-negative ints"),
    ("bool-dim", npy_with_header(header(shape="(True,)"), b"\0" * 4), "non-negative ints"),
    ("shape-list", npy_with_header(header(shape="[2]"), b"\0" * 8), "tuple of non-negative"),
    ("65-dims", npy_with_header(header(shape="(" + "1, " * 65 + ")"), b"\0" * 4), "not a possible array"),
    ("fortran-lying", npy_with_header(header(fortran="True", shape="(100000, 100000)"), b"\0" * 16), "bytes of data"),
    ("fortran-not-bool", npy_with_header(header(fortran="'yes'"), b"\0" * 8), "fortran_order"),
    ("object-dtype", npy(np.array([{"a": 1}], dtype=object), allow_pickle=True), "unpickle"),
    ("object-field", npy_with_header(header(descr="[('a', '<f4'), ('b', '|O')]"), b"\0" * 32), "unpickle"),
    ("subarray-dtype", npy_with_header(header(descr="('<f4', (2,))"), b"\0" * 16), "subarray"),
    ("zero-size-dtype", npy_with_header(header(descr="'|V0'", shape="(1000000000000,)")), "empty dtype"),
    ("unknown-dtype", npy_with_header(header(descr="'<q9'"), b"\0" * 8), "not a dtype"),
    ("big-endian-lying", npy_with_header(header(descr="'>f8'", shape=f"({10 ** 9},)"), b"\0" * 8), "8000000000 bytes"),
    ("v2-lying", npy_with_header(header(shape="(1, 4, 100000, 100000)"), b"\0" * 64, version=2), "bytes of data"),
    ("v3-lying", npy_with_header(header(shape="(1, 4, 100000, 100000)"), b"\0" * 64, version=3), "bytes of data"),
    ("version-9", b"\x93NUMPY\x09\x00" + b"\0" * 100, "version 9.0"),
    ("header-truncated", b"\x93NUMPY\x01\x00\xff\x00{'descr'", "truncated .npy header"),
    ("v2-header-length-huge", b"\x93NUMPY\x02\x00\xff\xff\xff\x7f{'descr'", "over the limit"),
    ("preamble-truncated", b"\x93NUMPY\x01", "truncated .npy"),
    ("magic-truncated", b"\x93NUMP", "magic"),
    ("empty", b"", "empty"),
    ("raw-pickle", pickle.dumps({"latents": [1, 2, 3]}), "magic"),
    ("code-header", npy_with_header("{'descr': '<f4', 'shape': __import__('os').getpid()}"), "not a Python literal"),
    ("header-not-dict", npy_with_header("[1, 2, 3]"), "must be a dict"),
    ("header-extra-key", npy_with_header(header()[:-1] + "'x': 1}", b"\0" * 8), "exactly descr"),
    ("header-deep", npy_with_header("(" * 300 + ")" * 300), "not a Python literal"),
    ("header-huge-int", npy_with_header(header(shape="(" + "9" * 5000 + ",)")), "not a Python literal"),
    ("header-not-utf8", npy_with_header(b"{'descr': '\xff'}", version=3), "not a Python literal"),
]


@pytest.mark.parametrize("body,words", [c[1:] for c in HOSTILE], ids=[c[0] for c in HOSTILE])
def test_a_hostile_npy_is_a_400_bad_npy_in_one_line(body, words):
    with pytest.raises(Problem) as info:
        codecs.read_npy(body)
    p = info.value
    assert (p.status, p.kind) == (400, "bad-npy"), (p.status, p.kind, p.detail)
    assert words in p.detail and "\n" not in p.detail and len(p.detail) < 300, p.detail


def test_declared_sizes_are_checked_before_anything_is_allocated():
    """np.load on an in-memory body allocates what the header declares before reading the data:
    256 MiB here for a 64-byte body (149 GiB for the overflow report's siblings)."""
    lying = npy_with_header(header(shape="(1, 4, 4096, 4096)"), b"\0" * 64)  # declares 256 MiB
    tracemalloc.start()
    try:
        for body in (lying, ROW2):
            with pytest.raises(Problem) as info:
                codecs.read_npy(body)
            assert info.value.kind == "bad-npy"
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"parsing a hostile header traced a peak of {peak / 2**20:.0f} MiB"


class Trap:
    """Unpickling it creates a file: the proof that an object .npy was, or was not, unpickled."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def test_an_object_npy_is_never_unpickled(tmp_path):
    trap = tmp_path / "unpickled"
    body = npy(np.array([Trap(trap)], dtype=object), allow_pickle=True)
    np.load(io.BytesIO(body), allow_pickle=True)[0].close()  # the trap works: loading it with pickles springs it
    assert trap.exists()
    trap.unlink()
    with pytest.raises(Problem, match="unpickle"):
        codecs.read_npy(body)
    with pytest.raises(Problem, match="unpickle"):
        codecs.read_tensor_body(body, None, "latents")
    assert not trap.exists()


def saved_version(arr, version) -> bytes:
    buf = io.BytesIO()
    np.lib.format.write_array(buf, arr, version=version)
    return buf.getvalue()


@pytest.mark.parametrize("body,want", [
    (npy(np.arange(6, dtype=">f8").reshape(2, 3)), np.arange(6, dtype=">f8").reshape(2, 3)),
    (npy(np.asfortranarray(np.arange(24, dtype="<f4").reshape(2, 3, 4))),
     np.arange(24, dtype="<f4").reshape(2, 3, 4)),
    (saved_version(np.arange(12, dtype="<f2").reshape(3, 4), (2, 0)), np.arange(12, dtype="<f2").reshape(3, 4)),
    (saved_version(np.arange(12, dtype="<f4").reshape(3, 4), (3, 0)), np.arange(12, dtype="<f4").reshape(3, 4)),
    (npy(np.float32(2.5)), np.float32(2.5)),
    (npy(np.zeros((0, 3), np.float32)), np.zeros((0, 3), np.float32)),
    (npy(np.zeros(3, [("a", "<f4"), ("b", "<i2")])), np.zeros(3, [("a", "<f4"), ("b", "<i2")])),
], ids=["big-endian", "fortran", "v2", "v3", "scalar", "empty", "structured"])
def test_good_npy_reads_as_np_load_does_as_a_view_of_the_body(body, want):
    got = codecs.read_npy(body)
    assert got.dtype == want.dtype and got.shape == np.shape(want)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(got, np.load(io.BytesIO(body)))
    assert not got.flags.owndata and not got.flags.writeable  # the body's bytes, not a copy


def test_the_cli_reads_files_through_the_same_parser(tmp_path):
    """`convserve decode FILE` (local) refuses the hostile file in one line before loading a model."""
    from typer.testing import CliRunner

    from service.cli.main import app

    (tmp_path / "row2.npy").write_bytes(ROW2)
    r = CliRunner().invoke(app, ["decode", str(tmp_path / "row2.npy"), "-o", str(tmp_path / "o.png"),
                                 "--backend", "numpy"])
    assert r.exit_code == 2 and isinstance(r.exception, SystemExit), (r.exit_code, r.output, r.exception)
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "larger than any array" in lines[0], r.stderr


def test_a_header_read_once_is_remembered_and_bodies_are_still_checked_each_time():
    """Good headers are kept by their bytes (a service's clients repeat them); each body's data
    size is still checked against its header, a bad header is never kept, and the kept headers
    stay bounded whatever shapes clients send."""
    from service.codecs import npy_parse

    npy_parse._layouts.clear()
    a = np.arange(2 * 5 * 3, dtype=np.uint8).reshape(2, 5, 3)
    body = saved(a)
    for _ in range(2):  # the second read takes the remembered header, with the same answer
        np.testing.assert_array_equal(npy_parse.parse_npy(body), a)
    assert len(npy_parse._layouts) == 1
    with pytest.raises(Problem, match="declares 30 bytes of data"):  # the same header, one byte short
        npy_parse.parse_npy(body[:-1])
    bad = saved(np.zeros(1, np.float32)).replace(b"'<f4'", b"'|O4'")
    with pytest.raises(Problem, match="object arrays"):
        npy_parse.parse_npy(bad)
    with pytest.raises(Problem, match="object arrays"):  # refused again, not remembered as good
        npy_parse.parse_npy(bad)
    assert len(npy_parse._layouts) == 1
    for n in range(npy_parse.LAYOUT_CACHE + 40):
        npy_parse.parse_npy(saved(np.zeros((1, n), np.uint8)))
    assert len(npy_parse._layouts) == npy_parse.LAYOUT_CACHE
