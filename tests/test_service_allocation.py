"""Limits on what the server allocates, not only on what it receives: an image to encode is
resized to the model's input from the source region under the centre crop (never the whole
resized image, which for a 1xN strip is input^2 * N pixels), and an extreme aspect ratio is
refused with a 4xx naming its limit on every encode route, before any pixel is resized.
The resize is checked against PIL's resize-the-whole-image-then-crop, the transform it replaces."""
from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest
from PIL import Image

from live_server import from_npy, npy
from service.codecs import preprocess

#: peak RSS growth allowed for every request below (the 1x10000 strip alone used to add 1.6 GiB)
PEAK_RSS_BUDGET_MIB = 64
INPUT = 64  # tiny-convnext


def peak_rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024


def png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def resize_then_crop(img: np.ndarray, size: int, crop_pct: float = 0.875) -> np.ndarray:
    """The evaluation transform as written before: bicubic resize of the whole image (short side
    to size / crop_pct) in PIL 'F' mode, then the centre crop; an image at the size is kept."""
    x = img.astype(np.float32) / 255.0 if img.dtype == np.uint8 else img.astype(np.float32)
    h, w = x.shape[:2]
    if (h, w) == (size, size):
        return np.clip(x, 0.0, 1.0)
    short = max(size, int(round(size / crop_pct)))
    scale = short / min(h, w)
    nh, nw = max(size, round(h * scale)), max(size, round(w * scale))
    x = np.stack([np.asarray(Image.fromarray(np.ascontiguousarray(x[..., c]), mode="F").resize((nw, nh), Image.BICUBIC))
                  for c in range(3)], axis=-1)
    top, left = (nh - size) // 2, (nw - size) // 2
    return np.clip(x[top:top + size, left:left + size], 0.0, 1.0)


def test_crop_before_resize_matches_resize_then_crop():
    rng = np.random.default_rng()
    sizes = [(int(rng.integers(2, 700)), int(rng.integers(2, 700))) for _ in range(6)] + [(7, 200), (301, 9), (64, 64)]
    for h, w in sizes:
        for as_uint8 in (True, False):
            img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8) if as_uint8 else rng.random((h, w, 3), dtype=np.float32)
            for size in (INPUT, 224):
                got = preprocess(img, size)
                assert got.shape == (size, size, 3) and got.dtype == np.float32
                # float rounding of the region's coordinates only: 1e-4 is 1/40 of a uint8 step
                np.testing.assert_allclose(got, resize_then_crop(img, size), atol=1e-4, err_msg=f"{h}x{w} -> {size}")


@pytest.fixture(scope="module")
def srv(server_factory):
    return server_factory(models="tiny-convnext")


def encode(srv, **kw) -> httpx.Response:
    return httpx.post(f"{srv.url}/v1/models/tiny-convnext/encode", timeout=60, **kw)


def kserve_uint8(srv, pixels: np.ndarray) -> httpx.Response:
    raw = pixels.tobytes()
    head = json.dumps({"inputs": [{"name": "pixels", "datatype": "UINT8", "shape": list(pixels.shape),
                                   "parameters": {"binary_data_size": len(raw)}}]}).encode()
    return httpx.post(f"{srv.url}/v2/models/tiny-convnext/infer", content=head + raw, timeout=60,
                      headers={"content-type": "application/octet-stream",
                               "Inference-Header-Content-Length": str(len(head))})


def assert_aspect_refused(r: httpx.Response) -> None:
    assert r.status_code == 422, (r.status_code, r.text[:300])
    assert r.headers["content-type"] == "application/problem+json"
    doc = r.json()
    assert doc["type"].endswith("#extreme-aspect-ratio") and "CONVSERVE_MAX_ASPECT_RATIO" in doc["detail"], doc


def test_thin_strips_are_refused_on_every_encode_route_with_bounded_memory(srv):
    """A 1x10000 PNG (the 111-byte bomb), the same as multipart and as .npy pixels, and its KServe
    twin UINT8 [1,1,12000,3]: 422 extreme-aspect-ratio, and the server's peak RSS barely moves."""
    rng = np.random.default_rng()
    strip = rng.integers(0, 256, (1, 10000, 3), dtype=np.uint8)
    before = peak_rss_mib(srv.proc.pid)
    assert_aspect_refused(encode(srv, content=png(strip), headers={"content-type": "image/png"}))
    assert_aspect_refused(encode(srv, content=png(np.zeros((10000, 1, 3), np.uint8)), headers={"content-type": "image/png"}))
    assert_aspect_refused(encode(srv, files=[("files", ("strip.png", png(strip), "image/png"))]))
    assert_aspect_refused(encode(srv, content=npy(strip), headers={"content-type": "application/x-npy"}))
    assert_aspect_refused(kserve_uint8(srv, rng.integers(0, 256, (1, 1, 12000, 3), dtype=np.uint8)))
    grown = peak_rss_mib(srv.proc.pid) - before
    assert grown < PEAK_RSS_BUDGET_MIB, f"peak RSS grew by {grown:.0f} MiB"
    assert httpx.get(f"{srv.url}/readyz").status_code == 200
    print(f"ALLOCATION thin strips refused 422 on REST, multipart, npy and KServe; peak RSS +{grown:.1f} MiB")


def test_a_strip_within_the_limit_is_encoded_as_resize_then_crop_would(srv):
    """An 8x256 image (aspect 32, the default limit) is served, and its embedding is the one of
    the pixels the old whole-image resize gave (sent pre-sized as float .npy pixels)."""
    rgb = np.random.default_rng().integers(0, 256, (8, 256, 3), dtype=np.uint8)
    before = peak_rss_mib(srv.proc.pid)
    r = encode(srv, content=png(rgb), headers={"content-type": "image/png"}, params={"format": "npy"})
    assert r.status_code == 200, r.text
    ref = encode(srv, content=npy(resize_then_crop(rgb, INPUT)[None]), headers={"content-type": "application/x-npy"},
                 params={"format": "npy"})
    assert ref.status_code == 200, ref.text
    np.testing.assert_allclose(from_npy(r.content), from_npy(ref.content), rtol=1e-3, atol=1e-4)
    assert peak_rss_mib(srv.proc.pid) - before < PEAK_RSS_BUDGET_MIB
