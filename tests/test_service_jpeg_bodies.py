"""Encode requests' JPEG files decoded in the model worker (JPEG_DECODE; service/worker/jpeg_bodies.py):
which files a front end hands over undecoded (service/codecs/jpeg_header.py), and, on a real server
whose NumPy worker decodes them with PIL (JPEG_DECODE=worker: the GPU's engines are the GPU test's),
that each request gets its own image's embedding, a corrupt file fails alone, and every other
file is still the front end's to decode."""
from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from PIL import Image

from live_server import from_npy, metric, npy, scrape
from service.codecs.jpeg_header import device_decodable_size

SIZE = 64  # tiny-convnext's input size
ENCODE = "/v1/models/tiny-convnext/encode"


def photo(seed: int, h: int = SIZE, w: int = SIZE) -> np.ndarray:
    """Smooth gradients with noise: what a camera gives, not what compresses to nothing."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:h, 0:w] / max(h, w)
    base = np.stack([np.sin(6 * x + seed), np.cos(5 * y - seed), np.sin(4 * (x + y))], axis=-1)
    img = 127.5 + 100 * base + rng.normal(0, 12, (h, w, 3))
    return np.clip(img, 0, 255).astype(np.uint8)


def jpeg(img: np.ndarray | Image.Image, **kw) -> bytes:
    buf = io.BytesIO()
    (img if isinstance(img, Image.Image) else Image.fromarray(img)).save(buf, format="JPEG", **kw)
    return buf.getvalue()


# ---- which files a worker may decode ---------------------------------------------------------------
def test_baseline_ycbcr_jpegs_give_their_size_and_every_other_file_none():
    img = Image.fromarray(photo(0, 48, 80))
    assert device_decodable_size(jpeg(img, quality=90)) == (48, 80)            # 4:2:0, PIL's default
    # as the worker holds it: a uint8 array in its front end's arena (items NumPy integers, whose shifts wrap)
    assert device_decodable_size(np.frombuffer(jpeg(img, quality=90), np.uint8)) == (48, 80)
    assert device_decodable_size(jpeg(img, quality=90, subsampling=0)) == (48, 80)  # 4:4:4
    assert device_decodable_size(jpeg(img, quality=90, subsampling=1)) == (48, 80)  # 4:2:2
    assert device_decodable_size(jpeg(img, progressive=True)) is None          # the engines take baseline only
    assert device_decodable_size(jpeg(img.convert("L"))) is None               # greyscale: one component
    assert device_decodable_size(jpeg(img.convert("CMYK"))) is None            # four components, Adobe APP14
    png = io.BytesIO()
    img.save(png, format="PNG")
    assert device_decodable_size(png.getvalue()) is None
    assert device_decodable_size(b"") is None and device_decodable_size(b"\xff\xd8") is None


def test_an_adobe_segment_anywhere_before_the_scan_keeps_the_file_on_the_front_end():
    data = jpeg(photo(1), quality=90)
    app14 = b"\xff\xee\x00\x0eAdobe\x00\x64\x00\x00\x00\x00\x00"  # transform 0: the components may be RGB
    sos = data.index(b"\xff\xda")
    assert device_decodable_size(data) == (SIZE, SIZE)
    assert device_decodable_size(data[:2] + app14 + data[2:]) is None
    assert device_decodable_size(data[:sos] + app14 + data[sos:]) is None


def test_components_named_r_g_b_keep_the_file_on_the_front_end():
    data = bytearray(jpeg(photo(2), quality=90))
    sof = data.index(b"\xff\xc0")
    assert device_decodable_size(bytes(data)) == (SIZE, SIZE)
    for k, name in enumerate(b"RGB"):  # component ids at 10, 13, 16 bytes past the marker
        data[sof + 10 + 3 * k] = name
    assert device_decodable_size(bytes(data)) is None


def corrupt_scan(data: bytes) -> bytes:
    """The file with its scan naming a component the frame lacks: its header passes, PIL refuses it."""
    out = bytearray(data)
    out[out.index(b"\xff\xda") + 5] = 9
    return bytes(out)


def test_every_truncation_and_byte_flip_of_a_header_is_read_without_raising():
    data = jpeg(photo(3), quality=90)
    header_end = data.index(b"\xff\xda") + 2
    for n in range(len(data)):
        assert device_decodable_size(data[:n]) is None  # cut short (no end-of-image marker): never passed
    rng = np.random.default_rng(3)
    for _ in range(400):
        flipped = bytearray(data)
        flipped[int(rng.integers(0, header_end))] = int(rng.integers(0, 256))
        got = device_decodable_size(bytes(flipped))
        assert got is None or (isinstance(got, tuple) and len(got) == 2)


# ---- a worker that decodes them (PIL on the NumPy backend) -----------------------------------------
@pytest.fixture(scope="module")
def worker_decodes(server_factory):
    return server_factory(models="tiny-convnext", jpeg_decode="worker", max_queue_delay_ms=20)


def _encode(url: str, body: bytes, ctype: str = "image/jpeg") -> httpx.Response:
    return httpx.post(url + ENCODE, content=body, params={"format": "npy"}, headers={"content-type": ctype},
                      timeout=60)


def _reference(url: str, data: bytes) -> np.ndarray:
    """The embedding of PIL's pixels of `data`, sent as uint8 .npy (no file to decode)."""
    px = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))[None]
    r = _encode(url, npy(px), "application/x-npy")
    assert r.status_code == 200, r.text
    return from_npy(r.content)


