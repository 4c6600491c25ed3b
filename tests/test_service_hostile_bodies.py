"""Hostile bodies over real HTTP: JSON nested past the parser's recursion limit, more dimensions
than numpy makes, dimensions no array can index (even with no elements), on every route that parses
a body. Each must be a 4xx problem+json (not a 500) and leave the server answering good requests.
Bodies are recognised by content where the Content-Type says nothing (images on /encode, an image
sent to /decode is named in the 415)."""
from __future__ import annotations

import base64
import io
import json
import re
import sys
import time

import httpx
import numpy as np
import pytest
from PIL import Image

from live_server import REPO, npy

sys.path.insert(0, str(REPO / "tests" / "corpus"))
import make_corpus  # noqa: E402

DEEP = 100_000  # far past the default recursion limit of 1000
NESTED = ("[" * DEEP + "]" * DEEP).encode()
NESTED_OBJ = ('{"a":' * DEEP + "1" + "}" * DEEP).encode()
# /v2/repository/index reads at most 64 KiB (more is a 413): nested 5000 deep fits
SMALL_NESTED, SMALL_NESTED_OBJ = ("[" * 5000 + "]" * 5000).encode(), ('{"a":' * 5000 + "1" + "}" * 5000).encode()
DIMS_65 = [1] * 65             # numpy makes at most 64 dimensions
HUGE_EMPTY = [0, 10 ** 30]     # no elements, yet no array can have this dimension
HUGE_INT64 = [0, 2 ** 63 - 1, 4]  # every dimension fits int64, the size does not


def safetensors_body(header) -> bytes:
    h = header if isinstance(header, bytes) else json.dumps(header).encode()
    return len(h).to_bytes(8, "little") + h


def st_tensor(shape, nbytes: int) -> bytes:
    return safetensors_body({"latents": {"dtype": "F32", "shape": shape, "data_offsets": [0, nbytes]}}) + b"\0" * nbytes


def json_tensor(shape, nbytes: int) -> bytes:
    return json.dumps({"data": base64.b64encode(b"\0" * nbytes).decode(), "shape": shape}).encode()


def kserve_binary(shape, nbytes: int) -> tuple[bytes, dict]:
    head = json.dumps({"inputs": [{"name": "latents", "datatype": "FP32", "shape": shape,
                                   "parameters": {"binary_data_size": nbytes}}]}).encode()
    return head + b"\0" * nbytes, {"inference-header-content-length": str(len(head)),
                                   "content-type": "application/octet-stream"}


JSON = {"content-type": "application/json"}
ST = {"content-type": "application/vnd.safetensors"}
DEC, INFER, VAE, INDEX = ("/v1/models/tiny-vae/decode", "/v2/models/tiny-vae/infer",
                          "/v1/models/tiny-vae/vae/decode", "/v2/repository/index")

