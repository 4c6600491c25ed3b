"""The FLUX.2 VAE served by a real uvicorn convserve: /v1 REST decode, KServe v2 infer and diffusers'
own remote VAE client (`remote_decode` with the pipeline's packed tokens and height/width,
`remote_encode`), each against diffusers' AutoencoderKLFlux2 + the FLUX.2 pipeline's latent
handling with the same random weights and BatchNorm statistics."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("requests")

import test_models_flux2_vae as ref  # noqa: E402
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline  # noqa: E402
from diffusers.utils.remote_utils import remote_decode, remote_encode  # noqa: E402
from live_server import from_npy, npy  # noqa: E402
from PIL import Image  # noqa: E402

TOL = ref.TOL
CHANNELS = 4 * ref.TINY["latent_channels"]  # the pipeline's patchified latents


class Served:
    def __init__(self, base: str, vae):
        self.base, self.vae = base, vae

    def remote(self, op: str = "decode") -> str:
        return f"{self.base}/v1/models/f2/vae/{op}"


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae = ref.make_flux2_vae(ref.TINY, seed)
    folder = tmp_path_factory.mktemp("flux2_vae")
    vae.save_pretrained(folder)
    live = server_factory(models=f"f2=tiny-flux2-vae:{folder}", max_batch=4)
    return Served(live.url, vae)


def grid(n=1, h=3, w=5) -> np.ndarray:
    return np.random.default_rng().standard_normal((n, CHANNELS, h, w)).astype(np.float32)


def raw_sample(vae, x: torch.Tensor) -> torch.Tensor:
    """The pipeline's de-normalise + unpatchify, then vae.decode(...).sample (remote_decode's `pt`)."""
    mean, std = ref.bn_mean_std(vae)
    with torch.no_grad():
        return vae.decode(Flux2Pipeline._unpatchify_latents(x * std + mean)).sample


def test_card_and_rest_decode(served):
    card = httpx.get(f"{served.base}/v1/models/f2", timeout=30).json()
    assert card["latent_channels"] == CHANNELS and card["spatial_factor"] == 16
    assert card["packed_latents"] == "row-major tokens" and card["has_encoder"] is True
    x = grid(n=2, h=3, w=5)
    r = httpx.post(f"{served.base}/v1/models/f2/decode", content=npy(x), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    ours = from_npy(r.content)
    assert ours.shape == (2, 48, 80, 3)
    assert ref.rel_l2(ours, ref.pipeline_decode(served.vae, x)) < TOL


def test_kserve_v2_infer(served):
    meta = httpx.get(f"{served.base}/v2/models/f2", timeout=30).json()
    assert meta["inputs"][0]["shape"] == [-1, CHANNELS, -1, -1]
    x = grid(h=2, w=3)
    body = {"inputs": [{"name": "latents", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    r = httpx.post(f"{served.base}/v2/models/f2/infer", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = next(o for o in r.json()["outputs"] if o["name"] == "images")
    images = np.asarray(out["data"], np.float32).reshape(out["shape"])
    assert images.shape == (1, 32, 48, 3)
    assert ref.rel_l2(images, ref.pipeline_decode(served.vae, x)) < TOL


@pytest.mark.parametrize("height,width", [(48, 80), (53, 95)])  # the pipeline floors to 16-pixel cells
def test_remote_decode_packed_tokens(served, height, width):
    """The pipeline's tokens (B, h'*w', 128), row-major, unpacked as Flux2Pipeline does with its ids."""
    x = torch.from_numpy(grid(n=2, h=height // 16, w=width // 16))
    # contiguous, as the transformer hands them: remote_decode sends a tensor's storage bytes as they lie
    packed = Flux2Pipeline._pack_latents(x).contiguous()
    assert tuple(packed.shape) == (2, x.shape[2] * x.shape[3], CHANNELS)
    unpacked = Flux2Pipeline._unpack_latents_with_ids(packed, Flux2Pipeline._prepare_latent_ids(x))
    sample = raw_sample(served.vae, unpacked)
    out = remote_decode(served.remote(), packed, do_scaling=False, output_type="pt", return_type="pt",
                        height=height, width=width)
    assert tuple(out.shape) == tuple(sample.shape) == (2, 3, 16 * x.shape[2], 16 * x.shape[3])
    assert ref.rel_l2(out, sample) < TOL
    # FLUX.1's 2x2-patch unpacking of the same tokens would be another image: the layout matters here
    wrong = x.reshape(2, CHANNELS // 4, 2, 2, x.shape[2], x.shape[3]).permute(0, 1, 4, 2, 3, 5)
    assert ref.rel_l2(out, raw_sample(served.vae, wrong.reshape(x.shape))) > 100 * TOL


def test_remote_decode_grid_and_tokens_that_do_not_fit(served):
    """A 4-D grid of the transformer's latents, sent as the packed tokens are (do_scaling=False, as
    diffusers' client now asks: its do_scaling=True alone is deprecated); the server applies the
    BatchNorm statistics itself, which no scaling_factor/shift_factor pair could carry."""
    x = torch.from_numpy(grid(h=3, w=2))
    out = remote_decode(served.remote(), x, do_scaling=False, output_type="pt", return_type="pt")
    assert ref.rel_l2(out, raw_sample(served.vae, x)) < TOL
    with pytest.raises(RuntimeError, match="do not fit"):
        remote_decode(served.remote(), torch.randn(1, 7, CHANNELS), do_scaling=False, output_type="pt",
                      return_type="pt", height=48, width=48)


def test_remote_encode(served):
    rgb = np.random.default_rng().integers(0, 256, (48, 80, 3), dtype=np.uint8)
    out = remote_encode(served.remote("encode"), Image.fromarray(rgb))
    assert tuple(out.shape) == (1, CHANNELS, 3, 5)
    expected = ref.pipeline_encode(served.vae, (rgb.astype(np.float32) / 255.0)[None])
    assert ref.rel_l2(out, expected) < TOL
    # 72 / 8 = 9 latent rows split into no whole 2x2 patches: refused before the model runs
    with pytest.raises(RuntimeError, match="whole 2x2 latent patches"):
        remote_encode(served.remote("encode"), Image.new("RGB", (64, 72)))
