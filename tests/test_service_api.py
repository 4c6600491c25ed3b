"""The /v1 API over HTTP against a real uvicorn server: every endpoint, input and output format.
References: PIL decodes our PNG/JPEG/WebP, PyAV our MP4, zipfile our zips, torch our top-k."""
from __future__ import annotations

import base64
import io
import json
import zipfile
from decimal import Decimal

import httpx
import numpy as np
import pytest
from live_server import from_npy, metric, metric_sum, npy, scrape
from PIL import Image
from reference_checks import rel_l2

from service import codecs

#: the same pixels encoded in another batch, or through another body format, give the same embedding
#: up to float32 summation order: a batch of 3 is another gemm shape, and may take another conv
#: path. Element-wise bounds (1e-5 relative, 1e-6 absolute) failed once in three runs of the suite on
#: the 2-core machine; the relative L2 bound is the float32 parity bar of every other test.
SAME_PIXELS_TOL = 1e-5

NPY = {"content-type": "application/x-npy"}


def rng():
    return np.random.default_rng()


def latents(n=1, h=5, w=7, c=4):
    return rng().standard_normal((n, c, h, w)).astype(np.float32)


def post_decode(url, body, model="tiny-vae", headers=NPY, **params):
    return httpx.post(f"{url}/v1/models/{model}/decode", content=body, headers=headers, params=params, timeout=60)


def png_rgb(data: bytes) -> np.ndarray:
    return np.asarray(Image.open(io.BytesIO(data)).convert("RGB")).astype(np.int16)


def test_health_ready_openapi(live_server):
    u = live_server.url
    assert httpx.get(f"{u}/healthz").json() == {"status": "ok"}
    r = httpx.get(f"{u}/readyz")
    assert r.status_code == 200 and set(r.json()["models"]) == {"tiny-vae", "tiny-convnext", "tiny-wan-vae"}
    spec = httpx.get(f"{u}/openapi.json").json()
    for path in ("/v1/models/{name}/decode", "/v1/models/{name}/encode", "/v1/models", "/v1/models/{name}",
                 "/v1/kernels", "/healthz", "/readyz", "/metrics", "/v2/models/{name}/infer",
                 "/v2/health/live", "/v2/health/ready", "/v2/models/{name}", "/v2/models/{name}/ready"):
        assert path in spec["paths"], path
    dec = spec["paths"]["/v1/models/{name}/decode"]["post"]
    assert {"application/x-npy", "application/vnd.safetensors", "application/json"} <= set(dec["requestBody"]["content"])
    assert {"image/png", "application/zip", "video/mp4"} <= set(dec["responses"]["200"]["content"])
    assert "application/problem+json" in dec["responses"]["422"]["content"]
    enc = spec["paths"]["/v1/models/{name}/encode"]["post"]
    assert {"image/jpeg", "image/png", "image/webp", "multipart/form-data"} <= set(enc["requestBody"]["content"])


def test_model_cards_and_kernels(live_server):
    u = live_server.url
    doc = httpx.get(f"{u}/v1/models").json()
    cards = {c["name"]: c for c in doc["models"]}
    assert cards["tiny-vae"]["kind"] == "image-decoder" and cards["tiny-wan-vae"]["kind"] == "video-decoder"
    assert cards["tiny-convnext"]["kind"] == "image-encoder"
    for c in cards.values():
        assert c["weights"] == "random init" and c["backend"] == "numpy" and c["warmup_seconds"] > 0
        assert c["inputs"] and c["outputs"]
    assert httpx.get(f"{u}/v1/models/tiny-vae").json()["latent_channels"] == 4
    r = httpx.get(f"{u}/v1/models/nope")
    assert r.status_code == 404 and r.headers["content-type"] == "application/problem+json"
    body = r.json()
    assert body["status"] == 404 and body["type"].endswith("#unknown-model") and "nope" in body["detail"]
    k = httpx.get(f"{u}/v1/kernels").json()
    assert k["backend"]["backend"] == "numpy"
    assert k["conv_choices"], "warm-up ran convs, so path choices are memoised"
    assert isinstance(k["plan_cache"], dict)


