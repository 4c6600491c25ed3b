"""The Qwen-Image 2.1 VAE served by a real uvicorn convserve (a small diffusers folder through the
MODELS setting): the card, /v1 REST decode (N,C,h,w and the pipeline's N,C,1,h,w), KServe v2 infer and
diffusers' own remote VAE client (`remote_decode` with raw, normalised and the 2.1 pipeline's packed
row-major tokens; `remote_encode`), each against diffusers' AutoencoderKLQwenImage21 + the Qwen-Image
2.1 pipeline's latent handling with the same random weights. The decoder writes RGBA (the pipeline's
PIL output is RGBA): every route answers all four channels by default, alpha compared with the
reference's fourth channel; `channels=rgb` the first three; JPEG (no alpha) RGB; alpha asked of JPEG
or of a model without alpha (TAESD, served beside it) is a one-line 422."""
from __future__ import annotations

import io
import zipfile

import httpx
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("requests")

import test_models_qwen_image21_vae as ref  # noqa: E402
from diffusers.image_processor import VaeImageProcessor  # noqa: E402
from diffusers.pipelines.qwenimage21.pipeline_qwenimage21 import QwenImage21Pipeline  # noqa: E402
from diffusers.utils.remote_utils import remote_decode, remote_encode  # noqa: E402
from live_server import from_npy, npy  # noqa: E402
from PIL import Image  # noqa: E402
from reference_checks import assert_informative  # noqa: E402

TOL = ref.TOL

C, F = ref.SMALL["z_dim"], 16
NPY = {"content-type": "application/x-npy"}


class Served:
    def __init__(self, base: str, vae, config: dict):
        self.base, self.vae, self.config = base, vae, config

    def remote(self, op: str = "decode") -> str:
        return f"{self.base}/v1/models/q21/vae/{op}"

    def denormalised(self, x: torch.Tensor) -> torch.Tensor:
        mean, std = ref._stats(self.config)
        return (x if x.ndim == 5 else x[:, :, None]) * std + mean

    def sample(self, z: torch.Tensor) -> torch.Tensor:
        """vae.decode(...).sample, all four channels (RGBA), frame axis dropped (remote_decode's raw `pt`)."""
        with torch.no_grad():
            return self.vae.decode(z).sample[:, :, 0]

    def rgba(self, x: np.ndarray) -> np.ndarray:
        """The pipeline's decode of normalised latents: N,H,W,4 in [0, 1], its alpha informative."""
        out = ref.reference_decode(self.vae, self.config, x)
        assert out.shape[-1] == 4
        assert_informative(out[..., 3], "the reference's alpha")
        return out

    def decode(self, x: np.ndarray, model: str = "q21", **params) -> httpx.Response:
        return httpx.post(f"{self.base}/v1/models/{model}/decode", content=npy(x), params={"format": "npy", **params},
                          headers=NPY, timeout=60)


@pytest.fixture(scope="module")
def served(server_factory, tmp_path_factory):
    seed = ref.fresh_seed()
    print(f"seed {seed}")
    vae, folder, config = ref.make_reference(tmp_path_factory.mktemp("qwen_image21_vae"), ref.SMALL, seed)
    live = server_factory(models=f"q21=tiny-qwen-image2.1-vae:{folder},rgb=tiny-taesd", max_batch=4)
    return Served(live.url, vae, config)


def grid(*shape) -> np.ndarray:
    return np.random.default_rng().standard_normal(shape).astype(np.float32)


def as_uint8(x01: np.ndarray) -> np.ndarray:
    return np.round(np.clip(x01, 0, 1) * 255).astype(np.int16)


def assert_one_line_422(r: httpx.Response, kind: str, *words: str) -> None:
    assert r.status_code == 422 and r.headers["content-type"] == "application/problem+json", r.text
    detail = r.json()["detail"]
    assert r.json()["type"].endswith(f"#{kind}") and "\n" not in detail and len(detail) < 300, r.text
    assert all(w in detail for w in words), detail


