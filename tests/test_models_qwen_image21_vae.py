"""Qwen-Image 2.1 VAE vs diffusers' AutoencoderKLQwenImage21 + the Qwen-Image 2.1 pipeline's latent
handling, with the same random weights in every parameter, on NumPy and on MLX's CPU device.

Each test saves a freshly initialised diffusers model with `save_pretrained` and loads it through our
`build`, so the checkpoint path (names, the 2-D conv layouts, config.json) is what is tested. The
reference is what QwenImage21Pipeline does after _unpack_latents: `latents * latents_std +
latents_mean`, `vae.decode(...)[0][:, :, 0]`, then the image processor's x / 2 + 0.5 clamped to [0, 1]
(RGBA: the class reads and writes four channels); encode is its _encode_vae_image (argmax latents,
(mean - latents_mean) / latents_std)."""
from __future__ import annotations

import inspect
import json
import time

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS as ALL_PRESETS
from models import ModelConfigError, WeightsError, load_model
from models.qwen_image21_vae import PRESETS, QwenImage21VAEModel, QwenImage21VAEOptions, build
from torch_reference import assert_informative, fresh_seed, rel_l2

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

TOL = 1e-4
# the published layout (five levels, dim_mult 1, 2, 4, 8, 8, two resnets, time flags, a decoder wider
# than the encoder, RGBA) at 1/48 of its widths
SMALL = dict(base_dim=2, decoder_base_dim=3, z_dim=8, dim_mult=[1, 2, 4, 8, 8], num_res_blocks=2,
             temperal_downsample=[False, True, True, True], in_channels=4, out_channels=4)
TINY = {k: v for k, v in PRESETS["tiny-qwen-image2.1-vae"].items() if k not in ("latents_mean", "latents_std")}


@pytest.fixture(autouse=True)
def one_torch_thread():
    """2 shared cores: torch's thread pool oversubscribed runs diffusers' small ops far slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def backends() -> list:
    names = ["numpy"]
    try:
        import mlx.core  # noqa: F401
        names.append("mlx")
    except ImportError:
        pass
    return names


def make_reference(folder, config: dict, seed: int):
    """A diffusers AutoencoderKLQwenImage21 with every parameter random (gammas and biases off their
    init), non-trivial latents_mean/std, saved as a diffusers folder."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    z = config["z_dim"]
    config = {**config, "latents_mean": rng.normal(0, 0.5, z).round(4).tolist(),
              "latents_std": rng.uniform(0.5, 3.0, z).round(4).tolist()}
    vae = diffusers.AutoencoderKLQwenImage21(**config).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:  # weights: U(+-1/sqrt(fan_in)), a fresh draw
                bound = 1.0 / float(np.sqrt(p[0].numel()))
                p.copy_(torch.empty_like(p).uniform_(-bound, bound))
    vae.save_pretrained(folder)
    return vae, str(folder), config


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    seed = fresh_seed()
    return (*make_reference(tmp_path_factory.mktemp("qwen21_small"), SMALL, seed), seed)


def _stats(config):
    c = config["z_dim"]
    return (torch.tensor(config["latents_mean"]).view(1, c, 1, 1, 1),
            torch.tensor(config["latents_std"]).view(1, c, 1, 1, 1))