def test_decode_npy_png_jpeg_webp(live_server):
    u, lat = live_server.url, latents()
    ref = from_npy(post_decode(u, npy(lat), format="npy").content)
    assert ref.shape == (1, 40, 56, 3) and ref.dtype == np.float32
    assert 0.0 <= ref.min() and ref.max() <= 1.0 and ref.std() > 0
    ref8 = np.clip(ref[0] * 255 + 0.5, 0, 255).astype(np.int16)
    r = post_decode(u, npy(lat))  # png is the default
    assert r.status_code == 200 and r.headers["content-type"] == "image/png"
    assert r.headers["x-output-shape"] == "1,40,56,3"
    assert np.abs(png_rgb(r.content) - ref8).max() <= 1
    for fmt, mime in (("jpeg", "image/jpeg"), ("webp", "image/webp")):
        r = post_decode(u, npy(lat), format=fmt, quality=95)
        assert r.status_code == 200 and r.headers["content-type"] == mime
        img = Image.open(io.BytesIO(r.content))
        assert img.format == {"jpeg": "JPEG", "webp": "WEBP"}[fmt] and img.size == (56, 40)
        # lossy: the reference is PIL compressing the same pixels at the same quality (and WebP method)
        buf = io.BytesIO()
        extra = {"method": codecs.WEBP_METHOD} if fmt == "webp" else {}
        Image.fromarray(ref8.astype(np.uint8)).save(buf, format=img.format, quality=95, **extra)
        assert np.abs(png_rgb(r.content) - png_rgb(buf.getvalue())).mean() < 1.0


def test_decode_pixels_leave_as_uint8_or_float16_on_request(live_server):
    """npy dtype=uint8 is the device's rounding, exactly the host's of the float32 image; a PNG
    holds exactly those pixels (lossless); float16 is the float32 image cast."""
    u, lat = live_server.url, latents(n=2, h=7, w=5)
    ref = from_npy(post_decode(u, npy(lat), format="npy").content)
    r = post_decode(u, npy(lat), format="npy", dtype="uint8")
    assert r.status_code == 200 and r.headers["x-output-shape"] == "2,56,40,3"
    px = from_npy(r.content)
    assert px.dtype == np.uint8
    np.testing.assert_array_equal(px, codecs.to_uint8(ref))
    half = from_npy(post_decode(u, npy(lat), format="npy", dtype="float16").content)
    np.testing.assert_array_equal(half, ref.astype(np.float16))
    one = post_decode(u, npy(lat[:1]))  # png
    np.testing.assert_array_equal(png_rgb(one.content), px[0].astype(np.int16))
    assert post_decode(u, npy(lat), format="npy", dtype="int8").status_code == 422


def test_encode_uint8_pixels_travel_as_uint8_and_match_the_float_route(live_server):
    u = live_server.url
    card = httpx.get(f"{u}/v1/models/tiny-convnext").json()
    size = card["inputs"][0]["resized_to"][0]
    img = rng().integers(0, 256, (2, size, size, 3), dtype=np.uint8)

    def embed(body, ctype):
        r = httpx.post(f"{u}/v1/models/tiny-convnext/encode", content=body, headers={"content-type": ctype},
                       params={"format": "npy"}, timeout=60)
        assert r.status_code == 200, r.text
        return from_npy(r.content)

    as_u8 = embed(npy(img), "application/x-npy")
    as_f32 = embed(npy(img.astype(np.float32) / 255), "application/x-npy")
    np.testing.assert_allclose(as_u8, as_f32, rtol=1e-4, atol=1e-5)
    buf = io.BytesIO()
    Image.fromarray(img[1]).save(buf, format="PNG")
    # the PNG decodes to the same uint8 pixels (a batch of one: the gemm may sum in another order)
    assert rel_l2(embed(buf.getvalue(), "image/png")[0], as_u8[1]) < SAME_PIXELS_TOL


