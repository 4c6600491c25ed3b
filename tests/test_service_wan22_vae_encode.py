"""The Wan 2.2 VAE's encoder served by a real uvicorn convserve through diffusers' remote_encode route
(/v1/models/{name}/vae/encode): a PNG (one frame), a .npy clip, and diffusers' own `remote_encode`
client with an image and with a video tensor, each against diffusers' AutoencoderKLWan(is_residual=True,
patch_size=2).encode with the same random weights (+ the TI2V pipeline's normalisation where asked
for with do_scaling); then the refusals (frame count, sides, limits, the compute cap over every
frame's pixels), after which the server still answers."""
from __future__ import annotations

import io
import json

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
Image = pytest.importorskip("PIL.Image")

import test_models_wan22_vae as ref  # noqa: E402
from live_server import npy  # noqa: E402
from test_models_wan22_vae_encoder import reference_encode  # noqa: E402

from models.contract import IMAGE_DECODER, VIDEO_DECODER  # noqa: E402
from service.hosted_model import HostedModel, ModelView  # noqa: E402
from service.settings import ModelEntry  # noqa: E402

NPY = {"content-type": "application/x-npy"}
MODEL = "wan22"
TOL = 1e-4  # rel L2, fp32
#: the compute cap: 1x9x48x48 = 20736 input pixels is past it, every valid request here under it
CAP = 20_000
MAX_FRAMES = 9


class Served:
    def __init__(self, base: str, vae, config: dict):
        self.base, self.vae, self.config = base, vae, config
        self.url = f"{base}/v1/models/{MODEL}/vae/encode"

    def reference(self, video01: np.ndarray, normalise: bool = True) -> np.ndarray:
        before = torch.get_num_threads()
        torch.set_num_threads(1)  # the server has the other core
        try:
            return reference_encode(self.vae, self.config, np.ascontiguousarray(video01, np.float32), normalise)
        finally:
            torch.set_num_threads(before)

    def post(self, body: bytes, headers: dict | None = None, **params) -> httpx.Response:
        return httpx.post(self.url, content=body, headers=headers or {}, params=params, timeout=120)


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae, folder, config = ref.make_reference(tmp_path_factory.mktemp("wan22_vae_enc"), ref.WAN22_SMALL, seed)
    live = server_factory(models=f"{MODEL}=tiny-wan2.2-vae:{folder}", max_request_pixels=CAP, max_frames=MAX_FRAMES)
    return Served(live.url, vae, config)


def latents_of(r: httpx.Response) -> np.ndarray:
    assert r.status_code == 200, r.text
    assert r.headers["content-type"] == "tensor/binary" and r.headers["dtype"] == "float32"
    return np.frombuffer(r.content, "<f4").reshape(json.loads(r.headers["shape"]))


def png(rgb: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rgb).save(buf, format="PNG")
    return buf.getvalue()


def check(label: str, got: np.ndarray, want: np.ndarray) -> None:
    err = ref.rel_l2(got, want)
    print(f"{label}: rel L2 {err:.2e}")
    assert err < TOL, f"{label}: rel L2 {err:.2e}"


def test_encoded_shape_and_can_encode():
    """The front end's shape helper gives the video shape; a video VAE without an encoder (Wan
    2.1's ModelView: no has_encoder) still cannot encode."""
    def hosted(kind, **attrs) -> HostedModel:
        return HostedModel(ModelEntry("m", "p"), ModelView("m", kind, {}, None, None, **attrs), 0.0)

    wan22 = hosted(VIDEO_DECODER, latent_channels=48, spatial_factor=16, temporal_factor=4, has_encoder=True)
    assert wan22.can_encode and wan22.encoded_shape((2, 9, 64, 96, 3)) == (2, 48, 3, 4, 6)
    assert wan22.encoded_shape((1, 1, 16, 16, 3)) == (1, 48, 1, 1, 1)
    assert not hosted(VIDEO_DECODER, latent_channels=16, spatial_factor=8, temporal_factor=4).can_encode
    sd = hosted(IMAGE_DECODER, latent_channels=4, spatial_factor=8, has_encoder=True)
    assert sd.can_encode and sd.encoded_shape((2, 44, 30, 3)) == (2, 4, 5, 3)  # floored, as before


def test_png_is_one_frame(served):
    rgb = np.random.default_rng().integers(0, 256, (32, 48, 3), dtype=np.uint8)
    frames01 = (rgb.astype(np.float32) / 255)[None, None]
    got = latents_of(served.post(png(rgb), {"content-type": "image/png"}, do_scaling=True))
    assert got.shape == (1, 12, 1, 2, 3)
    check("PNG, normalised (do_scaling)", got, served.reference(frames01))
    raw = latents_of(served.post(png(rgb), {"content-type": "image/png"}))  # no factors: the unscaled mean
    check("PNG, unscaled mean", raw, served.reference(frames01, normalise=False))