def reference_decode(vae, config, latents: np.ndarray, denormalise: bool = True) -> np.ndarray:
    """QwenImage21Pipeline's decode of unpacked latents -> RGBA images N, H, W, 4 in [0, 1]."""
    z = torch.from_numpy(latents if latents.ndim == 5 else latents[:, :, None])
    if denormalise:
        mean, std = _stats(config)
        z = z * std + mean
    with torch.no_grad():
        image = vae.decode(z, return_dict=False)[0][:, :, 0]
    return (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def reference_encode(vae, config, images_nhwc01: np.ndarray, normalise: bool = True) -> np.ndarray:
    """QwenImage21Pipeline._encode_vae_image on RGBA images preprocessed to [-1, 1] -> N, C, h, w."""
    x = torch.from_numpy(images_nhwc01).permute(0, 3, 1, 2)[:, :, None]
    with torch.no_grad():
        mean = vae.encode(2.0 * x - 1.0).latent_dist.mode()
    if normalise:
        lat_mean, lat_std = _stats(config)
        mean = (mean - lat_mean) / lat_std
    return mean[:, :, 0].numpy()


@pytest.mark.parametrize("backend_name", backends())
def test_decode_matches_diffusers_and_the_pipeline(small, backend_name):
    vae, folder, config, seed = small
    model = build("q21", "qwen-image2.1-vae", get_backend(backend_name), folder)
    assert model.card()["backend"] == backend_name and model.config.decoder_base_dim == 3
    assert (model.latent_channels, model.spatial_factor) == (8, 16)
    rng = np.random.default_rng(seed)
    for shape in [(2, 8, 3, 5), (1, 8, 1, 5, 3)]:  # batch 2, odd sizes; the pipeline's 5-D form
        latents = rng.standard_normal(shape).astype(np.float32)
        rgba, ref = model.decode_rgba(latents, tiled=False), reference_decode(vae, config, latents)
        assert rgba.dtype == np.float32 and rgba.shape == ref.shape == (shape[0], 16 * shape[-2], 16 * shape[-1], 4)
        assert_informative(ref, f"seed {seed}, {backend_name}, latents {shape}")
        err = rel_l2(rgba, ref)
        alpha_err = rel_l2(rgba[..., 3], ref[..., 3])
        print(f"{backend_name} {shape}: rel L2 {err:.2e} (alpha {alpha_err:.2e})")
        assert err < TOL and alpha_err < TOL, f"seed {seed}, {backend_name}, latents {shape}: {err:.2e}"
        rgb = model.decode(latents, tiled=False)
        assert rgb.shape == (*ref.shape[:3], 3) and rgb.flags.c_contiguous
        np.testing.assert_array_equal(rgb, rgba[..., :3])
        # vacuity guard: the same comparison fails against a reference without the de-normalisation
        bare = rel_l2(rgba, reference_decode(vae, config, latents, denormalise=False))
        assert bare > 100 * TOL, f"seed {seed}: the de-normalisation is not what the test sees ({bare:.2e})"


@pytest.mark.parametrize("backend_name", backends())
def test_encode_matches_diffusers_and_the_pipeline(small, backend_name):
    vae, folder, config, seed = small
    model = build("q21", "qwen-image2.1-vae", get_backend(backend_name), folder)
    assert model.has_encoder and model.card()["has_encoder"] is True
    rng = np.random.default_rng(seed)
    rgba = rng.random((2, 32, 48, 4), dtype=np.float32)
    ours, ref = model.encode(rgba), reference_encode(vae, config, rgba)
    assert ours.shape == ref.shape == (2, 8, 2, 3)
    err = rel_l2(ours, ref)
    print(f"{backend_name} encode RGBA: rel L2 {err:.2e}")
    assert err < TOL, f"seed {seed}, {backend_name}: relative L2 {err:.2e}"
    assert rel_l2(ours, reference_encode(vae, config, rgba, normalise=False)) > 100 * TOL
    # RGB is the pipeline's convert("RGBA"): alpha 1
    opaque = np.concatenate([rgba[..., :3], np.ones_like(rgba[..., :1])], axis=-1)
    assert rel_l2(model.encode(rgba[..., :3]), reference_encode(vae, config, opaque)) < TOL
    for bad in (rgba[:, :24], rgba[..., :2], rgba[0]):  # 24 rows: not a multiple of 16
        with pytest.raises(ValueError):
            model.encode(bad)


def test_tiled_decode_and_encode_match_diffusers_tiling(small):
    vae, folder, config, seed = small
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                      tile_sample_stride_height=48, tile_sample_stride_width=48)
    try:
        model = build("q21", "qwen-image2.1-vae", get_backend("numpy"), folder,
                      QwenImage21VAEOptions(tile_sample_min_size=64, tile_sample_stride=48))
        rng = np.random.default_rng(seed)
        latents = rng.standard_normal((1, 8, 7, 6)).astype(np.float32)  # 3 x 2 tiles of 4 latents every 3
        ours, ref = model.decode_rgba(latents, tiled=True), reference_decode(vae, config, latents)
        err = rel_l2(ours, ref)
        print(f"tiled decode: rel L2 {err:.2e}")
        assert err < TOL, f"seed {seed}: tiled relative L2 {err:.2e}"
        assert rel_l2(model.decode_rgba(latents, tiled=False), ref) > 10 * err, "the tiles must matter"
        images = rng.random((1, 112, 96, 4), dtype=np.float32)  # 3 x 2 tiles
        enc, enc_ref = model.encode(images, tiled=True), reference_encode(vae, config, images)
        assert enc.shape == enc_ref.shape == (1, 8, 7, 6)
        enc_err = rel_l2(enc, enc_ref)
        print(f"tiled encode: rel L2 {enc_err:.2e}")
        assert enc_err < TOL, f"seed {seed}: tiled encode relative L2 {enc_err:.2e}"
        assert rel_l2(model.encode(images, tiled=False), enc_ref) > 10 * enc_err, "the tiles must matter"
    finally:
        vae.disable_tiling()


def _refolder(tmp_path, name: str, sd: dict, config: dict) -> str:
    safetensors_torch = pytest.importorskip("safetensors.torch")
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file({k: v.detach().contiguous() for k, v in sd.items()},
                                str(folder / "diffusion_pytorch_model.safetensors"))
    return str(folder)


