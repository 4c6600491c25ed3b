"""The bad-input corpus: hostile and broken request bodies, each with the route it is sent to and
the specific 4xx + problem type the service must answer.

    python tests/corpus/make_corpus.py          # (re)writes the small files in tests/corpus/files/
                                                # and tests/corpus/manifest.json (committed)

Small inputs are committed as files (other tools can replay them: every manifest entry names
its route, query, headers and expected answer). Large ones (a real decompression bomb, an
oversized body) are made at test time by `large_cases(dir)`, never committed. Everything is
deterministic: rebuilding gives the same bytes.

Manifest entry: {name, file, route, model, content_type, query, headers, status, kind, why}.
Routes: decode (/v1/models/{model}/decode), stream (/v1/models/{model}/decode/stream),
encode (/v1/models/{model}/encode), infer (/v2/models/{model}/infer), vae_decode / vae_encode
(/v1/models/{model}/vae/decode|encode, diffusers' remote VAE protocol).
The server these expectations hold for: tests/test_reliability_corpus.py (SERVER_SETTINGS)."""
from __future__ import annotations

import base64
import io
import json
import pickle
import struct
import zlib
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
FILES = HERE / "files"
MANIFEST = HERE / "manifest.json"

ROUTES = {
    "decode": "/v1/models/{model}/decode",
    "stream": "/v1/models/{model}/decode/stream",
    "encode": "/v1/models/{model}/encode",
    "infer": "/v2/models/{model}/infer",
    "vae_decode": "/v1/models/{model}/vae/decode",
    "vae_encode": "/v1/models/{model}/vae/encode",
}
NPY, PNG, JPEG = "application/x-npy", "image/png", "image/jpeg"
ST, JSON, OCTET, TENSOR = "application/vnd.safetensors", "application/json", "application/octet-stream", "tensor/binary"

#: limits of the corpus server (the expectations below depend on them)
MAX_PIXELS = 128 * 128
MAX_BODY_BYTES = 1_000_000


def rng():
    return np.random.default_rng(20261123)


# ---- byte builders ------------------------------------------------------------------------------------
def npy(arr: np.ndarray, allow_pickle: bool = False) -> bytes:
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=allow_pickle)
    return buf.getvalue()


def npy_with_header(header: str, payload: bytes) -> bytes:
    """A .npy v1.0 file with a hand-written header dict (which may lie)."""
    h = header.encode("latin1")
    pad = 64 - (10 + len(h) + 1) % 64
    h = h + b" " * pad + b"\n"
    return b"\x93NUMPY\x01\x00" + struct.pack("<H", len(h)) + h + payload


def png_chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))


def png(width: int, height: int, idat: bytes, *, extra: bytes = b"", color_type: int = 2) -> bytes:
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return (b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + extra + png_chunk(b"IDAT", idat)
            + png_chunk(b"IEND", b""))


def good_png(w: int = 40, h: int = 30) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rng().integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def good_jpeg(w: int = 40, h: int = 30) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(rng().integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="JPEG", quality=90)
    return buf.getvalue()


def other_format(fmt: str) -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.zeros((8, 8, 3), np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


def jpeg_with_size(width: int, height: int) -> bytes:
    """A JPEG whose SOF0 marker declares width x height (the scan data is for 8x8)."""
    data = bytearray(good_jpeg(8, 8))
    i = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, i + 5, height, width)
    return bytes(data)


def safetensors(header: object, payload: bytes = b"", header_len: int | None = None) -> bytes:
    h = json.dumps(header).encode() if not isinstance(header, bytes) else header
    n = len(h) if header_len is None else header_len
    return struct.pack("<Q", n) + h + payload


def kserve_binary(header: dict, blob: bytes) -> tuple[bytes, int]:
    h = json.dumps(header).encode()
    return h + blob, len(h)


def lat(*shape) -> np.ndarray:
    return rng().standard_normal(shape).astype(np.float32)


def json_tensor(arr: np.ndarray | None = None, **doc) -> bytes:
    if arr is not None:
        doc = {"data": base64.b64encode(arr.tobytes()).decode(), "shape": list(arr.shape),
               "dtype": str(arr.dtype), **doc}
    return json.dumps(doc).encode()