def test_npy_clips(served):
    rng = np.random.default_rng()
    clip = rng.random((1, 5, 32, 48, 3), dtype=np.float32)  # float in [0, 1], channels last
    got = latents_of(served.post(npy(clip), NPY, do_scaling=True))
    assert got.shape == (1, 12, 2, 2, 3)
    ti2v = served.reference(clip)
    check(".npy clip F=5, normalised", got, ti2v)
    # the normalisation is what the test sees: the bare mean is far from it
    assert ref.rel_l2(got, served.reference(clip, normalise=False)) > 100 * TOL
    # uint8, a batch of two, sent without a Content-Type (recognised by its magic bytes)
    u8 = rng.integers(0, 256, (2, 5, 16, 32, 3), dtype=np.uint8)
    got = latents_of(served.post(npy(u8), do_scaling=True))
    assert got.shape == (2, 12, 2, 1, 2)
    check(".npy uint8 clips N=2", got, served.reference(u8.astype(np.float32) / 255))
    # N,H,W,3: one frame per video
    one = rng.random((2, 16, 16, 3), dtype=np.float32)
    got = latents_of(served.post(npy(one), NPY, do_scaling=True))
    check(".npy N,H,W,3 as F=1", got, served.reference(one[:, None]))


def test_diffusers_remote_encode_client(served):
    """diffusers' own client: a PIL image, and a video tensor N,3,F,H,W in [-1, 1] (what vae.encode
    takes); it sends no do_scaling, so the answer is the unscaled mean, or scaled by its factors."""
    pytest.importorskip("requests")
    from diffusers.utils.remote_utils import remote_encode

    rng = np.random.default_rng()
    rgb = rng.integers(0, 256, (16, 32, 3), dtype=np.uint8)
    out = remote_encode(served.url, Image.fromarray(rgb))
    assert tuple(out.shape) == (1, 12, 1, 1, 2) and out.dtype == torch.float32
    check("remote_encode PIL", out.numpy(), served.reference((rgb.astype(np.float32) / 255)[None, None], False))
    x = torch.rand(1, 3, 5, 32, 16) * 2 - 1
    with torch.no_grad():
        mean = served.vae.encode(x).latent_dist.mode()
    out = remote_encode(served.url, x, scaling_factor=0.7, shift_factor=0.05)
    assert tuple(out.shape) == (1, 12, 2, 2, 1)
    check("remote_encode video tensor, scaled", out.numpy(), ((mean - 0.05) * 0.7).numpy())
    half = remote_encode(served.url, x.to(torch.float16))  # the answer keeps the request's dtype
    assert half.dtype == torch.float16
    assert ref.rel_l2(half.float().numpy(), served.reference((x.half().float().permute(0, 2, 3, 4, 1).numpy() + 1) / 2,
                                                             False)) < 2e-3


@pytest.mark.parametrize("body, headers, params, status, kind", [
    (npy(np.zeros((1, 4, 16, 16, 3), np.float32)), NPY, {}, 422, "bad-frame-count"),
    (npy(np.zeros((1, 5, 24, 16, 3), np.float32)), NPY, {}, 422, "bad-frame-size"),
    (png(np.zeros((20, 16, 3), np.uint8)), {"content-type": "image/png"}, {}, 422, "bad-frame-size"),
    (npy(np.zeros((1, 13, 16, 16, 3), np.uint8)), NPY, {}, 422, "too-many-frames"),
    (npy(np.zeros((1, 9, 48, 48, 3), np.uint8)), NPY, {}, 413, "too-much-work"),
    (npy(np.zeros((1, 5, 16, 16, 4), np.float32)), NPY, {}, 422, "bad-shape"),
    (npy(np.zeros((1, 1, 5, 16, 16, 3), np.float32)), NPY, {}, 422, "bad-shape"),
    (npy(np.zeros((1, 5, 16, 16, 3), np.int32)), NPY, {}, 415, "unsupported-dtype"),
    (npy(np.full((1, 1, 16, 16, 3), np.nan, np.float32)), NPY, {}, 422, "non-finite-pixels"),
    # a raw float tensor is channels first (N,3,F,H,W), as diffusers sends it
    (np.zeros((1, 5, 16, 16, 3), np.float32).tobytes(), {"content-type": "tensor/binary"},
     {"shape": [1, 5, 16, 16, 3], "dtype": "float32"}, 422, "bad-shape"),
    (np.zeros((1, 3, 3, 16, 16), np.float32).tobytes(), {"content-type": "tensor/binary"},
     {"shape": [1, 3, 3, 16, 16], "dtype": "float32"}, 422, "bad-frame-count"),
    (b"not an image", {"content-type": "image/png"}, {}, 415, "undecodable-image"),
], ids=["F=4", "side 24", "png 20x16", "13 frames", "compute cap", "rgba", "6-D", "int32", "nan",
        "channels-last float tensor", "tensor F=3", "not an image"])
def test_bad_inputs_are_refused_with_the_reason(served, body, headers, params, status, kind):
    r = served.post(body, headers, **params)
    assert r.status_code == status and r.json()["type"].endswith(kind), r.text
    # the server is still healthy and encodes
    assert httpx.get(f"{served.base}/readyz", timeout=10).status_code == 200
    got = latents_of(served.post(npy(np.zeros((1, 1, 16, 16, 3), np.uint8)), NPY))
    assert got.shape == (1, 12, 1, 1, 1)