def _decodes(url: str) -> dict[str, float]:
    snap = scrape(url)
    return {where: metric(snap, "convserve_image_decodes_total", model="tiny-convnext", where=where)
            for where in ("frontend", "device", "worker-host")}


def test_each_request_gets_its_own_images_embedding_and_a_corrupt_file_fails_alone(worker_decodes):
    url = worker_decodes.url
    files = [jpeg(photo(10 + i), quality=85 + i % 10, subsampling=i % 3) for i in range(24)]
    refs = [_reference(url, f) for f in files]
    corrupt = corrupt_scan(files[0])
    assert device_decodable_size(corrupt) == (SIZE, SIZE)
    bodies = files + [corrupt, corrupt]
    before = _decodes(url)
    with ThreadPoolExecutor(len(bodies)) as pool:  # at once: the worker batches them
        answers = list(pool.map(lambda b: _encode(url, b), bodies))
    after = _decodes(url)
    for i, r in enumerate(answers[:len(files)]):
        assert r.status_code == 200, r.text
        got = from_npy(r.content)
        # batched beside others here, alone in the reference: the same pixels, a batch's rounding
        assert np.linalg.norm(got - refs[i]) <= 1e-5 * np.linalg.norm(refs[i]), i
    for r in answers[len(files):]:
        assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json"
        assert "corrupt" in r.json()["detail"] and "\n" not in r.json()["detail"]
    assert after["worker-host"] - before["worker-host"] == len(files)
    assert after["frontend"] == before["frontend"]
    assert httpx.get(url + "/healthz").status_code == 200
    assert _encode(url, files[1]).status_code == 200


def test_files_the_worker_does_not_take_are_decoded_by_the_front_end(worker_decodes):
    url = worker_decodes.url
    img = photo(40)
    cut = jpeg(img, quality=90)
    others = [jpeg(img, progressive=True), jpeg(photo(41, SIZE + 8, SIZE)), jpeg(Image.fromarray(img).convert("L")),
              cut[:len(cut) // 2]]  # cut short: refused by the front end's decode
    before = _decodes(url)
    answers = [_encode(url, body).status_code for body in others]
    after = _decodes(url)
    assert answers == [200, 200, 200, 422]
    assert after["frontend"] - before["frontend"] == len(others) - 1  # counted once decoded
    assert after["worker-host"] == before["worker-host"]


def test_a_cpu_worker_leaves_jpeg_files_to_the_front_ends_by_default(live_server):
    url = live_server.url
    before = _decodes(url)
    assert _encode(url, jpeg(photo(50), quality=90)).status_code == 200
    after = _decodes(url)
    assert after["frontend"] - before["frontend"] == 1
    assert after["worker-host"] == before["worker-host"] and after["device"] == before["device"]


# ---- the worker's choices around a device decoder, on a NumPy stand-in for the GPU's engines ------
class EnginesOnNumpy:
    """The CUDA backend's jpeg_decoder() contract (convkernels/backends/cuda/codecs/jpeg.py) on host
    arrays: decodes what the engines take (baseline files, by PIL) and refuses the rest, as they do."""
    direct = True

    def new_rows(self, n, height, width):
        return np.full((n, height, width, 3), 77, np.uint8)  # not zeros: a failed row must be cleared

    def decode_into(self, bodies, out, rows):
        ok = []
        for body, r in zip(bodies, rows):
            ok.append(device_decodable_size(body) is not None)
            if ok[-1]:
                out[r] = np.asarray(Image.open(io.BytesIO(body.tobytes())).convert("RGB"))
        return ok

    def set_row(self, out, row, pixels):
        out[row] = 0 if pixels is None else pixels

    def ready(self, out):
        return "ready"

    def to_host(self, x):
        return np.asarray(x)


def test_with_a_device_decoder_each_file_goes_where_it_can_and_a_bad_one_fails_alone():
    from service import metrics
    from service.worker.jpeg_bodies import JpegBodies, probe_decoder

    engines = EnginesOnNumpy()
    probe_decoder(engines)
    good = jpeg(photo(60), quality=90)
    progressive = jpeg(photo(61), progressive=True)  # refused by the engines: PIL decodes it here
    corrupt = corrupt_scan(jpeg(photo(62), progressive=True))  # refused by both: fails alone
    other_size = jpeg(photo(63, SIZE - 4, SIZE))  # never sent to the engines (its header says so)
    files = [good, progressive, corrupt, good, other_size]
    count = {where: metrics.IMAGE_DECODES.labels("m", where) for where in ("device", "worker-host")}
    before = {where: c._value.get() for where, c in count.items()}
    px, failures, ready = JpegBodies(engines, "cpu").decode("m", [np.frombuffer(f, np.uint8) for f in files], SIZE)
    assert set(failures) == {2, 4} and ready == "ready"
    assert "corrupt" in str(failures[2]) and f"{SIZE}x{SIZE}" in str(failures[4])
    assert not px[2].any() and not px[4].any()
    for i in (0, 1, 3):
        assert np.array_equal(px[i], np.asarray(Image.open(io.BytesIO(files[i])).convert("RGB")))
    assert count["device"]._value.get() - before["device"] == 2
    assert count["worker-host"]._value.get() - before["worker-host"] == 1
