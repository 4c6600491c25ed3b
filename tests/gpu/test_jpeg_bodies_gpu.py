"""JPEG files decoded on the GPU's hardware JPEG engines (service/worker/jpeg_bodies.py): the pixels PIL
gives, a file the engines refuse decoded by PIL instead, a corrupt one failed alone; and through a
real server on the CUDA backend, one-image JPEG encodes decoded on the device with the embedding of
the same pixels sent as .npy. Skipped without a CUDA GPU, CuPy and nvImageCodec
(`nvidia-nvimgcodec-cu13`), or on a GPU without JPEG engines."""
from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image

from gpu_support import cuda_or_skip, report_parity
from service.worker.jpeg_bodies import PROBE_MAX_DIFF

pytestmark = pytest.mark.gpu


def _photo(seed: int, size: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:size, 0:size] / size
    base = np.stack([np.sin(6 * x + seed), np.cos(5 * y - seed), np.sin(4 * (x + y))], axis=-1)
    return np.clip(127.5 + 100 * base + rng.normal(0, 12, (size, size, 3)), 0, 255).astype(np.uint8)


def _jpeg(img: np.ndarray, **kw) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", **kw)
    return buf.getvalue()


def _pil(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))


def _decoded(where: str) -> float:
    from service import metrics
    return metrics.IMAGE_DECODES.labels("m", where)._value.get()


def _report(line: str) -> None:
    report_parity(line, "jpeg_bodies.txt")


@pytest.fixture(scope="module")
def hardware():
    cuda_or_skip()
    pytest.importorskip("nvidia.nvimgcodec")
    from gpu_support import cuda_backend

    from service.worker.jpeg_bodies import probe_decoder
    try:
        dec = cuda_backend("float16").jpeg_decoder()  # the backend's own decoder, as a worker takes it
        probe_decoder(dec)
    except RuntimeError as exc:
        pytest.skip(f"no hardware JPEG decode here: {exc}")
    return dec


def test_the_engines_give_pils_pixels(hardware):
    from service.worker.jpeg_bodies import JpegBodies

    cp = hardware.cp
    bodies = JpegBodies(hardware, "cuda:0")
    files = [_jpeg(_photo(i, 224), quality=70 + 5 * (i % 6), subsampling=i % 3) for i in range(12)]
    before = _decoded("device")
    px, failures, _ = bodies.decode("m", [np.frombuffer(f, np.uint8) for f in files], 224)
    cp.cuda.get_current_stream().synchronize()
    assert not failures and px.shape == (12, 224, 224, 3) and px.dtype == np.uint8
    assert _decoded("device") - before == 12  # by the engines, not PIL's fallback
    got = cp.asnumpy(px)
    diffs = [int(np.abs(got[i].astype(np.int16) - _pil(f).astype(np.int16)).max()) for i, f in enumerate(files)]
    means = [float(np.abs(got[i].astype(np.int16) - _pil(f).astype(np.int16)).mean()) for i, f in enumerate(files)]
    _report(f"hardware JPEG decode vs PIL, 12 files 224x224 (4:2:0, 4:4:4, 4:2:2; q70-95): max abs diff {diffs}, "
            f"mean {max(means):.4f}")
    assert max(diffs) <= PROBE_MAX_DIFF


def test_a_file_the_engines_refuse_goes_to_pil_and_a_corrupt_one_fails_alone(hardware):
    from service.worker.jpeg_bodies import JpegBodies

    cp = hardware.cp
    good = _jpeg(_photo(1, 96), quality=90)
    progressive = _jpeg(_photo(2, 96), quality=90, progressive=True)
    # the engines take baseline only (why the header check keeps progressive files from them)
    rows = hardware.new_rows(1, 96, 96)
    assert hardware.decode_into([np.frombuffer(progressive, np.uint8)], rows, [0]) == [False]
    corrupt = bytearray(progressive)
    corrupt[corrupt.index(b"\xff\xda") + 5] = 9  # its scan names a component the frame lacks: PIL refuses it
    files = [good, progressive, bytes(corrupt), good]
    before = {where: _decoded(where) for where in ("device", "worker-host")}
    px, failures, _ = JpegBodies(hardware, "cuda:0").decode("m", [np.frombuffer(f, np.uint8) for f in files], 96)
    got = cp.asnumpy(px)
    assert set(failures) == {2} and "corrupt" in str(failures[2])
    assert _decoded("device") - before["device"] == 2 and _decoded("worker-host") - before["worker-host"] == 1
    assert not got[2].any()
    for i in (0, 1, 3):
        assert np.abs(got[i].astype(np.int16) - _pil(files[i]).astype(np.int16)).max() <= PROBE_MAX_DIFF
    _report(f"decoded into the batch's own rows (nvImageCodec images wrapping them): {hardware.direct}")


def test_one_image_jpeg_encodes_are_decoded_on_the_device_through_the_service(hardware, tmp_path_factory):
    import httpx

    from live_server import from_npy, metric, npy, scrape, start_server

    server = start_server(tmp_path_factory.mktemp("servers"), ready_timeout=150, backend="cuda",
                          models="tiny-convnext", max_queue_delay_ms=5, jpeg_decode="auto")
    try:
        url = server.url + "/v1/models/tiny-convnext/encode"
        files = [_jpeg(_photo(10 + i, 64), quality=90) for i in range(48)]

        def post(body, ctype):
            r = httpx.post(url, content=body, params={"format": "npy"}, headers={"content-type": ctype}, timeout=60)
            assert r.status_code == 200, r.text
            return from_npy(r.content)

        refs = [post(npy(_pil(f)[None]), "application/x-npy") for f in files]
        # all at once, twice over: decoded together on the decode thread, batched on the device thread
        with ThreadPoolExecutor(len(files)) as pool:
            for _ in range(2):
                got = list(pool.map(lambda f: post(f, "image/jpeg"), files))
                for a, b in zip(got, refs):
                    # the same pixels (the engines' within PROBE_MAX_DIFF of PIL's) through one model in its dtype
                    assert np.linalg.norm(a - b) <= 2e-2 * np.linalg.norm(b)
        snap = scrape(server.url)
        on_device = metric(snap, "convserve_image_decodes_total", model="tiny-convnext", where="device")
        in_front = metric(snap, "convserve_image_decodes_total", model="tiny-convnext", where="frontend")
        _report(f"service: {len(files)} JPEG encodes, {on_device:g} decoded on the device, {in_front:g} in a front end")
        assert on_device == 2 * len(files) and in_front == 0
    finally:
        server.stop()