def test_decode_several_gives_zip_in_batch_order(live_server):
    u, lat = live_server.url, latents(n=3, h=6, w=5)
    ref = from_npy(post_decode(u, npy(lat), format="npy").content)
    assert ref.shape == (3, 48, 40, 3)
    r = post_decode(u, npy(lat))
    assert r.headers["content-type"] == "application/zip"
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert zf.namelist() == ["image_000.png", "image_001.png", "image_002.png"]
        for i, name in enumerate(zf.namelist()):
            expect = np.clip(ref[i] * 255 + 0.5, 0, 255).astype(np.int16)
            assert np.abs(png_rgb(zf.read(name)) - expect).max() <= 1
    # a row decoded alone equals the same row decoded in a batch
    one = from_npy(post_decode(u, npy(lat[1:2]), format="npy").content)
    np.testing.assert_allclose(one[0], ref[1], atol=2e-5)


def _safetensors(arr: np.ndarray, name="latents", dtype="F32", raw: bytes | None = None) -> bytes:
    raw = arr.tobytes() if raw is None else raw
    header = json.dumps({name: {"dtype": dtype, "shape": list(arr.shape), "data_offsets": [0, len(raw)]}}).encode()
    return len(header).to_bytes(8, "little") + header + raw


def test_decode_input_encodings(live_server):
    """npy, safetensors (also written by the safetensors library), JSON+base64, fp16 and bf16."""
    st_np = pytest.importorskip("safetensors.numpy")
    u, lat = live_server.url, latents(h=4, w=9)
    ref = from_npy(post_decode(u, npy(lat), format="npy").content)

    def ask(body, ctype):
        r = post_decode(u, body, headers={"content-type": ctype}, format="npy")
        assert r.status_code == 200, r.text
        return from_npy(r.content)

    np.testing.assert_allclose(ask(st_np.save({"latents": lat}), "application/vnd.safetensors"), ref, atol=1e-6)
    np.testing.assert_allclose(ask(_safetensors(lat, "x"), "application/octet-stream"), ref, atol=1e-6)
    js = json.dumps({"data": base64.b64encode(lat.tobytes()).decode(), "shape": list(lat.shape), "dtype": "float32"})
    np.testing.assert_allclose(ask(js.encode(), "application/json"), ref, atol=1e-6)
    half = lat.astype(np.float16)
    js16 = json.dumps({"data": base64.b64encode(half.tobytes()).decode(), "shape": list(lat.shape), "dtype": "float16"})
    ref16 = from_npy(post_decode(u, npy(half.astype(np.float32)), format="npy").content)
    np.testing.assert_allclose(ask(js16.encode(), "application/json"), ref16, atol=1e-6)
    np.testing.assert_allclose(ask(npy(half), "application/x-npy"), ref16, atol=1e-6)
    # bf16: the top 16 bits of the fp32 pattern (torch makes the reference rounding)
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(lat).to(torch.bfloat16)
    bf_bits = t.view(torch.int16).numpy().tobytes()
    ref_bf = from_npy(post_decode(u, npy(t.to(torch.float32).numpy()), format="npy").content)
    np.testing.assert_allclose(ask(_safetensors(lat, dtype="BF16", raw=bf_bits), "application/vnd.safetensors"),
                               ref_bf, atol=1e-6)
    jsbf = json.dumps({"data": base64.b64encode(bf_bits).decode(), "shape": list(lat.shape), "dtype": "bfloat16"})
    np.testing.assert_allclose(ask(jsbf.encode(), "application/json"), ref_bf, atol=1e-6)


