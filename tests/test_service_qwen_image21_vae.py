"""The Qwen-Image 2.1 VAE served by a real uvicorn convserve (a small diffusers folder through the
MODELS setting): the card, /v1 REST decode (N,C,h,w and the pipeline's N,C,1,h,w), KServe v2 infer and
diffusers' own remote VAE client (`remote_decode` with raw, normalised and the 2.1 pipeline's packed
row-major tokens; `remote_encode`), each against diffusers' AutoencoderKLQwenImage21 + the Qwen-Image
2.1 pipeline's latent handling with the same random weights. The service's pixels are RGB: the
decoder's first three channels (its fourth, alpha, is the model's decode_rgba)."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("requests")

import test_models_qwen_image21_vae as ref  # noqa: E402
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline  # noqa: E402
from diffusers.utils.remote_utils import remote_decode, remote_encode  # noqa: E402
from live_server import from_npy, npy  # noqa: E402
from PIL import Image  # noqa: E402

TOL = ref.TOL
C, F = ref.SMALL["z_dim"], 16


class Served:
    def __init__(self, base: str, vae, config: dict):
        self.base, self.vae, self.config = base, vae, config

    def remote(self, op: str = "decode") -> str:
        return f"{self.base}/v1/models/q21/vae/{op}"

    def denormalised(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = ref._stats(self.config)
        return (x if x.ndim == 5 else x[:, :, None]) * std + mean

    def sample_rgb(self, z: torch.Tensor) -> torch.Tensor:
        """vae.decode(...).sample's RGB channels, frame axis dropped (remote_decode's raw `pt`)."""
        with torch.no_grad():
            return self.vae.decode(z).sample[:, :3, 0]


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae, folder, config = ref.make_reference(tmp_path_factory.mktemp("qwen_image21_vae"), ref.SMALL, seed)
    live = server_factory(models=f"q21=tiny-qwen-image2.1-vae:{folder}", max_batch=4)
    return Served(live.url, vae, config)


def grid(*shape) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("shape", [(2, C, 3, 5), (2, C, 1, 3, 5)], ids=["NChw", "NC1hw"])
def test_card_and_rest_decode(served, shape):
    card = httpx.get(f"{served.base}/v1/models/q21", timeout=30).json()
    assert (card["kind"], card["latent_channels"], card["spatial_factor"]) == ("image-decoder", C, F)
    assert card["single_frame_latents"] is True and card["has_encoder"] is True
    x = grid(*shape)
    r = httpx.post(f"{served.base}/v1/models/q21/decode", content=npy(x), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    ours = from_npy(r.content)
    assert ours.shape == (2, 3 * F, 5 * F, 3)
    assert ref.rel_l2(ours, ref.reference_decode(served.vae, served.config, x)[..., :3]) < TOL
    bare = ref.reference_decode(served.vae, served.config, x, denormalise=False)[..., :3]
    assert ref.rel_l2(ours, bare) > 100 * TOL, "the de-normalisation must be what the test sees"


def test_kserve_v2_infer(served):
    meta = httpx.get(f"{served.base}/v2/models/q21", timeout=30).json()
    assert meta["inputs"][0]["shape"] == [-1, C, -1, -1]
    x = grid(1, C, 2, 3)
    body = {"inputs": [{"name": "latents", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    r = httpx.post(f"{served.base}/v2/models/q21/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = next(o for o in r.json()["outputs"] if o["name"] == "images")
    images = np.asarray(out["data"], np.float32).reshape(out["shape"])
    assert images.shape == (1, 2 * F, 3 * F, 3)
    assert ref.rel_l2(images, ref.reference_decode(served.vae, served.config, x)[..., :3]) < TOL


def test_remote_decode_raw_normalised_and_packed(served):
    x = torch.from_numpy(grid(2, C, 1, 2, 4))
    z = served.denormalised(x)
    sample = served.sample_rgb(z)
    out = remote_decode(served.remote(), z[:, :, 0], do_scaling=False, output_type="pt", return_type="pt")
    assert tuple(out.shape) == tuple(sample.shape) == (2, 3, 2 * F, 4 * F)
    assert ref.rel_l2(out, sample) < TOL
    with pytest.warns(FutureWarning):  # do_scaling=True alone: the model's own latents_mean/std
        out = remote_decode(served.remote(), x[:, :, 0], do_scaling=True, output_type="pt", return_type="pt")
    assert ref.rel_l2(out, sample) < TOL
    # the 2.1 pipeline's tokens: unpatched latents, row-major (B, h * w, C); height and width in pixels
    height, width = 2 * F, 4 * F
    packed = QwenImage21Pipeline._pack_latents(z[:, :, 0], 2, C, 2, 4).contiguous()
    assert torch.equal(QwenImage21Pipeline._unpack_latents(packed, height, width, F), z)
    out = remote_decode(served.remote(), packed, do_scaling=False, output_type="pt", return_type="pt",
                        height=height, width=width)
    assert ref.rel_l2(out, sample) < TOL


def test_remote_encode_png_and_tensor(served):
    """An RGB PNG is encoded as the pipeline's convert("RGBA") makes it (alpha 255); no factors asked:
    the unscaled posterior mean."""
    rgb = np.random.default_rng().integers(0, 256, (2 * F, 3 * F, 3), dtype=np.uint8)
    x01 = (rgb.astype(np.float32) / 255.0)[None]
    opaque = np.concatenate([x01, np.ones_like(x01[..., :1])], axis=-1)
    expected = ref.reference_encode(served.vae, served.config, opaque, normalise=False)
    out = remote_encode(served.remote("encode"), Image.fromarray(rgb))
    assert tuple(out.shape) == expected.shape == (1, C, 2, 3)
    assert ref.rel_l2(out, expected) < TOL
    pre = (torch.from_numpy(x01).permute(0, 3, 1, 2) * 2 - 1).contiguous()
    assert ref.rel_l2(remote_encode(served.remote("encode"), pre), expected) < TOL


def test_images_the_encoder_cannot_take_are_refused_and_the_server_stays_up(served):
    with pytest.raises(RuntimeError, match=f"multiples of {F}") as e:
        remote_encode(served.remote("encode"), Image.new("RGB", (2 * F + 8, 2 * F)))
    assert "'status': 422" in str(e.value)
    r = httpx.post(f"{served.base}/v1/models/q21/decode", content=npy(grid(1, C, 2, 1, 3)), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 422, r.text  # two frames: the class takes one
    assert httpx.get(f"{served.base}/v1/models/q21", timeout=30).status_code == 200
