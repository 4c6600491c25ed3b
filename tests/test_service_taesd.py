"""A TAESD preset served by a real convserve (`server_factory`), with diffusers AutoencoderTiny
random weights (non-trivial scaling and shift in config.json) as the reference: REST /decode,
KServe v2 infer through tritonclient, and diffusers' own remote VAE client (an image VAE encodes
through /vae/encode; /v1 .../encode is the image encoders' route)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

import test_models_taesd as ref
from live_server import from_npy, npy

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
from diffusers.utils.remote_utils import remote_decode, remote_encode  # noqa: E402

TOL = ref.TOL
NPY = {"content-type": "application/x-npy"}


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    """(server, reference AutoencoderTiny): tiny-taesd served with the reference's weights."""
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae = ref.make_tiny(ref.SMALL, seed)
    folder = tmp_path_factory.mktemp("taesd")
    vae.save_pretrained(folder)
    return server_factory(models=f"taesd=tiny-taesd:{folder}", max_batch=4), vae


def latents(n=2, h=5, w=7):
    return np.random.default_rng().standard_normal((n, 4, h, w)).astype(np.float32)


def test_card_names_the_architecture_and_scaling(served):
    server, _ = served
    card = httpx.get(f"{server.url}/v1/models/taesd", timeout=30).json()
    assert card["architecture"].startswith("diffusers AutoencoderTiny") and card["preset"] == "tiny-taesd"
    assert (card["scaling_factor"], card["shift_factor"], card["has_encoder"]) == (0.7, 0.15, True)


def test_rest_decode(served):
    server, vae = served
    lat = latents()
    r = httpx.post(f"{server.url}/v1/models/taesd/decode", content=npy(lat), headers=NPY,
                   params={"format": "npy"}, timeout=60)
    assert r.status_code == 200, r.text
    out = from_npy(r.content)
    assert out.shape == (2, 40, 56, 3)
    assert ref.rel_l2(out, ref.reference_decode(vae, lat)) < TOL


def test_kserve_v2_infer(served):
    httpclient = pytest.importorskip("tritonclient.http")
    server, vae = served
    lat = latents(h=3, w=6)
    client = httpclient.InferenceServerClient(server.url.removeprefix("http://"), network_timeout=60)
    try:
        inp = httpclient.InferInput("latents", list(lat.shape), "FP32")
        inp.set_data_from_numpy(lat, binary_data=True)
        images = client.infer("taesd", [inp]).as_numpy("images")
    finally:
        client.close()
    assert images.shape == (2, 24, 48, 3)
    assert ref.rel_l2(images, ref.reference_decode(vae, lat)) < TOL


def test_remote_vae_decode_and_encode_with_diffusers_client(served):
    """remote_decode's `pt` output is AutoencoderTiny.decode(latents / scale + shift).sample."""
    server, vae = served
    lat = torch.from_numpy(latents(h=5, w=3))
    cfg = vae.config
    out = remote_decode(f"{server.url}/v1/models/taesd/vae/decode", lat, scaling_factor=cfg.scaling_factor,
                        shift_factor=cfg.shift_factor, output_type="pt", return_type="pt")
    with torch.no_grad():
        sample = vae.decode(lat / cfg.scaling_factor + cfg.shift_factor).sample
    assert tuple(out.shape) == (2, 3, 40, 24)
    assert ref.rel_l2(out, sample) < TOL
    x = torch.rand(1, 3, 40, 32) * 2 - 1
    enc = remote_encode(f"{server.url}/v1/models/taesd/vae/encode", x, scaling_factor=cfg.scaling_factor,
                        shift_factor=cfg.shift_factor)
    with torch.no_grad():
        want = (vae.encode(x).latents - cfg.shift_factor) * cfg.scaling_factor
    assert ref.rel_l2(enc, want) < TOL
    # sides not a multiple of 8: the service's floored shape, diffusers' latents up to there
    x = torch.rand(2, 3, 44, 30) * 2 - 1
    enc = remote_encode(f"{server.url}/v1/models/taesd/vae/encode", x)
    with torch.no_grad():
        want = vae.encode(x).latents[:, :, :5, :3]
    assert tuple(enc.shape) == (2, 4, 5, 3) and ref.rel_l2(enc, want) < TOL