def test_decode_video_mp4_and_npy(live_server):
    av = pytest.importorskip("av")
    u = live_server.url
    lat = rng().standard_normal((1, 4, 2, 5, 6)).astype(np.float32)
    frames = from_npy(post_decode(u, npy(lat), model="tiny-wan-vae", format="npy").content)
    assert frames.shape == (1, 5, 40, 48, 3) and frames.dtype == np.float32
    r = post_decode(u, npy(lat), model="tiny-wan-vae", fps=8)
    assert r.status_code == 200 and r.headers["content-type"] == "video/mp4"
    with av.open(io.BytesIO(r.content)) as c:
        stream = c.streams.video[0]
        assert stream.codec_context.name == "h264"
        got = np.stack([f.to_ndarray(format="rgb24") for f in c.decode(video=0)]).astype(np.int16)
    assert got.shape == (5, 40, 48, 3)
    expect = np.clip(frames[0] * 255 + 0.5, 0, 255).astype(np.int16)
    assert np.abs(got - expect).mean() < 20  # H.264 + yuv420p chroma subsampling is lossy
    two = np.concatenate([lat, lat])
    r = post_decode(u, npy(two), model="tiny-wan-vae")
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        assert zf.namelist() == ["video_000.mp4", "video_001.mp4"]
    r = post_decode(u, npy(lat), model="tiny-wan-vae", format="png")
    assert r.status_code == 422 and r.json()["type"].endswith("#bad-format")


def _png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def _float_texts(body: bytes) -> list[bytes]:
    """The numbers of the first embedding, as the text the body holds."""
    start = body.index(b'"embeddings":[[') + len(b'"embeddings":[[')
    return body[start:body.index(b"]", start)].split(b",")


def _digits(text: bytes) -> tuple[str, str, int]:
    """A number's sign, significant digits and decimal exponent, whatever its notation."""
    sign, digits, exp = Decimal(text.decode()).as_tuple()
    d = "".join(map(str, digits)).rstrip("0")
    return str(sign), d, exp + len(digits)


def _encode(url, **kw):
    return httpx.post(f"{url}/v1/models/tiny-convnext/encode", timeout=60, **kw)


def test_encode_formats_agree(live_server):
    u = live_server.url
    size = httpx.get(f"{u}/v1/models/tiny-convnext").json()["inputs"][0]["resized_to"][0]
    pics = rng().integers(0, 256, (3, size, size, 3), dtype=np.uint8)
    r = _encode(u, content=_png(pics[0]), headers={"content-type": "image/png"})
    one = r.json()
    assert one["model"] == "tiny-convnext" and len(one["embeddings"]) == 1
    # compact JSON, each float the shortest text that reads back to the float32's value in float64:
    # the digits json.dumps writes (msgspec writes the body; its notation may differ, 0.0000272 for
    # 2.72e-05, so the text is compared number by number as digits, not as one string)
    assert r.headers["content-type"] == "application/json"
    assert b" " not in r.content
    ours = _float_texts(r.content)
    theirs = _float_texts(json.dumps(one, separators=(",", ":")).encode())
    assert len(ours) == len(theirs) == one["embedding_dim"]
    assert [_digits(t) for t in ours] == [_digits(t) for t in theirs]
    assert all(np.float32(v) == v for v in one["embeddings"][0])
    emb0 = np.asarray(one["embeddings"][0])
    assert emb0.shape == (one["embedding_dim"],) and np.isfinite(emb0).all()
    # the same pixels as .npy (uint8 and float in [0,1]) give the same embedding
    for body in (npy(pics[:1]), npy(pics[:1].astype(np.float32) / 255)):
        e = np.asarray(_encode(u, content=body, headers=NPY).json()["embeddings"][0])
        assert rel_l2(e, emb0) < SAME_PIXELS_TOL
    # several files in one multipart request, in order; npy output
    files = [("files", (f"{i}.png", _png(p), "image/png")) for i, p in enumerate(pics)]
    multi = np.asarray(_encode(u, files=files).json()["embeddings"])
    assert multi.shape == (3, emb0.shape[0])
    assert rel_l2(multi[0], emb0) < SAME_PIXELS_TOL
    r = _encode(u, files=files, params={"format": "npy"})
    assert r.headers["content-type"] == "application/x-npy"
    assert rel_l2(from_npy(r.content), multi) < SAME_PIXELS_TOL
    # lossy formats and other sizes still encode (resized and centre-cropped to the input size)
    big = rng().integers(0, 256, (size * 2 + 3, size + 11, 3), dtype=np.uint8)
    for fmt, mime in (("JPEG", "image/jpeg"), ("WEBP", "image/webp")):
        buf = io.BytesIO()
        Image.fromarray(big).save(buf, format=fmt)
        r = _encode(u, content=buf.getvalue(), headers={"content-type": mime})
        assert r.status_code == 200 and len(r.json()["embeddings"][0]) == emb0.shape[0]


