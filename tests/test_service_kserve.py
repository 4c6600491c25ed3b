"""KServe v2 through the real tritonclient.http client (JSON and binary tensor data), against a
real uvicorn server; results must equal the /v1 path's for the same inputs."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

from live_server import from_npy, npy

httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402


@pytest.fixture(scope="module")
def client(live_server):
    c = httpclient.InferenceServerClient(live_server.url.removeprefix("http://"), network_timeout=60)
    yield c
    c.close()


def v1_decode(url, lat, model="tiny-vae"):
    r = httpx.post(f"{url}/v1/models/{model}/decode", content=npy(lat), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    return from_npy(r.content)


def test_health_and_metadata(client):
    assert client.is_server_live() and client.is_server_ready()
    assert client.is_model_ready("tiny-vae") and not client.is_model_ready("nope")
    meta = client.get_model_metadata("tiny-vae")
    assert meta["name"] == "tiny-vae" and meta["versions"] == ["1"]
    assert meta["inputs"] == [{"name": "latents", "datatype": "FP32", "shape": [-1, 4, -1, -1]}]
    assert meta["outputs"] == [{"name": "images", "datatype": "FP32", "shape": [-1, -1, -1, 3]}]
    enc = client.get_model_metadata("tiny-convnext")
    assert enc["inputs"][0]["name"] == "pixels" and {o["name"] for o in enc["outputs"]} == {"embedding", "logits"}
    assert client.get_model_metadata("tiny-wan-vae")["outputs"][0]["name"] == "frames"
    assert client.get_server_metadata()["name"] == "convserve"


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
@pytest.mark.parametrize("dtype", ["FP32", "FP16"])
def test_decode_infer(client, live_server, binary, dtype):
    rng = np.random.default_rng()
    lat = rng.standard_normal((2, 4, 5, 3)).astype(np.float32 if dtype == "FP32" else np.float16)
    inp = httpclient.InferInput("latents", list(lat.shape), dtype)
    inp.set_data_from_numpy(lat, binary_data=binary)
    out = httpclient.InferRequestedOutput("images", binary_data=binary)
    res = client.infer("tiny-vae", [inp], outputs=[out], request_id="r1")
    images = res.as_numpy("images")
    assert images.dtype == np.float32 and images.shape == (2, 40, 24, 3)
    assert res.get_response()["id"] == "r1"
    np.testing.assert_allclose(images, v1_decode(live_server.url, lat.astype(np.float32)), atol=2e-5)


def test_default_outputs_are_binary(client, live_server):
    rng = np.random.default_rng()
    lat = rng.standard_normal((1, 4, 2, 3, 4)).astype(np.float32)
    inp = httpclient.InferInput("latents", list(lat.shape), "FP32")
    inp.set_data_from_numpy(lat)
    res = client.infer("tiny-wan-vae", [inp])  # no outputs named: all come back binary
    assert res.get_output("frames")["parameters"]["binary_data_size"] == 5 * 24 * 32 * 3 * 4
    np.testing.assert_allclose(res.as_numpy("frames"), v1_decode(live_server.url, lat, "tiny-wan-vae"), atol=2e-5)


@pytest.mark.parametrize("binary", [False, True], ids=["json", "binary"])
def test_encode_infer(client, live_server, binary):
    rng = np.random.default_rng()
    px = rng.random((3, 64, 64, 3), dtype=np.float32)
    inp = httpclient.InferInput("pixels", list(px.shape), "FP32")
    inp.set_data_from_numpy(px, binary_data=binary)
    res = client.infer("tiny-convnext", [inp], outputs=[httpclient.InferRequestedOutput("embedding", binary_data=binary),
                                                        httpclient.InferRequestedOutput("logits", binary_data=binary)])
    emb, logits = res.as_numpy("embedding"), res.as_numpy("logits")
    assert emb.shape[0] == 3 and logits.shape[0] == 3
    r = httpx.post(f"{live_server.url}/v1/models/tiny-convnext/encode", content=npy(px),
                   headers={"content-type": "application/x-npy"}, timeout=60)
    np.testing.assert_allclose(emb, np.asarray(r.json()["embeddings"]), rtol=1e-5, atol=1e-6)
    # UINT8 pixels of another size are resized like /v1 images
    u8 = rng.integers(0, 256, (1, 70, 90, 3), dtype=np.uint8)
    inp = httpclient.InferInput("pixels", list(u8.shape), "UINT8")
    inp.set_data_from_numpy(u8, binary_data=binary)
    assert client.infer("tiny-convnext", [inp]).as_numpy("embedding").shape == (1, emb.shape[1])


def test_errors_reach_the_client(client):
    lat = np.zeros((1, 3, 4, 4), np.float32)  # wrong channel count
    inp = httpclient.InferInput("latents", list(lat.shape), "FP32")
    inp.set_data_from_numpy(lat)
    with pytest.raises(InferenceServerException, match="4 latent channels"):
        client.infer("tiny-vae", [inp])
    inp = httpclient.InferInput("wrong", [1, 4, 4, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4, 4, 4), np.float32))
    with pytest.raises(InferenceServerException, match="latents"):
        client.infer("tiny-vae", [inp])
    inp = httpclient.InferInput("latents", [1, 4, 4, 4], "FP32")
    inp.set_data_from_numpy(np.zeros((1, 4, 4, 4), np.float32))
    with pytest.raises(InferenceServerException, match="no model named"):
        client.infer("nope", [inp])