# (id, path, body, headers, query)
CASES = [
    ("v1-json-nested", DEC, NESTED, JSON, {}),
    ("v1-json-nested-object", DEC, NESTED_OBJ, JSON, {}),
    ("v1-json-65-dims", DEC, json_tensor(DIMS_65, 4), JSON, {}),
    ("v1-json-huge-empty", DEC, json_tensor(HUGE_EMPTY, 0), JSON, {}),
    ("v1-json-huge-int64", DEC, json_tensor(HUGE_INT64, 0), JSON, {}),
    ("v1-safetensors-nested", DEC, safetensors_body(NESTED), ST, {}),
    ("v1-safetensors-65-dims", DEC, st_tensor(DIMS_65, 4), ST, {}),
    ("v1-safetensors-huge-empty", DEC, st_tensor(HUGE_EMPTY, 0), ST, {}),
    ("v1-safetensors-no-content-type", DEC, st_tensor(HUGE_EMPTY, 0), {}, {}),
    ("v2-json-nested", INFER, NESTED, JSON, {}),
    ("v2-json-nested-data", INFER, json.dumps({"inputs": [{"name": "latents", "datatype": "FP32", "shape": [1],
                                                           "data": "PLACEHOLDER"}]}).encode()
     .replace(b'"PLACEHOLDER"', b"[" * 900 + b"0" + b"]" * 900), JSON, {}),
    ("v2-json-65-dims", INFER, json.dumps({"inputs": [{"name": "latents", "datatype": "FP32", "shape": DIMS_65,
                                                      "data": [0.0]}]}).encode(), JSON, {}),
    ("v2-json-huge-empty", INFER, json.dumps({"inputs": [{"name": "latents", "datatype": "FP32",
                                                         "shape": HUGE_EMPTY, "data": []}]}).encode(), JSON, {}),
    ("v2-binary-nested", INFER, NESTED, {"inference-header-content-length": str(len(NESTED)),
                                         "content-type": "application/octet-stream"}, {}),
    ("v2-binary-65-dims", INFER, *kserve_binary(DIMS_65, 4), {}),
    ("v2-binary-huge-empty", INFER, *kserve_binary(HUGE_EMPTY, 0), {}),
    ("v2-binary-huge-int64", INFER, *kserve_binary(HUGE_INT64, 0), {}),
    ("vae-decode-65-dims", VAE, b"\0" * 4, {"content-type": "tensor/binary"}, {"shape": DIMS_65}),
    ("vae-decode-huge-empty", VAE, b"", {"content-type": "tensor/binary"}, {"shape": HUGE_EMPTY}),
    ("vae-decode-huge-int64", VAE, b"", {"content-type": "tensor/binary"}, {"shape": HUGE_INT64}),
    ("repository-index-nested", INDEX, SMALL_NESTED, JSON, {}),
    ("repository-index-nested-object", INDEX, SMALL_NESTED_OBJ, JSON, {}),
]


