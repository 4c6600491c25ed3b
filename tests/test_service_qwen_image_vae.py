"""The Qwen-Image VAE served by a real uvicorn convserve: /v1 REST decode and diffusers' own remote VAE
client (`remote_decode` with N,16,h,w, the pipeline's N,16,1,h,w and its packed 2x2-patch tokens with
height/width; `remote_encode`), each against diffusers' AutoencoderKLQwenImage + the Qwen-Image pipeline's latent
handling with the same random weights and non-trivial latents_mean/std."""
from __future__ import annotations

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("requests")

import test_models_qwen_image_vae as ref  # noqa: E402
from diffusers.pipelines.qwenimage.pipeline_qwenimage import QwenImagePipeline  # noqa: E402
from diffusers.utils.remote_utils import remote_decode, remote_encode  # noqa: E402
from live_server import from_npy, npy  # noqa: E402
from PIL import Image  # noqa: E402

TOL = ref.TOL


class Served:
    def __init__(self, base: str, vae, config: dict):
        self.base, self.vae, self.config = base, vae, config

    def remote(self, op: str = "decode") -> str:
        return f"{self.base}/v1/models/qi/vae/{op}"

    def stats(self):
        mean = torch.tensor(self.config["latents_mean"]).view(1, -1, 1, 1, 1)
        std = torch.tensor(self.config["latents_std"]).view(1, -1, 1, 1, 1)
        return mean, std


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae, folder, config = ref.make_reference(tmp_path_factory.mktemp("qwen_image_vae"), ref.QWEN_SMALL, seed)
    live = server_factory(models=f"qi=tiny-qwen-image-vae:{folder}", max_batch=4)
    return Served(live.url, vae, config)


def grid(*shape) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def raw_sample(vae, z_unnormalised: torch.Tensor) -> torch.Tensor:
    """vae.decode(...).sample of the pipeline's de-normalised N,16,1,h,w (remote_decode's raw `pt`)."""
    with torch.no_grad():
        return vae.decode(z_unnormalised).sample


@pytest.mark.parametrize("shape", [(2, 16, 3, 5), (2, 16, 1, 3, 5)], ids=["N16hw", "N161hw"])
def test_card_and_rest_decode(served, shape):
    card = httpx.get(f"{served.base}/v1/models/qi", timeout=30).json()
    assert card["kind"] == "image-decoder" and card["latent_channels"] == 16 and card["spatial_factor"] == 8
    assert card["single_frame_latents"] is True and card["has_encoder"] is True
    x = grid(*shape)
    r = httpx.post(f"{served.base}/v1/models/qi/decode", content=npy(x), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 200, r.text
    ours = from_npy(r.content)
    assert ours.shape == (2, 24, 40, 3)
    expected = ref.reference_decode(served.vae, served.config, x)
    assert ref.rel_l2(ours, expected) < TOL
    # vacuity guard: without the pipeline's de-normalisation the answer would not match
    assert ref.rel_l2(ours, ref.reference_decode(served.vae, served.config, x, denormalise=False)) > 100 * TOL


def test_rest_refuses_several_frames(served):
    x = grid(1, 16, 2, 3, 5)
    r = httpx.post(f"{served.base}/v1/models/qi/decode", content=npy(x), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=60)
    assert r.status_code == 422, r.text


@pytest.mark.parametrize("five_d", [False, True], ids=["N16hw", "N161hw"])
def test_remote_decode_pt_raw_unnormalised(served, five_d):
    """The pipeline's de-normalised latents sent as they are (do_scaling=False): the answer is
    vae.decode(...).sample, frame axis and all when the latents had one."""
    x = torch.from_numpy(grid(2, 16, 1, 3, 4))
    mean, std = served.stats()
    z = x / (1.0 / std) + mean
    sample = raw_sample(served.vae, z)  # 2, 3, 1, 24, 32
    out = remote_decode(served.remote(), z if five_d else z[:, :, 0], do_scaling=False, output_type="pt",
                        return_type="pt")
    expected = sample if five_d else sample[:, :, 0]
    assert tuple(out.shape) == tuple(expected.shape)
    assert ref.rel_l2(out, expected) < TOL


def test_remote_decode_normalised_and_uint8(served):
    x = torch.from_numpy(grid(1, 16, 1, 3, 4))
    mean, std = served.stats()
    sample = raw_sample(served.vae, x / (1.0 / std) + mean)
    with pytest.warns(FutureWarning):  # do_scaling=True alone: the model's own mean/std
        out = remote_decode(served.remote(), x, do_scaling=True, output_type="pt", return_type="pt")
    assert ref.rel_l2(out, sample) < TOL
    with pytest.warns(FutureWarning):
        u8 = remote_decode(served.remote(), x[:, :, 0], do_scaling=True, output_type="pt", partial_postprocess=True,
                           return_type="pt")
    expected = (sample[:, :, 0] / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).mul(255).round().to(torch.uint8)
    assert u8.dtype == torch.uint8 and tuple(u8.shape) == (1, 24, 32, 3)
    assert (u8.int() - expected.int()).abs().max() <= 1


@pytest.mark.parametrize("height,width", [(32, 48), (37, 53)])  # the pipeline floors to 16-pixel cells
def test_remote_decode_packed_tokens(served, height, width):
    h, w = 2 * (height // 16), 2 * (width // 16)
    x = torch.from_numpy(grid(2, 16, h, w))
    packed = QwenImagePipeline._pack_latents(x, 2, 16, h, w).contiguous()
    unpacked = QwenImagePipeline._unpack_latents(packed, height, width, 8)  # 2, 16, 1, h, w
    mean, std = served.stats()
    z = unpacked / (1.0 / std) + mean  # the pipeline's de-normalisation, then packed again for the wire
    sample = raw_sample(served.vae, z)[:, :, 0]
    packed_raw = QwenImagePipeline._pack_latents(z[:, :, 0], 2, 16, h, w).contiguous()
    out = remote_decode(served.remote(), packed_raw, do_scaling=False, output_type="pt", return_type="pt",
                        height=height, width=width)
    assert tuple(out.shape) == tuple(sample.shape) == (2, 3, 8 * h, 8 * w)
    assert ref.rel_l2(out, sample) < TOL


def test_remote_encode_png_and_tensor(served):
    """No factors: the unscaled posterior mean (vae.encode(...).latent_dist.mode()), as remote_encode
    hands it to a client that normalises it itself."""
    rgb = np.random.default_rng().integers(0, 256, (40, 56, 3), dtype=np.uint8)
    x01 = (rgb.astype(np.float32) / 255.0)[None]
    expected = ref.reference_encode(served.vae, served.config, x01, normalise=False)
    out = remote_encode(served.remote("encode"), Image.fromarray(rgb))
    assert tuple(out.shape) == expected.shape == (1, 16, 5, 7)
    assert ref.rel_l2(out, expected) < TOL
    # a [-1, 1] tensor, as VaeImageProcessor.preprocess gives it
    pre = (torch.from_numpy(x01).permute(0, 3, 1, 2) * 2 - 1).contiguous()  # sent as its storage lies
    out = remote_encode(served.remote("encode"), pre)
    assert ref.rel_l2(out, expected) < TOL


def test_remote_encode_of_an_image_below_one_latent_is_refused(served):
    with pytest.raises(RuntimeError, match="model-rejected-input.*H, W >= 8"):
        remote_encode(served.remote("encode"), Image.new("RGB", (4, 6)))
