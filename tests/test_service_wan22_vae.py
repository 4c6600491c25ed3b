"""The Wan 2.2 VAE decoder served by a real uvicorn convserve: the card, /v1 REST decode and the
streamed decode (.npy stream), each against diffusers' AutoencoderKLWan(is_residual=True,
patch_size=2) + the Wan 2.2 pipeline's de-normalisation with the same random weights. Its encoder,
served through remote_encode, is tests/test_service_wan22_vae_encode.py's."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import test_models_wan22_vae as ref  # noqa: E402
from live_server import from_npy, npy  # noqa: E402
from test_streaming import read_records, stream  # noqa: E402

NPY = {"content-type": "application/x-npy"}
MODEL = "wan22"
TOL = 1e-4  # rel L2, fp32


class Served:
    def __init__(self, base: str, vae, config: dict):
        self.base, self.vae, self.config = base, vae, config

    def reference(self, lat: np.ndarray) -> np.ndarray:
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # the server has the other core
        try:
            return ref.reference_decode(self.vae, self.config, lat)
        finally:
            torch.set_num_threads(before)


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae, folder, config = ref.make_reference(tmp_path_factory.mktemp("wan22_vae"), ref.WAN22_SMALL, seed)
    live = server_factory(models=f"{MODEL}=tiny-wan2.2-vae:{folder}")
    return Served(live.url, vae, config)


def latents(*shape) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def test_card_and_rest_decode(served):
    card = httpx.get(f"{served.base}/v1/models/{MODEL}", timeout=30).json()
    assert card["kind"] == "video-decoder" and card["latent_channels"] == 12
    assert (card["spatial_factor"], card["temporal_factor"]) == (16, 4)
    # the checkpoint holds the encoder: served by remote_encode (tests/test_service_wan22_vae_encode.py)
    assert card["has_encoder"] is True
    lat = latents(2, 12, 3, 3, 5)
    r = httpx.post(f"{served.base}/v1/models/{MODEL}/decode", content=npy(lat), headers=NPY,
                   params={"format": "npy"}, timeout=120)
    assert r.status_code == 200, r.text
    got = from_npy(r.content)
    assert got.shape == (2, 9, 48, 80, 3)
    err = ref.rel_l2(got, served.reference(lat))
    print(f"REST decode vs diffusers rel L2 {err:.2e}")
    assert err < TOL


def test_npy_stream_matches_rest_decode_and_diffusers(served):
    lat = latents(1, 12, 4, 3, 4)
    r, chunks, _ = stream(f"{served.base}/v1/models/{MODEL}/decode/stream", lat, format="npy")
    assert r.status_code == 200 and r.headers["content-type"] == "application/x-npy-stream"
    assert r.headers["x-output-shape"] == "1,13,48,64,3" and r.headers["x-frame-groups"] == "4"
    groups, ended = read_records(b"".join(c for _, c in chunks))
    assert ended and [g.shape[1] for g in groups] == [1, 4, 4, 4]
    got = np.concatenate(groups, axis=1)
    whole = from_npy(httpx.post(f"{served.base}/v1/models/{MODEL}/decode", content=npy(lat), headers=NPY,
                                params={"format": "npy"}, timeout=120).content)
    assert np.array_equal(got, whole), "stream differs from /decode"
    err = ref.rel_l2(got, served.reference(lat))
    print(f"stream vs diffusers rel L2 {err:.2e}")
    assert err < TOL


def test_remote_decode_raw_sample(served):
    """diffusers' remote VAE client: de-normalised latents (do_scaling=False) -> a raw `pt` answer equal
    to vae.decode(...).sample, clamped to [-1, 1] and unpatchified as diffusers does."""
    pytest.importorskip("requests")
    from diffusers.utils.remote_utils import remote_decode

    lat = torch.from_numpy(latents(1, 12, 2, 3, 4))
    mean = torch.tensor(served.config["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(served.config["latents_std"]).view(1, -1, 1, 1, 1)
    z = lat / (1.0 / std) + mean
    with torch.no_grad():
        sample = served.vae.decode(z).sample  # 1,3,5,48,64 in [-1, 1]
    out = remote_decode(f"{served.base}/v1/models/{MODEL}/vae/decode", z, do_scaling=False, output_type="pt",
                        return_type="pt")
    assert tuple(out.shape) == (1, 3, 5, 48, 64)
    err = ref.rel_l2(out.numpy(), sample.numpy())
    print(f"remote_decode vs diffusers rel L2 {err:.2e}")
    assert err < TOL