def good_decode(url: str) -> None:
    lat = np.random.default_rng().standard_normal((1, 4, 3, 3)).astype(np.float32)
    r = httpx.post(f"{url}{DEC}", content=npy(lat), headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.headers["x-output-shape"] == "1,24,24,3"


@pytest.mark.parametrize("path,body,headers,query", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_hostile_body_is_a_4xx_and_the_server_keeps_serving(live_server, path, body, headers, query):
    r = httpx.post(f"{live_server.url}{path}", content=body, headers=headers, params=query, timeout=60)
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    assert r.headers["content-type"] == "application/problem+json"
    doc = r.json()
    assert doc["status"] == r.status_code and len(doc["detail"]) < 1000, doc
    good_decode(live_server.url)


def test_hostile_body_details(live_server):
    """The 4xx names what is wrong (nesting, the dimensions), not just that something is."""
    u = live_server.url
    r = httpx.post(f"{u}{DEC}", content=NESTED, headers=JSON, timeout=60)
    assert r.status_code == 400 and r.json()["type"].endswith("#bad-json") and "nested too deeply" in r.json()["detail"]
    r = httpx.post(f"{u}{DEC}", content=st_tensor(DIMS_65, 4), headers=ST, timeout=60)
    assert r.status_code == 400 and r.json()["type"].endswith("#bad-tensor") and "64" in r.json()["detail"]
    r = httpx.post(f"{u}{INDEX}", content=SMALL_NESTED_OBJ, headers=JSON, timeout=60)
    assert r.status_code == 400 and "nested too deeply" in r.json()["detail"]


# ---- bodies recognised by content ---------------------------------------------------------------------
def png_bytes(h: int = 40, w: int = 56) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng().integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def image_bytes(fmt: str) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng().integers(0, 256, (40, 56, 3), dtype=np.uint8)).save(buf, format=fmt)
    return buf.getvalue()


@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP"])
@pytest.mark.parametrize("content_type", [None, "application/octet-stream", "application/x-www-form-urlencoded"])
def test_encode_recognises_images_by_content(live_server, fmt, content_type):
    data = image_bytes(fmt)
    url = f"{live_server.url}/v1/models/tiny-convnext/encode"
    want = httpx.post(url, content=data, headers={"content-type": f"image/{fmt.lower()}"}, timeout=60)
    assert want.status_code == 200, want.text
    headers = {"content-type": content_type} if content_type else {}
    r = httpx.post(url, content=data, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(r.json()["embeddings"], want.json()["embeddings"], rtol=1e-5, atol=1e-6)


def test_encode_recognises_npy_and_safetensors_by_content(live_server):
    px = np.random.default_rng().integers(0, 256, (1, 30, 30, 3), dtype=np.uint8)
    url = f"{live_server.url}/v1/models/tiny-convnext/encode"
    want = httpx.post(url, content=npy(px), headers={"content-type": "application/x-npy"}, timeout=60)
    assert want.status_code == 200, want.text
    st = safetensors_body({"pixels": {"dtype": "U8", "shape": list(px.shape), "data_offsets": [0, px.nbytes]}})
    for body in (npy(px), st + px.tobytes()):
        for headers in ({}, {"content-type": "application/octet-stream"}):
            r = httpx.post(url, content=body, headers=headers, timeout=60)
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(r.json()["embeddings"], want.json()["embeddings"], rtol=1e-5, atol=1e-6)


def test_unaccepted_types_name_every_accepted_one(live_server):
    """The encode 415 lists the image types too; an image sent to decode is named as one."""
    u = live_server.url
    r = httpx.post(f"{u}/v1/models/tiny-convnext/encode", content=b"hello there", headers={"content-type": "text/plain"},
                   timeout=60)
    assert r.status_code == 415, r.text
    detail = r.json()["detail"]
    for t in ("image/jpeg", "image/png", "image/webp", "multipart/form-data", "application/x-npy"):
        assert t in detail, detail
    r = httpx.post(f"{u}/v1/models/tiny-convnext/encode", content=b"hello there",
                   headers={"content-type": "application/x-www-form-urlencoded"}, timeout=60)
    assert r.status_code == 415 and "image/png" in r.json()["detail"], r.text
    for headers in ({}, {"content-type": "application/octet-stream"}):
        r = httpx.post(f"{u}{DEC}", content=png_bytes(), headers=headers, timeout=60)
        assert r.status_code == 415, r.text
        assert "PNG image" in r.json()["detail"] and "application/x-npy" in r.json()["detail"], r.text


# ---- hostile .npy on every route that reads one -------------------------------------------------------
#: the 128-byte .npy of the overflow report: dimensions multiplying past int64, one of them zero
#: (it was a 500: the reshape of its zero elements raised); and a sibling declaring 149 GiB in 64
#: bytes, Fortran order (np.load allocated the declared size before it read the data)
ROW2 = make_corpus.npy_with_header("{'descr': '<f4', 'fortran_order': False, 'shape': (4294967296, 4294967296, 1, 0), }",
                                   b"")
LYING = make_corpus.npy_with_header("{'descr': '<f4', 'fortran_order': True, 'shape': (4, 100000, 100000), }",
                                    b"\0" * 64)
NPY_CT = {"content-type": "application/x-npy"}
#: (id, path, headers): every route that takes .npy, by Content-Type and, where that may be left
#: out, by its magic bytes
NPY_ROUTES = [
    ("decode", DEC, NPY_CT),
    ("decode-sniffed", DEC, {}),
    ("decode-stream", "/v1/models/tiny-wan-vae/decode/stream", NPY_CT),
    ("encode", "/v1/models/tiny-convnext/encode", NPY_CT),
    ("encode-sniffed", "/v1/models/tiny-convnext/encode", {"content-type": "application/octet-stream"}),
    ("vae-encode", "/v1/models/tiny-vae/vae/encode", NPY_CT),
    ("vae-encode-sniffed", "/v1/models/tiny-vae/vae/encode", {}),
]


def kind_of(r: httpx.Response) -> str:
    """The problem kind: what follows the last "/" or "#" of its type reference."""
    return re.split(r"[/#]", r.json()["type"])[-1]


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


@pytest.mark.parametrize("path,headers", [r[1:] for r in NPY_ROUTES], ids=[r[0] for r in NPY_ROUTES])
def test_a_hostile_npy_is_400_bad_npy_at_once_on_every_npy_route(live_server, path, headers):
    """Refused from its header: within a second (or ten times a trivial request on a busy box),
    with the server's memory where it was."""
    assert len(ROW2) == 128
    u = live_server.url
    t0 = time.monotonic()
    httpx.get(f"{u}/healthz", timeout=30)
    bound = max(1.0, 10 * (time.monotonic() - t0))
    rss0 = rss_mib(live_server.proc.pid)
    for body, words in ((ROW2, "larger than any array"), (LYING, "bytes of data")):
        t0 = time.monotonic()
        r = httpx.post(f"{u}{path}", content=body, headers=headers, timeout=60)
        secs = time.monotonic() - t0
        assert r.status_code == 400 and kind_of(r) == "bad-npy", (r.status_code, r.text[:300])
        detail = r.json()["detail"]
        assert words in detail and "\n" not in detail and len(detail) < 300, detail
        assert secs < bound, f"{secs:.2f}s to refuse a {len(body)}-byte .npy"
    assert rss_mib(live_server.proc.pid) - rss0 < 32
    good_decode(u)


# ---- bodies whose magic bytes contradict their Content-Type -----------------------------------------------
ENC, VAE_ENC = "/v1/models/tiny-convnext/encode", "/v1/models/tiny-vae/vae/encode"


def one_line_415(r: httpx.Response) -> str:
    assert r.status_code == 415 and kind_of(r) == "unsupported-media-type", (r.status_code, r.text[:300])
    detail = r.json()["detail"]
    assert "\n" not in detail and len(detail) < 300 and "pickle" not in detail, detail
    return detail


@pytest.mark.parametrize("fmt", ["JPEG", "PNG", "WEBP"])
def test_an_image_sent_as_npy_is_named_with_the_content_type_to_use(live_server, fmt):
    """It was a 400 about pickles (np.load's words for bytes that are no .npy)."""
    data, media = image_bytes(fmt), f"image/{fmt.lower()}"
    u = live_server.url
    detail = one_line_415(httpx.post(f"{u}{DEC}", content=data, headers=NPY_CT, timeout=60))
    assert f"{fmt} image" in detail and "application/x-npy" in detail and "tensors" in detail, detail
    for path in (ENC, VAE_ENC):  # routes that take the image itself: its own Content-Type is named
        detail = one_line_415(httpx.post(f"{u}{path}", content=data, headers=NPY_CT, timeout=60))
        assert f"{fmt} image" in detail and f"Content-Type: {media}" in detail, detail
        assert httpx.post(f"{u}{path}", content=data, headers={"content-type": media}, timeout=60).status_code == 200


def test_an_npy_sent_as_json_or_safetensors_is_named(live_server):
    """It was a 400 about undecodable UTF-8 (JSON) or a header length past the body (safetensors)."""
    u = live_server.url
    lat = npy(np.zeros((1, 4, 3, 3), np.float32))
    px = npy(np.zeros((1, 8, 8, 3), np.uint8))
    for path, body in ((DEC, lat), (ENC, px)):
        for media in ("application/json", "application/vnd.safetensors"):
            detail = one_line_415(httpx.post(f"{u}{path}", content=body, headers={"content-type": media}, timeout=60))
            assert "looks like a .npy file" in detail and "Content-Type: application/x-npy" in detail, detail
        assert httpx.post(f"{u}{path}", content=body, headers=NPY_CT, timeout=60).status_code == 200
