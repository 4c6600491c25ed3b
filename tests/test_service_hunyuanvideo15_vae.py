"""The HunyuanVideo 1.5 VAE decoder served by a real uvicorn convserve (its tiny preset from a diffusers
folder through the MODELS setting): the card, /v1 REST decode of a batch of 2, KServe v2 infer, the
streamed decode (.npy stream: its frame groups as they are done) and diffusers' own remote VAE client
(`remote_decode`), each against diffusers' AutoencoderKLHunyuanVideo15 + the pipeline's latent scaling
with the same random weights (one sample at a time: diffusers' decode fails for a batch of 2); then the
encoder through diffusers' remote_encode route (.npy clips, a PNG frame, diffusers' own client) against
the image-to-video pipeline's encode step, and its refusals."""
from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")

import test_models_hunyuanvideo15_vae as ref  # noqa: E402
from live_server import from_npy, npy  # noqa: E402
from test_models_hunyuanvideo15_vae_encoder import pipeline_encode  # noqa: E402
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
    assert card["kind"] == "video-decoder" and card["latent_channels"] == C and card["has_encoder"] is True
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


# ---- the encoder (diffusers' remote_encode route) ------------------------------------------------------
def encode(served, body: bytes, headers: dict | None = None, **params) -> httpx.Response:
    return httpx.post(f"{served.base}/v1/models/{MODEL}/vae/encode", content=body, headers=headers or {},
                      params=params, timeout=120)


def encoded(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "tensor/binary" and r.headers["dtype"] == "float32"
    return np.frombuffer(r.content, "<f4").reshape(json.loads(r.headers["shape"]))


def encode_reference(served, video01: np.ndarray, scale: bool = True) -> np.ndarray:
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # the server has the other core
    try:
        return pipeline_encode(served.vae, np.ascontiguousarray(video01, np.float32), scale=scale)
    finally:
        torch.set_num_threads(before)


def test_encode_route_gives_the_pipelines_latents(served):
    """.npy clips with do_scaling=True: the image-to-video pipeline's latents (mode * scaling_factor);
    with no factors the bare mean; a PNG is one frame."""
    from PIL import Image
    rng = np.random.default_rng()
    clip = rng.random((2, 5, 24, 40, 3), dtype=np.float32)  # odd latent sides 3x5, a batch of 2
    got = encoded(encode(served, npy(clip), NPY, do_scaling=True))
    assert got.shape == (2, C, 2, 3, 5)
    err = ref.rel_l2(got, encode_reference(served, clip))
    print(f"remote_encode .npy clip vs diffusers rel L2 {err:.2e}")
    assert err < TOL
    bare = encoded(encode(served, npy(clip), NPY))
    assert ref.rel_l2(bare, encode_reference(served, clip, scale=False)) < TOL
    rgb = rng.integers(0, 256, (16, 24, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    got = encoded(encode(served, buf.getvalue(), {"content-type": "image/png"}, do_scaling=True))
    assert got.shape == (1, C, 1, 2, 3)
    assert ref.rel_l2(got, encode_reference(served, (rgb.astype(np.float32) / 255)[None, None])) < TOL


def test_diffusers_remote_encode_client(served):
    """diffusers' own client with a video tensor N,3,F,H,W in [-1, 1] (what vae.encode takes) and the
    pipeline's scaling_factor: the latents _get_image_latents hands on."""
    pytest.importorskip("requests")
    from diffusers.utils.remote_utils import remote_encode

    x = torch.rand(1, 3, 9, 16, 24) * 2 - 1
    with torch.no_grad():
        want = served.vae.encode(x).latent_dist.mode() * served.vae.config.scaling_factor
    out = remote_encode(f"{served.base}/v1/models/{MODEL}/vae/encode", x,
                        scaling_factor=served.vae.config.scaling_factor)
    assert tuple(out.shape) == (1, C, 3, 2, 3)
    err = ref.rel_l2(out.numpy(), want.numpy())
    print(f"remote_encode client vs diffusers rel L2 {err:.2e}")
    assert err < TOL


@pytest.mark.parametrize("shape, kind", [((1, 4, 16, 16, 3), "bad-frame-count"),
                                         ((1, 5, 12, 16, 3), "bad-frame-size")], ids=["F=4", "side 12"])
def test_encode_refusals_are_a_422_and_the_server_stays_up(served, shape, kind):
    r = encode(served, npy(np.zeros(shape, np.float32)), NPY)
    assert r.status_code == 422 and r.json()["type"].endswith(kind), r.text[:300]
    assert encoded(encode(served, npy(np.zeros((1, 1, 8, 8, 3), np.float32)), NPY)).shape == (1, C, 1, 1, 1)