@pytest.mark.parametrize("shape", [(2, C, 3, 5), (2, C, 1, 3, 5)], ids=["NChw", "NC1hw"])
def test_card_and_rest_decode_answer_rgba(served, shape):
    card = httpx.get(f"{served.base}/v1/models/q21", timeout=30).json()
    assert (card["kind"], card["latent_channels"], card["spatial_factor"]) == ("image-decoder", C, F)
    assert card["single_frame_latents"] is True and card["has_encoder"] is True
    assert card["pixel_channels"] == {"decoded": 4, "served": 4, "on_request": 3}
    assert card["outputs"][0]["shape"] == [-1, -1, -1, 4] and card["outputs"][0]["channels"] == ["rgba", "rgb"]
    x = grid(*shape)
    expected = served.rgba(x)
    r = served.decode(x)
    assert r.status_code == 200, r.text
    ours = from_npy(r.content)
    assert ours.shape == (2, 3 * F, 5 * F, 4) and r.headers["x-output-shape"] == f"2,{3 * F},{5 * F},4"
    assert ref.rel_l2(ours, expected) < TOL
    assert ref.rel_l2(ours[..., 3], expected[..., 3]) < TOL  # alpha on its own, not lost in RGB's error
    bare = ref.reference_decode(served.vae, served.config, x, denormalise=False)
    assert ref.rel_l2(ours, bare) > 100 * TOL, "the de-normalisation must be what the test sees"
    r = served.decode(x, channels="rgb")
    assert r.status_code == 200, r.text
    rgb = from_npy(r.content)
    assert rgb.shape == (2, 3 * F, 5 * F, 3) and ref.rel_l2(rgb, expected[..., :3]) < TOL
    r = served.decode(x, dtype="uint8")  # converted on the device: the rounding may differ by one
    assert r.status_code == 200, r.text
    u8 = from_npy(r.content)
    assert u8.dtype == np.uint8 and u8.shape == expected.shape
    assert np.abs(u8.astype(np.int16) - as_uint8(expected)).max() <= 1


def test_image_files_carry_alpha_where_the_format_can(served):
    """PNG and WebP are RGBA images (a batch: a zip of them); JPEG, which holds no alpha, is RGB
    unless alpha is asked for, which is a 422 naming the formats that hold it."""
    x = grid(2, C, 2, 3)
    expected = as_uint8(served.rgba(x))
    r = served.decode(x, format="png")
    assert r.status_code == 200 and r.headers["content-type"] == "application/zip", r.text
    with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
        images = [Image.open(io.BytesIO(zf.read(n))) for n in zf.namelist()]
    assert [im.mode for im in images] == ["RGBA", "RGBA"]
    assert np.abs(np.stack([np.asarray(im, np.int16) for im in images]) - expected).max() <= 1
    r = served.decode(x[:1], format="webp", channels="rgba")
    assert r.status_code == 200 and r.headers["content-type"] == "image/webp", r.text
    webp = Image.open(io.BytesIO(r.content))
    assert webp.mode == "RGBA" and np.abs(np.asarray(webp, np.int16)[..., 3] - expected[0, ..., 3]).max() <= 1
    r = served.decode(x[:1], format="jpeg")
    assert r.status_code == 200 and r.headers["x-output-shape"].endswith(",3"), r.text
    assert Image.open(io.BytesIO(r.content)).mode == "RGB"
    assert_one_line_422(served.decode(x[:1], format="jpeg", channels="rgba"), "format-without-alpha", "JPEG")
    r = served.decode(x[:1], format="png", channels="rgb")
    assert r.status_code == 200 and Image.open(io.BytesIO(r.content)).mode == "RGB", r.text


def test_alpha_of_a_model_without_it_or_a_bad_channels_value_is_a_422(served):
    lat = grid(1, 4, 2, 3)  # TAESD's latents
    assert_one_line_422(served.decode(lat, model="rgb", channels="rgba"), "no-alpha", "rgb")
    r = served.decode(lat, model="rgb")
    assert r.status_code == 200 and from_npy(r.content).shape[-1] == 3, r.text  # its default: RGB
    assert served.decode(grid(1, C, 2, 3), channels="argb").status_code == 422
    body = {"inputs": [{"name": "latents", "datatype": "FP32", "shape": list(lat.shape), "data": lat.ravel().tolist()}],
            "parameters": {"channels": "rgba"}}
    assert_one_line_422(httpx.post(f"{served.base}/v2/models/rgb/infer", json=body, timeout=60), "no-alpha", "rgb")
    body["parameters"] = {"channels": 4}
    assert_one_line_422(httpx.post(f"{served.base}/v2/models/q21/infer", json=body, timeout=60), "bad-channels")
    r = httpx.post(served.remote(), content=grid(1, C, 2, 3).tobytes(), timeout=60,
                   params={"shape": [1, C, 2, 3], "dtype": "float32", "output_type": "pil", "image_format": "jpg",
                           "channels": "rgba"}, headers={"content-type": "tensor/binary", "accept": "image/jpeg"})
    assert_one_line_422(r, "format-without-alpha", "JPEG")
    assert httpx.get(f"{served.base}/v1/models/q21", timeout=30).status_code == 200