# ---- the corpus ---------------------------------------------------------------------------------------
def cases() -> list[dict]:
    """Every small case: {name, data: bytes, route, model, content_type, query, headers, status, kind, why}."""
    out: list[dict] = []

    def add(name, data, route, model, content_type, status, kind, why, query=None, headers=None):
        out.append(dict(name=name, data=data, route=route, model=model, content_type=content_type,
                        query=query or {}, headers=headers or {}, status=status, kind=kind, why=why))

    enc, dec, vid = "tiny-convnext", "tiny-vae", "tiny-wan-vae"
    gp, gj = good_png(), good_jpeg()

    # images -------------------------------------------------------------------------------------------
    add("png_truncated", gp[: len(gp) // 2], "encode", enc, PNG, 422, "undecodable-image", "half a PNG")
    add("png_bad_crc", gp[:60] + bytes([gp[60] ^ 0xFF]) + gp[61:], "encode", enc, PNG, 422, "undecodable-image",
        "one flipped byte inside IDAT: CRC mismatch")
    add("png_garbage_idat", png(16, 16, b"\x78\x9c" + bytes(range(256)) * 4), "encode", enc, PNG, 422,
        "undecodable-image", "IDAT that is not a zlib stream")
    add("png_header_only", b"\x89PNG\r\n\x1a\n", "encode", enc, PNG, 415, "undecodable-image", "signature, no chunks")
    add("png_zero_size", png(0, 0, zlib.compress(b"")), "encode", enc, PNG, 415, "undecodable-image",
        "IHDR declares 0x0")
    add("png_huge_declared", png(100_000, 100_000, zlib.compress(b"\0")), "encode", enc, PNG, 413,
        "image-too-large", "IHDR declares 10^10 pixels (beyond PIL's own bomb limit)")
    add("png_over_limit_declared", png(300, 300, zlib.compress(b"\0")), "encode", enc, PNG, 413,
        "image-too-large", "IHDR declares 300x300 > the server's max_pixels, with no pixel data")
    add("png_ztxt_bomb", png(8, 8, zlib.compress(b"".join(b"\0" + b"\0" * 24 for _ in range(8))),
                             extra=png_chunk(b"zTXt", b"k\0\0" + zlib.compress(b"A" * (40 << 20), 9))),
        "encode", enc, PNG, 413, "image-too-large", "a text chunk that inflates to 40 MiB")
    add("png_as_vae_encode_bomb", png(100_000, 100_000, zlib.compress(b"\0")), "vae_encode", dec, PNG, 413,
        "image-too-large", "remote_encode with a PNG declaring 10^10 pixels")
    add("jpeg_truncated", gj[: len(gj) // 2], "encode", enc, JPEG, 422, "undecodable-image", "half a JPEG")
    add("jpeg_soi_only", b"\xff\xd8\xff", "encode", enc, JPEG, 415, "undecodable-image", "a JPEG start marker")
    add("jpeg_garbage_tail", gj[:200] + bytes(rng().integers(0, 256, 400, dtype=np.uint8)), "encode", enc, JPEG,
        415, "undecodable-image", "the first 200 bytes of a JPEG, then random bytes")
    add("jpeg_huge_declared", jpeg_with_size(65_000, 65_000), "encode", enc, JPEG, 413, "image-too-large",
        "SOF declares 65000x65000")
    add("gif", other_format("GIF"), "encode", enc, "image/gif", 415, "undecodable-image", "GIF is not accepted")
    add("bmp", other_format("BMP"), "encode", enc, PNG, 415, "undecodable-image", "a BMP sent as image/png")
    add("tiff", other_format("TIFF"), "encode", enc, PNG, 415, "undecodable-image", "a TIFF sent as image/png")
    add("empty_image", b"", "encode", enc, PNG, 415, "undecodable-image", "zero bytes")
    add("text_as_image", b"definitely not an image", "encode", enc, JPEG, 415, "undecodable-image", "plain text")

    # .npy -------------------------------------------------------------------------------------------------
    add("npy_object_pickle", npy(np.array([{"a": 1}], dtype=object), allow_pickle=True), "decode", dec, NPY,
        400, "bad-npy", "object dtype: loading it would unpickle")
    add("npy_raw_pickle", pickle.dumps({"latents": [1, 2, 3]}), "decode", dec, NPY, 400, "bad-npy",
        "a bare pickle stream sent as .npy")
    add("npy_pickle_payload", npy_with_header("{'descr': '|O', 'fortran_order': False, 'shape': (1,), }",
                                              pickle.dumps([1])), "decode", dec, NPY, 400, "bad-npy",
        "an object .npy by hand")
    add("npy_lying_shape", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4, 100000, 100000), }",
                                           b"\0" * 64), "decode", dec, NPY, 400, "bad-npy",
        "header declares 160 GB, 64 bytes follow")
    add("npy_bad_header", npy_with_header("{'descr': '<f4', 'shape': __import__('os').getpid()}", b""),
        "decode", dec, NPY, 400, "bad-npy", "a header that is code, not a literal")
    add("npy_truncated_magic", b"\x93NUMP", "decode", dec, NPY, 400, "bad-npy", "five bytes")
    add("npy_empty", b"", "decode", dec, NPY, 400, "bad-npy", "zero bytes")
    # the 128-byte file whose dimensions multiply past int64 with a zero among them (a 500 once),
    # on every route that reads .npy; headers declaring sizes other than the bytes present
    overflow = npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 1, 0), }",
                               b"")
    for route, model in (("decode", dec), ("stream", vid), ("encode", enc), ("vae_encode", dec)):
        add(f"npy_overflow_zero_dim_{route}", overflow, route, model, NPY, 400, "bad-npy",
            "shape (2^32, 2^32, 1, 0): no elements, yet no array can have it")
    add("npy_lying_fortran", npy_with_header("{'descr': '<f4', 'fortran_order': True, 'shape': (4, 100000, 100000), }",
                                             b"\0" * 64), "decode", dec, NPY, 400, "bad-npy",
        "Fortran order, header declares 149 GiB, 64 bytes follow")
    add("npy_extra_bytes", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, 4, 2, 2), }",
                                           b"\0" * 80), "decode", dec, NPY, 400, "bad-npy",
        "header declares 64 bytes, 80 follow")
    add("npy_negative_dim", npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (1, -4, 2, 2), }",
                                            b"\0" * 64), "decode", dec, NPY, 400, "bad-npy", "a negative dimension")
    add("npy_header_truncated", b"\x93NUMPY\x01\x00\x76\x00{'descr': '<f4'", "decode", dec, NPY, 400, "bad-npy",
        "header length 118, 15 bytes follow")
    add("npy_version_9", b"\x93NUMPY\x09\x00" + b"\0" * 118, "decode", dec, NPY, 400, "bad-npy", "format version 9.0")
    jfif = b"\xff\xd8\xff\xe0\x00\x10JFIF\x00\x01\x01\x00\x00\x01\x00\x01\x00\x00\xff\xd9"
    add("jpeg_as_npy_decode", jfif, "decode", dec, NPY, 415, "unsupported-media-type",
        "a JPEG sent as .npy to decode: named, with the tensor types to send")
    add("jpeg_as_npy_encode", jfif, "encode", enc, NPY, 415, "unsupported-media-type",
        "a JPEG sent as .npy to encode: named, with image/jpeg to send it as")
    add("npy_as_json", npy(lat(1, 4, 3, 3)), "decode", dec, JSON, 415, "unsupported-media-type",
        "a .npy sent as application/json: named, with application/x-npy to send it as")
    add("npy_int32", npy(np.ones((1, 4, 5, 5), np.int32)), "decode", dec, NPY, 415, "unsupported-dtype", "int latents")
    add("npy_bool", npy(np.ones((1, 4, 5, 5), bool)), "decode", dec, NPY, 415, "unsupported-dtype", "bool latents")
    add("npy_complex", npy(np.ones((1, 4, 5, 5), np.complex64)), "decode", dec, NPY, 415, "unsupported-dtype",
        "complex latents")
    add("npy_structured", npy(np.zeros((1, 4, 5, 5), dtype=[("a", "<f4"), ("b", "<i2")])), "decode", dec, NPY,
        415, "unsupported-dtype", "a record dtype")
    add("npy_2d", npy(lat(5, 5)), "decode", dec, NPY, 422, "bad-shape", "2-D latents")
    add("npy_6d", npy(lat(1, 1, 1, 4, 3, 3)), "decode", dec, NPY, 422, "bad-shape", "6-D latents")
    add("npy_scalar", npy(np.float32(1.0)), "decode", dec, NPY, 422, "bad-shape", "a 0-d array")
    add("npy_wrong_channels", npy(lat(1, 3, 5, 7)), "decode", dec, NPY, 422, "wrong-channels", "3 of 4 channels")
    add("npy_zero_sized", npy(np.zeros((1, 4, 0, 5), np.float32)), "decode", dec, NPY, 422, "bad-shape",
        "a zero-height latent")
    add("npy_zero_batch", npy(np.zeros((0, 4, 5, 5), np.float32)), "decode", dec, NPY, 422, "bad-shape",
        "no rows")
    nan = lat(1, 4, 5, 7)
    nan[0, 2, 3, 4] = np.nan
    add("npy_nan", npy(nan), "decode", dec, NPY, 422, "non-finite-latents", "one NaN")
    inf = lat(1, 4, 5, 7).astype(np.float16)
    inf[0, 1, 1, 1] = np.inf
    add("npy_inf_fp16", npy(inf), "decode", dec, NPY, 422, "non-finite-latents", "one +Inf in float16")
    add("npy_f64_overflow", npy(np.full((1, 4, 3, 3), 1e300)), "decode", dec, NPY, 422, "non-finite-latents",
        "float64 values that overflow float32 to Inf")
    add("npy_batch_too_large", npy(lat(5, 4, 3, 3)), "decode", dec, NPY, 422, "batch-too-large", "5 > max_batch 4")
    add("npy_too_many_pixels", npy(lat(1, 4, 17, 16)), "decode", dec, NPY, 422, "too-many-pixels",
        "136x128 output > max_pixels")
    add("npy_video_too_many_frames", npy(lat(1, 4, 4, 3, 3)), "decode", vid, NPY, 422, "too-many-frames",
        "13 frames > max_frames 9")
    add("npy_video_3d", npy(lat(4, 3, 3)), "decode", vid, NPY, 422, "bad-shape", "3-D latents to a video VAE")
    add("npy_stream_nan", npy(np.full((1, 4, 2, 3, 3), np.nan, np.float32)), "stream", vid, NPY, 422,
        "non-finite-latents", "a streamed decode refuses NaN before the first frame")
    add("npy_pixels_nan", npy(np.full((1, 8, 8, 3), np.nan, np.float32)), "encode", enc, NPY, 422,
        "non-finite-pixels", "NaN pixels")
    add("npy_pixels_rgba", npy(np.zeros((1, 8, 8, 4), np.float32)), "encode", enc, NPY, 422, "bad-shape",
        "4 channels")
    add("npy_pixels_int64", npy(np.zeros((1, 8, 8, 3), np.int64)), "encode", enc, NPY, 415, "unsupported-dtype",
        "int64 pixels")
    add("npy_pixels_over_limit", npy(np.zeros((1, 130, 130, 3), np.uint8)), "encode", enc, NPY, 413,
        "image-too-large", "130x130 > max_pixels")

    # safetensors ------------------------------------------------------------------------------------------
    add("st_short", b"\x01\x02", "decode", dec, ST, 400, "bad-safetensors", "shorter than its length field")
    add("st_len_lies", safetensors({"latents": {}}, header_len=1 << 40), "decode", dec, ST, 400, "bad-safetensors",
        "header length 2^40")
    add("st_not_json", safetensors(b"{not json"), "decode", dec, ST, 400, "bad-safetensors", "header not JSON")
    add("st_header_list", safetensors([1, 2, 3]), "decode", dec, ST, 400, "bad-safetensors", "header a JSON list")
    add("st_offsets_outside", safetensors({"latents": {"dtype": "F32", "shape": [1, 4, 2, 2],
                                                       "data_offsets": [0, 1 << 30]}}, b"\0" * 64),
        "decode", dec, ST, 400, "bad-safetensors", "offsets past the end")
    add("st_dtype_list", safetensors({"latents": {"dtype": ["F32"], "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4),
        "decode", dec, ST, 400, "bad-safetensors", "dtype is a list")
    add("st_int_dtype", safetensors({"latents": {"dtype": "I32", "shape": [1, 4, 2, 2], "data_offsets": [0, 64]}},
                                    b"\0" * 64), "decode", dec, ST, 415, "unsupported-dtype", "I32 latents")
    add("st_shape_mismatch", safetensors({"latents": {"dtype": "F32", "shape": [1, 4, 9, 9], "data_offsets": [0, 64]}},
                                         b"\0" * 64), "decode", dec, ST, 400, "bad-tensor", "64 bytes for 324 floats")
    add("st_two_tensors", safetensors({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]},
                                       "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8),
        "decode", dec, ST, 400, "bad-safetensors", "two tensors, neither named latents")

    # JSON + base64 -----------------------------------------------------------------------------------------
    add("json_truncated", b'{"data": "AAAA", "shape": [1, 4', "decode", dec, JSON, 400, "bad-json", "cut mid-document")
    add("json_not_object", b"[1, 2, 3]", "decode", dec, JSON, 400, "bad-json", "a list")
    add("json_bad_base64", json_tensor(data="!!!not base64!!!", shape=[1]), "decode", dec, JSON, 400, "bad-json",
        "data not base64")
    add("json_shape_strings", json_tensor(data="AAAAAA==", shape=["a", "b"]), "decode", dec, JSON, 400, "bad-tensor",
        "shape of strings")
    add("json_shape_huge", json_tensor(data="AAAAAA==", shape=[2 ** 70, 2 ** 70]), "decode", dec, JSON, 400,
        "bad-tensor", "shape beyond int64")
    add("json_shape_negative", json_tensor(data="AAAAAA==", shape=[-1, 4]), "decode", dec, JSON, 400, "bad-tensor",
        "negative dimension")
    add("json_dtype_unknown", json_tensor(lat(1, 4, 2, 2), dtype="float128"), "decode", dec, JSON, 415,
        "unsupported-dtype", "float128")
    add("json_size_mismatch", json_tensor(data=base64.b64encode(b"\0" * 12).decode(), shape=[1, 4, 5, 5]),
        "decode", dec, JSON, 400, "bad-tensor", "12 bytes for 100 floats")

    # KServe v2 ---------------------------------------------------------------------------------------------
    def kj(doc):
        return json.dumps(doc).encode() if not isinstance(doc, bytes) else doc
    good_input = {"name": "latents", "datatype": "FP32", "shape": [1, 4, 2, 2], "data": [0.5] * 16}
    add("kserve_not_json", b"{'inputs': ", "infer", dec, JSON, 400, "bad-json", "not JSON")
    add("kserve_no_inputs", kj({"outputs": []}), "infer", dec, JSON, 400, "bad-request", "no inputs")
    add("kserve_inputs_not_list", kj({"inputs": {"name": "latents"}}), "infer", dec, JSON, 400, "bad-request",
        "inputs is an object")
    add("kserve_input_not_object", kj({"inputs": [7]}), "infer", dec, JSON, 400, "bad-request", "an input is a number")
    add("kserve_bad_datatype", kj({"inputs": [{**good_input, "datatype": "INT32"}]}), "infer", dec, JSON, 415,
        "unsupported-dtype", "INT32")
    add("kserve_negative_shape", kj({"inputs": [{**good_input, "shape": [1, -4, 2, 2]}]}), "infer", dec, JSON, 400,
        "bad-tensor", "negative dim")
    add("kserve_shape_huge", kj({"inputs": [{**good_input, "shape": [2 ** 80, 1]}]}), "infer", dec, JSON, 400,
        "bad-tensor", "shape beyond int64")
    add("kserve_data_short", kj({"inputs": [{**good_input, "data": [0.0] * 3}]}), "infer", dec, JSON, 400,
        "bad-tensor", "3 values for 16")
    add("kserve_data_strings", kj({"inputs": [{**good_input, "data": ["x"] * 16}]}), "infer", dec, JSON, 400,
        "bad-tensor", "strings as data")
    add("kserve_data_overflow", b'{"inputs": [{"name": "latents", "datatype": "FP32", "shape": [1], "data": [1'
        + b"0" * 400 + b"]}]}", "infer", dec, JSON, 400, "bad-tensor", "an integer with 400 digits")
    add("kserve_uint8_overflow", kj({"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": [1, 2, 2, 3],
                                                 "data": [300] * 12}]}), "infer", enc, JSON, 400, "bad-tensor",
        "300 in UINT8")
    add("kserve_nan", b'{"inputs": [{"name": "latents", "datatype": "FP32", "shape": [1, 4, 1, 1], '
        b'"data": [NaN, 0, 0, 0]}]}', "infer", dec, JSON, 422, "non-finite-latents", "NaN in JSON data")
    add("kserve_bf16_json", kj({"inputs": [{**good_input, "datatype": "BF16"}]}), "infer", dec, JSON, 415,
        "unsupported-dtype", "BF16 needs binary data")
    add("kserve_wrong_input_name", kj({"inputs": [{**good_input, "name": "x"}]}), "infer", dec, JSON, 400,
        "bad-input-name", "input not named latents")
    add("kserve_params_list", kj({"inputs": [{**good_input, "parameters": [1]}]}), "infer", dec, JSON, 400,
        "bad-tensor", "parameters is a list")
    add("kserve_outputs_bad", kj({"inputs": [good_input], "outputs": [{"name": 5}]}), "infer", dec, JSON, 400,
        "bad-request", "output name a number")
    add("kserve_batch_too_large", kj({"inputs": [{**good_input, "shape": [5, 4, 2, 2], "data": [0.0] * 80}]}),
        "infer", dec, JSON, 422, "batch-too-large", "5 rows")
    blob = lat(1, 4, 2, 2).tobytes()
    body, n = kserve_binary({"inputs": [{"name": "latents", "datatype": "FP32", "shape": [1, 4, 2, 2],
                                         "parameters": {"binary_data_size": len(blob)}}]}, blob)
    add("kbin_header_len_past_body", body, "infer", dec, OCTET, 400, "bad-request", "header length > body",
        headers={"Inference-Header-Content-Length": str(len(body) + 10)})
    add("kbin_header_len_negative", body, "infer", dec, OCTET, 400, "bad-request", "negative header length",
        headers={"Inference-Header-Content-Length": "-5"})
    add("kbin_header_len_text", body, "infer", dec, OCTET, 400, "bad-request", "header length not a number",
        headers={"Inference-Header-Content-Length": "lots"})
    add("kbin_header_len_short", body, "infer", dec, OCTET, 400, "bad-json", "header length cuts the JSON",
        headers={"Inference-Header-Content-Length": str(n - 7)})
    add("kbin_header_len_long", body, "infer", dec, OCTET, 400, "bad-json", "header length takes in tensor bytes",
        headers={"Inference-Header-Content-Length": str(n + 9)})
    body2, n2 = kserve_binary({"inputs": [{"name": "latents", "datatype": "FP32", "shape": [1, 4, 2, 2],
                                           "parameters": {"binary_data_size": 10 ** 9}}]}, blob)
    add("kbin_size_past_body", body2, "infer", dec, OCTET, 400, "bad-tensor", "binary_data_size 1 GB",
        headers={"Inference-Header-Content-Length": str(n2)})
    body3, n3 = kserve_binary({"inputs": [{"name": "latents", "datatype": "FP32", "shape": [1, 4, 2, 2],
                                           "parameters": {"binary_data_size": 60}}]}, blob)
    add("kbin_size_wrong", body3, "infer", dec, OCTET, 400, "bad-tensor", "60 bytes for 64",
        headers={"Inference-Header-Content-Length": str(n3)})
    body4, n4 = kserve_binary({"inputs": [{"name": "latents", "datatype": "FP32", "shape": [1, 4, 2, 2],
                                           "parameters": {"binary_data_size": "64"}}]}, blob)
    add("kbin_size_string", body4, "infer", dec, OCTET, 400, "bad-tensor", "binary_data_size a string",
        headers={"Inference-Header-Content-Length": str(n4)})

    # diffusers remote VAE ----------------------------------------------------------------------------------
    shape4 = {"shape": [1, 4, 3, 3]}
    add("vae_bytes_mismatch", b"\0" * 10, "vae_decode", dec, TENSOR, 400, "bad-tensor", "10 bytes for 36 floats",
        query={**shape4, "dtype": "float32"})
    add("vae_int_dtype", b"\0" * 36, "vae_decode", dec, TENSOR, 415, "unsupported-dtype", "int8",
        query={**shape4, "dtype": "int8"})
    add("vae_uint8_latents", b"\0" * 36, "vae_decode", dec, TENSOR, 415, "unsupported-dtype", "uint8 latents",
        query={**shape4, "dtype": "uint8"})
    add("vae_shape_huge", b"\0" * 16, "vae_decode", dec, TENSOR, 400, "bad-tensor", "shape beyond int64",
        query={"shape": [2 ** 70, 2 ** 70], "dtype": "float32"})
    add("vae_packed_no_size", b"\0" * (1 * 4 * 16 * 4), "vae_decode", dec, TENSOR, 422, "missing-height-width",
        "packed latents, no height/width", query={"shape": [1, 4, 16], "dtype": "float32"})
    add("vae_nan", np.full((1, 4, 3, 3), np.nan, np.float32).tobytes(), "vae_decode", dec, TENSOR, 422,
        "non-finite-latents", "NaN latents", query={**shape4, "dtype": "float32"})
    add("vae_scaling_zero", lat(1, 4, 3, 3).tobytes(), "vae_decode", dec, TENSOR, 422, "bad-scaling",
        "scaling_factor 0", query={**shape4, "dtype": "float32", "scaling_factor": 0})
    add("vae_encode_bad_png", gp[:30], "vae_encode", dec, PNG, 415, "undecodable-image", "30 bytes of a PNG")

    # protocol-level ----------------------------------------------------------------------------------------
    add("unknown_media_type", b"hello", "decode", dec, "text/plain", 415, "unsupported-media-type", "text/plain")
    return out


def large_cases(directory: Path) -> list[dict]:
    """Made at test time (too big to commit): a real PNG decompression bomb and an oversized body."""
    directory.mkdir(parents=True, exist_ok=True)
    # 12000x12000 RGB of zeros: 432 MB of pixels in ~420 kB; refused from the header, never inflated
    side = 12_000
    comp = zlib.compressobj(9)
    row = b"\0" * (1 + 3 * side)
    idat = b"".join(comp.compress(row) for _ in range(side)) + comp.flush()
    bomb = png(side, side, idat)
    over = npy(np.zeros((1, 4, 8, MAX_BODY_BYTES // 128 + 8), np.float32))  # just over the body limit
    found = []
    for name, data, route, model, ct, status, kind, why in [
        ("png_bomb_real", bomb, "encode", "tiny-convnext", PNG, 413, "image-too-large",
         f"{side}x{side} zeros deflated to {len(bomb)} bytes"),
        ("body_over_limit", over, "decode", "tiny-vae", NPY, 413, "body-too-large",
         f"{len(over)} bytes > {MAX_BODY_BYTES}"),
    ]:
        path = directory / f"{name}.bin"
        path.write_bytes(data)
        found.append(dict(name=name, file=str(path), route=route, model=model, content_type=ct, query={},
                          headers={}, status=status, kind=kind, why=why))
    return found


def write() -> None:
    FILES.mkdir(exist_ok=True)
    manifest = []
    for c in cases():
        fname = f"{c['name']}.bin"
        (FILES / fname).write_bytes(c.pop("data"))
        manifest.append({"file": f"files/{fname}", **c})
    MANIFEST.write_text(json.dumps(manifest, indent=1) + "\n")
    total = sum((FILES / m["file"].split("/", 1)[1]).stat().st_size for m in manifest)
    print(f"{len(manifest)} cases, {total} bytes in {FILES}")


if __name__ == "__main__":
    write()
