"""The HunyuanVideo 1.5 VAE decoder served by a real uvicorn convserve (its tiny preset from a diffusers
folder through the MODELS setting): the card, /v1 REST decode of a batch of 2, KServe v2 infer, the
streamed decode (.npy stream: its frame groups as they are done) and diffusers' own remote VAE client
(`remote_decode`), each against diffusers' AutoencoderKLHunyuanVideo15 + the pipeline's latent scaling
with the same random weights (one sample at a time: diffusers' decode fails for a batch of 2)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import test_models_hunyuanvideo15_vae as ref  # noqa: E402
from live_server import from_npy, npy  # noqa: E402
from test_streaming import read_records, stream  # noqa: E402

NPY = {"content-type": "application/x-npy"}
MODEL, TOL, C = "hv", ref.TOL, ref.C


class Served:
    def __init__(self, base: str, vae):
        self.base, self.vae = base, vae

    def reference(self, lat: np.ndarray, **kw) -> np.ndarray:
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # the server has the other core
        try:
            return ref.pipeline_decode(self.vae, lat, **kw)
        finally:
            torch.set_num_threads(before)

    def decode(self, lat: np.ndarray) -> httpx.Response:
        return httpx.post(f"{self.base}/v1/models/{MODEL}/decode", content=npy(lat), headers=NPY,
                          params={"format": "npy"}, timeout=120)


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae = ref.make_vae(ref.TINY, seed)
    folder = tmp_path_factory.mktemp("hunyuanvideo15_vae")
    vae.save_pretrained(folder)
    live = server_factory(models=f"{MODEL}=tiny-hunyuanvideo1.5-vae:{folder}", max_batch=4)
    return Served(live.url, vae)


def latents(*shape) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def test_card_and_rest_decode_of_a_batch(served):
    card = httpx.get(f"{served.base}/v1/models/{MODEL}", timeout=30).json()
    assert card["kind"] == "video-decoder" and card["latent_channels"] == C and card["has_encoder"] is False
    assert (card["spatial_factor"], card["temporal_factor"], card["scaling_factor"]) == (8, 4, 1.03682)
    lat = latents(2, C, 2, 3, 5)
    r = served.decode(lat)
    assert r.status_code == 200, r.text
    got = from_npy(r.content)
    assert got.shape == (2, 5, 24, 40, 3)
    err = ref.rel_l2(got, served.reference(lat))
    print(f"REST decode vs diffusers rel L2 {err:.2e}")
    assert err < TOL


def test_kserve_v2_infer(served):
    lat = latents(1, C, 2, 3, 2)
    doc = {"inputs": [{"name": "latents", "datatype": "FP32", "shape": list(lat.shape),
                       "data": lat.reshape(-1).tolist()}]}
    r = httpx.post(f"{served.base}/v2/models/{MODEL}/infer", json=doc, timeout=120)
    assert r.status_code == 200, r.text[:400]
    out = r.json()["outputs"][0]
    assert out["name"] == "frames" and out["shape"] == [1, 5, 24, 16, 3]
    got = np.asarray(out["data"], np.float32).reshape(out["shape"])
    assert ref.rel_l2(got, served.reference(lat)) < TOL


def test_npy_stream_matches_rest_decode_and_diffusers(served):
    lat = latents(1, C, 4, 3, 2)
    r, chunks, _ = stream(f"{served.base}/v1/models/{MODEL}/decode/stream", lat, format="npy")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy-stream"
    assert r.headers["x-output-shape"] == "1,13,24,16,3" and r.headers["x-frame-groups"] == "4"
    groups, ended = read_records(b"".join(c for _, c in chunks))
    assert ended and [g.shape[1] for g in groups] == [1, 4, 4, 4]
    got = np.concatenate(groups, axis=1)
    assert np.array_equal(got, from_npy(served.decode(lat).content)), "stream differs from /decode"
    err = ref.rel_l2(got, served.reference(lat))
    print(f"stream vs diffusers rel L2 {err:.2e}")
    assert err < TOL


def test_remote_decode_raw_sample(served):
    """diffusers' remote VAE client: de-scaled latents (do_scaling=False) -> a raw `pt` answer equal to
    vae.decode(...).sample clamped to [-1, 1] (the served frames are clipped to [0, 1])."""
    pytest.importorskip("requests")
    from diffusers.utils.remote_utils import remote_decode

    z = torch.from_numpy(latents(1, C, 2, 3, 4))
    with torch.no_grad():
        sample = served.vae.decode(z).sample.clamp(-1, 1)
    out = remote_decode(f"{served.base}/v1/models/{MODEL}/vae/decode", z, do_scaling=False, output_type="pt",
                        return_type="pt")
    assert tuple(out.shape) == (1, 3, 5, 24, 32)
    err = ref.rel_l2(out.numpy(), sample.numpy())
    print(f"remote_decode vs diffusers rel L2 {err:.2e}")
    assert err < TOL


def test_latents_of_the_wrong_shape_are_a_422_and_the_server_stays_up(served):
    r = served.decode(latents(1, C + 1, 2, 3, 3))
    assert r.status_code == 422 and r.headers["content-type"].startswith("application/problem+json"), r.text[:300]
    assert "\n" not in r.json()["detail"]
    assert served.decode(latents(1, C, 1, 2, 2)).status_code == 200