def test_kserve_v2_infer_answers_rgba(served):
    meta = httpx.get(f"{served.base}/v2/models/q21", timeout=30).json()
    assert meta["inputs"][0]["shape"] == [-1, C, -1, -1] and meta["outputs"][0]["shape"] == [-1, -1, -1, 4]
    config = httpx.get(f"{served.base}/v2/models/q21/config", timeout=30).json()
    assert config["output"][0]["dims"] == [-1, -1, 4]
    x = grid(1, C, 2, 3)
    expected = served.rgba(x)
    body = {"inputs": [{"name": "latents", "datatype": "FP32", "shape": list(x.shape), "data": x.ravel().tolist()}]}
    for params, channels in (({}, 4), ({"channels": "rgb"}, 3)):
        r = httpx.post(f"{served.base}/v2/models/q21/infer", json={**body, "parameters": params}, timeout=60)
        assert r.status_code == 200, r.text
        out = next(o for o in r.json()["outputs"] if o["name"] == "images")
        images = np.asarray(out["data"], np.float32).reshape(out["shape"])
        assert images.shape == (1, 2 * F, 3 * F, channels)
        assert ref.rel_l2(images, expected[..., :channels]) < TOL


def test_remote_decode_raw_normalised_and_packed(served):
    """A raw `pt` answer is vae.decode(...).sample, all four channels."""
    x = torch.from_numpy(grid(2, C, 1, 2, 4))
    z = served.denormalised(x)
    sample = served.sample(z)
    assert_informative(sample[:, 3] / 2 + 0.5, "the reference's alpha")
    out = remote_decode(served.remote(), z[:, :, 0], do_scaling=False, output_type="pt", return_type="pt")
    assert tuple(out.shape) == tuple(sample.shape) == (2, 4, 2 * F, 4 * F)
    assert ref.rel_l2(out, sample) < TOL and ref.rel_l2(out[:, 3], sample[:, 3]) < TOL
    out = remote_decode(served.remote(), z, do_scaling=False, output_type="pt", return_type="pt")
    assert tuple(out.shape) == (2, 4, 1, 2 * F, 4 * F)  # one-frame latents: the frame axis kept
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


def test_remote_decode_pil_is_the_pipelines_rgba(served):
    """What the pipeline's output_type="pil" gives (VaeImageProcessor.postprocess: RGBA images),
    through each remote_decode answer that carries pixels; diffusers' default JPEG is RGB."""
    x = grid(1, C, 2, 3)
    z = served.denormalised(torch.from_numpy(x))
    processor = VaeImageProcessor(vae_scale_factor=F)
    expected = np.asarray(processor.postprocess(served.sample(z), output_type="pil")[0], np.int16)
    assert expected.shape == (2 * F, 3 * F, 4)
    for kwargs in ({"processor": processor}, {"output_type": "pt", "partial_postprocess": True}):
        image = remote_decode(served.remote(), z[:, :, 0], do_scaling=False, **kwargs)
        image = image[0] if isinstance(image, list) else image  # with a processor: a list of one
        assert image.mode == "RGBA", kwargs
        assert np.abs(np.asarray(image, np.int16) - expected).max() <= 1, kwargs
    assert remote_decode(served.remote(), z[:, :, 0], do_scaling=False).mode == "RGB"  # JPEG
    params = {"shape": list(x.shape), "dtype": "float32", "do_scaling": "true", "output_type": "pil",
              "image_format": "png"}
    r = httpx.post(served.remote(), content=x.tobytes(), params=params, timeout=60,
                   headers={"content-type": "tensor/binary", "accept": "image/png"})
    assert r.status_code == 200 and r.headers["content-type"] == "image/png", r.text
    png = Image.open(io.BytesIO(r.content))
    assert png.mode == "RGBA" and np.abs(np.asarray(png, np.int16) - expected).max() <= 1
    r = httpx.post(served.remote(), content=x.tobytes(), params={**params, "output_type": "pt", "channels": "rgb"},
                   timeout=60, headers={"content-type": "tensor/binary", "accept": "tensor/binary"})
    assert r.status_code == 200 and r.headers["shape"] == f"[1, 3, {2 * F}, {3 * F}]", r.text


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
