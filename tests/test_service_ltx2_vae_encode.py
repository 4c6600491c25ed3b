"""The LTX-2 VAE's encoder served by a real uvicorn convserve through diffusers' remote_encode route
(/v1/models/{name}/vae/encode), as the Wan 2.2 VAE's is: a .npy batch of clips and a PNG (one frame,
what the image-to-video pipeline encodes), with do_scaling=True (the pipeline's normalised latents)
and with no factors (the bare posterior mean), against diffusers' AutoencoderKLLTX2Video.encode + the
pipeline's normalisation with the same random weights; then the refusals (frame count, sides),
after which the server still answers."""
from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
Image = pytest.importorskip("PIL.Image")

import test_models_ltx2_vae as ref  # noqa: E402
from live_server import npy  # noqa: E402
from test_models_ltx2_vae_encoder import pipeline_encode  # noqa: E402

NPY = {"content-type": "application/x-npy"}
MODEL, TOL, C = "ltx", ref.TOL, ref.TINY["latent_channels"]


class Served:
    def __init__(self, base: str, vae):
        self.base, self.vae = base, vae
        self.url = f"{base}/v1/models/{MODEL}/vae/encode"

    def reference(self, video01: np.ndarray, normalise: bool = True) -> np.ndarray:
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # the server has the other core
        try:
            return pipeline_encode(self.vae, video01, normalise)
        finally:
            torch.set_num_threads(before)

    def post(self, body: bytes, headers: dict | None = None, **params) -> httpx.Response:
        return httpx.post(self.url, content=body, headers=headers or {}, params=params, timeout=120)


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae = ref.make_vae(ref.TINY, seed)
    folder = tmp_path_factory.mktemp("ltx2_vae_enc")
    vae.save_pretrained(folder)
    live = server_factory(models=f"{MODEL}=tiny-ltx2-vae:{folder}", max_batch=4)
    return Served(live.url, vae)


def latents_of(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "tensor/binary" and r.headers["dtype"] == "float32"
    return np.frombuffer(r.content, "<f4").reshape(json.loads(r.headers["shape"]))


def check(label: str, got: np.ndarray, want: np.ndarray) -> None:
    err = ref.rel_l2(got, want)
    print(f"{label}: rel L2 {err:.2e}")
    assert err < TOL, f"{label}: rel L2 {err:.2e}"


def test_card_says_it_encodes(served):
    card = httpx.get(f"{served.base}/v1/models/{MODEL}", timeout=30).json()
    assert card["has_encoder"] and "latents_std" in card["encode"]


def test_npy_clips_and_a_png(served):
    rng = np.random.default_rng()
    clips = rng.random((2, 9, 64, 96, 3), dtype=np.float32)  # float in [0, 1], channels last, a batch of 2
    got = latents_of(served.post(npy(clips), NPY, do_scaling=True))
    assert got.shape == (2, C, 2, 2, 3)
    check(".npy clips N=2 F=9, normalised (do_scaling)", got, served.reference(clips))
    raw = latents_of(served.post(npy(clips), NPY))  # no factors: the bare posterior mean
    check(".npy clips N=2 F=9, unscaled mean", raw, served.reference(clips, normalise=False))
    assert ref.rel_l2(got, raw) > 100 * TOL, "the normalisation changes nothing: the comparison proves nothing"
    rgb = rng.integers(0, 256, (32, 96, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    got = latents_of(served.post(buf.getvalue(), {"content-type": "image/png"}, do_scaling=True))
    assert got.shape == (1, C, 1, 1, 3)
    check("PNG as one frame, normalised", got, served.reference((rgb.astype(np.float32) / 255)[None, None]))


@pytest.mark.parametrize("shape, kind", [((1, 5, 32, 32, 3), "bad-frame-count"), ((1, 2, 32, 32, 3), "bad-frame-count"),
                                         ((1, 1, 48, 32, 3), "bad-frame-size")], ids=["F=5", "F=2", "side 48"])
def test_bad_clips_are_refused_and_the_server_stays_healthy(served, shape, kind):
    r = served.post(npy(np.zeros(shape, np.float32)), NPY)
    assert r.status_code == 422 and r.json()["type"].endswith(kind), r.text
    assert httpx.get(f"{served.base}/readyz", timeout=10).status_code == 200
    assert latents_of(served.post(npy(np.zeros((1, 1, 32, 32, 3), np.uint8)), NPY)).shape == (1, C, 1, 1, 1)