def test_decoder_only_and_strict_loading(small, tmp_path):
    vae, folder, config, seed = small
    with open(f"{folder}/config.json") as f:
        file_cfg = json.load(f)
    assert file_cfg["_class_name"] == "AutoencoderKLQwenImage21"
    sd = vae.state_dict()
    backend = get_backend("numpy")
    decoder_only = {k: v for k, v in sd.items() if k.startswith(("decoder.", "post_quant_conv."))}
    model = build("q21", "qwen-image2.1-vae", backend, _refolder(tmp_path, "dec", decoder_only, file_cfg))
    assert not model.has_encoder and model.card()["has_encoder"] is False
    latents = np.random.default_rng(seed).standard_normal((1, 8, 2, 3)).astype(np.float32)
    assert rel_l2(model.decode_rgba(latents), reference_decode(vae, config, latents)) < TOL
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 16, 16, 3), np.float32))
    gone = "decoder.up_blocks.1.upsampler.resample.1.weight"
    missing = {k: v for k, v in sd.items() if k != gone}
    with pytest.raises(WeightsError, match=r"missing \(1\): " + gone.replace(".", r"\.")):
        build("q21", "qwen-image2.1-vae", backend, _refolder(tmp_path, "miss", missing, file_cfg))
    # a Wan-style 3-D causal conv weight where the class has a 2-D one: named, with both shapes
    wan_shaped = {**sd, "decoder.conv_in.weight": sd["decoder.conv_in.weight"][:, :, None].repeat(1, 1, 3, 1, 1)}
    with pytest.raises(WeightsError, match=r"decoder\.conv_in\.weight"):
        build("q21", "qwen-image2.1-vae", backend, _refolder(tmp_path, "shape", wan_shaped, file_cfg))
    partial_encoder = {k: v for k, v in sd.items() if k != "encoder.conv_in.weight"}
    with pytest.raises(WeightsError, match=r"encoder\.conv_in\.weight"):
        build("q21", "qwen-image2.1-vae", backend, _refolder(tmp_path, "partial", partial_encoder, file_cfg))
    with pytest.raises(WeightsError, match="AutoencoderKLQwenImage21"):
        build("q21", "qwen-image2.1-vae", backend,
              _refolder(tmp_path, "other", sd, {**file_cfg, "_class_name": "AutoencoderKLQwenImage"}))


def test_configs_the_pipeline_cannot_run_are_refused():
    backend = get_backend("numpy")
    for bad, what in [({"in_channels": 3, "out_channels": 3}, "RGBA"), ({"is_residual": False}, "is_residual"),
                      ({"patch_size": 2}, "patch_size"), ({"scale_factor_spatial": 8}, "scale_factor_spatial"),
                      ({"temperal_downsample": [False, True]}, "temperal_downsample")]:
        with pytest.raises(ModelConfigError, match=what):
            load_model("q", "tiny-qwen-image2.1-vae", backend, options=QwenImage21VAEOptions(config=bad))


def test_published_preset_is_diffusers_defaults():
    params = inspect.signature(diffusers.AutoencoderKLQwenImage21.__init__).parameters
    preset = PRESETS["qwen-image2.1-vae"]
    assert set(preset) == set(params) - {"self"}
    for key, value in preset.items():
        default = params[key].default
        assert (list(default) if isinstance(default, (list, tuple)) else default) == value, key
    assert ALL_PRESETS["qwen-image2.1-vae"].kind == "image-decoder"
    assert ALL_PRESETS["tiny-qwen-image2.1-vae"].tiny


def test_tiny_preset_matches_diffusers_card_and_bad_latents(tmp_path):
    model = load_model("q", "tiny-qwen-image2.1-vae", get_backend("numpy"))
    assert isinstance(model, QwenImage21VAEModel) and model.kind == "image-decoder"
    assert model.has_encoder and model.latent_channels == 8 and model.spatial_factor == 16
    card = model.card()
    assert card["single_frame_latents"] is True and card["pixel_channels"] == {"decoded": 4, "served": 4, "on_request": 3}
    assert model.decodes_alpha is True  # models/contract.py AlphaDecoder: the service serves decode_rgba
    x = np.random.default_rng(0).standard_normal((2, 8, 5, 3)).astype(np.float32)
    t0 = time.perf_counter()
    out = model.decode(x)
    assert out.shape == (2, 80, 48, 3) and 0 <= out.min() and out.max() <= 1
    assert time.perf_counter() - t0 < 5.0
    np.testing.assert_array_equal(model.decode(x[:, :, None]), out)
    assert model.decode(x, uint8=True).dtype == np.uint8 and model.decode(x, uint8=True).shape == out.shape
    for bad in (x[:, :4], np.repeat(x[:, :, None], 2, axis=2), x[0, 0]):
        with pytest.raises(ValueError):
            model.decode(bad)
    assert model.encode(out).shape == (2, 8, 5, 3)
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path / "tiny", TINY, seed)
    model = build("q", "tiny-qwen-image2.1-vae", get_backend("numpy"), folder)
    assert rel_l2(model.decode_rgba(x), reference_decode(vae, config, x)) < TOL, f"seed {seed}"
