"""SANA's DC-AE served by a real uvicorn convserve (its tiny preset from a diffusers folder through the
MODELS setting): the card, /v1 REST decode, KServe v2 infer and diffusers' own remote VAE client
(`remote_decode`, `remote_encode`), each against diffusers' AutoencoderDC + the SANA pipeline's
latent scaling with the same random weights."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("requests")

import test_models_dc_ae as ref  # noqa: E402
from diffusers.utils.remote_utils import remote_decode, remote_encode  # noqa: E402
from live_server import from_npy, npy  # noqa: E402
from PIL import Image  # noqa: E402

TOL = ref.TOL
CHANNELS, FACTOR = ref.TINY["latent_channels"], 2 ** (len(ref.TINY["decoder_block_out_channels"]) - 1)


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae = ref.make_vae(ref.TINY, seed)
    folder = tmp_path_factory.mktemp("dc_ae")
    vae.save_pretrained(folder)
    live = server_factory(models=f"dc=tiny-dc-ae:{folder}", max_batch=4)
    return live.url, vae


def test_card_rest_decode_and_kserve_infer(served):
    base, vae = served
    card = httpx.get(f"{base}/v1/models/dc", timeout=30).json()
    assert (card["latent_channels"], card["spatial_factor"], card["has_encoder"]) == (CHANNELS, FACTOR, True)
    assert card["scaling_factor"] == pytest.approx(0.41407)
    x = np.random.default_rng().standard_normal((2, CHANNELS, 5, 3)).astype(np.float32)
    expected = ref.pipeline_decode(vae, x)
    r = httpx.post(f"{base}/v1/models/dc/decode", content=npy(x), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    ours = from_npy(r.content)
    assert ours.shape == (2, 5 * FACTOR, 3 * FACTOR, 3)
    assert ref.rel_l2(ours, expected) < TOL
    doc = {"inputs": [{"name": "latents", "datatype": "FP32", "shape": list(x.shape), "data": x.reshape(-1).tolist()}]}
    r = httpx.post(f"{base}/v2/models/dc/infer", json=doc, timeout=60)
    assert r.status_code == 200, r.text[:400]
    out = r.json()["outputs"][0]
    assert ref.rel_l2(np.asarray(out["data"], np.float32).reshape(out["shape"]), expected) < TOL


def test_remote_decode_and_encode(served):
    base, vae = served
    x = torch.randn(1, CHANNELS, 3, 4)
    out = remote_decode(f"{base}/v1/models/dc/vae/decode", x, do_scaling=False, output_type="pt", return_type="pt")
    with torch.no_grad():  # no factors sent: the latents are unscaled, the server undoes the model's scaling
        sample = vae.decode(x).sample
    assert ref.rel_l2(out, sample) < TOL
    rgb = np.random.default_rng().integers(0, 256, (4 * FACTOR, 6 * FACTOR, 3), dtype=np.uint8)
    lat = remote_encode(f"{base}/v1/models/dc/vae/encode", Image.fromarray(rgb))
    # no factors asked: the unscaled latent
    expected = ref.pipeline_encode(vae, (rgb.astype(np.float32) / 255.0)[None], scale=False)
    assert tuple(lat.shape) == (1, CHANNELS, 4, 6)
    assert ref.rel_l2(lat, expected) < TOL


def test_bad_latents_and_images_are_refused_and_the_server_stays_up(served):
    base, _ = served
    x = np.zeros((1, CHANNELS + 1, 3, 3), np.float32)
    r = httpx.post(f"{base}/v1/models/dc/decode", content=npy(x), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert 400 <= r.status_code < 500 and "\n" not in r.json()["detail"].strip(), r.text
    with pytest.raises(RuntimeError, match=f"multiples of {FACTOR}") as e:
        remote_encode(f"{base}/v1/models/dc/vae/encode", Image.new("RGB", (4 * FACTOR + 2, 4 * FACTOR)))
    assert "'status': 422" in str(e.value)  # the model's refusal, answered as bad input
    assert httpx.get(f"{base}/v1/models/dc", timeout=30).status_code == 200