def test_encode_top_k_matches_torch_softmax(live_server):
    torch = pytest.importorskip("torch")
    u = live_server.url
    size = 64
    pics = rng().random((2, size, size, 3), dtype=np.float32)
    doc = _encode(u, content=npy(pics), headers=NPY, params={"top_k": 3}).json()
    # logits through KServe, on the same pixels; torch ranks them
    body = {"inputs": [{"name": "pixels", "datatype": "FP32", "shape": list(pics.shape),
                        "data": pics.ravel().tolist()}]}
    out = httpx.post(f"{u}/v2/models/tiny-convnext/infer", json=body, timeout=60).json()
    logits = next(o for o in out["outputs"] if o["name"] == "logits")
    lt = torch.tensor(logits["data"], dtype=torch.float64).reshape(logits["shape"])
    probs, idx = torch.softmax(lt, dim=1).topk(3, dim=1)
    for row, (p, i) in enumerate(zip(probs.tolist(), idx.tolist())):
        got = doc["top_k"][row]
        assert [g["index"] for g in got] == i
        np.testing.assert_allclose([g["score"] for g in got], p, rtol=1e-5)


def test_metrics_count_requests_batches_and_kernel_paths(live_server):
    u = live_server.url
    lat = latents(h=3, w=4)
    post_decode(u, npy(lat), format="npy")  # memoise this shape's paths
    s0 = scrape(u)
    post_decode(u, npy(lat), format="npy")
    s1 = scrape(u)
    per_call = metric_sum(s1, "convkernels_conv_total", backend="numpy") - metric_sum(s0, "convkernels_conv_total", backend="numpy")
    assert per_call > 0
    n = 3
    for _ in range(n):  # sequential: one batch each
        assert post_decode(u, npy(lat), format="npy").status_code == 200
    bad = post_decode(u, npy(lat[:, :3]), format="npy")
    assert bad.status_code == 422
    s2 = scrape(u)
    key = dict(model="tiny-vae", endpoint="decode")
    assert metric(s2, "convserve_requests_total", status=200, **key) - metric(s1, "convserve_requests_total", status=200, **key) == n
    assert metric(s2, "convserve_requests_total", status=422, **key) - metric(s1, "convserve_requests_total", status=422, **key) == 1
    assert metric(s2, "convserve_request_seconds_count", **key) - metric(s1, "convserve_request_seconds_count", **key) == n + 1
    assert metric(s2, "convserve_batch_size_count", model="tiny-vae") - metric(s1, "convserve_batch_size_count", model="tiny-vae") == n
    assert metric(s2, "convserve_batch_size_sum", model="tiny-vae") - metric(s1, "convserve_batch_size_sum", model="tiny-vae") == n
    assert metric(s2, "convserve_queue_wait_seconds_count", model="tiny-vae") - metric(s1, "convserve_queue_wait_seconds_count", model="tiny-vae") == n
    conv = metric_sum(s2, "convkernels_conv_total", backend="numpy") - metric_sum(s1, "convkernels_conv_total", backend="numpy")
    assert conv == n * per_call
    # every counted path has timings too (the worker flushes them after each batch)
    paths = {dict(lab)["path"] for (name, lab) in s2 if name == "convkernels_conv_total"}
    for p in paths:
        assert metric_sum(s2, "convkernels_conv_seconds_count", backend="numpy", path=p) > 0
    assert metric(s2, "convserve_model_load_seconds", model="tiny-vae") > 0
    assert metric(s2, "convserve_model_warmup_seconds", model="tiny-vae") > 0
    assert metric(s2, "convserve_inflight_requests", model="tiny-vae") == 0
