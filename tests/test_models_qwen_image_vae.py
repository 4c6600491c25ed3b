"""Qwen-Image VAE decoder vs diffusers' AutoencoderKLQwenImage + the Qwen-Image pipeline's latent
handling, with the same random weights.

Each test saves a freshly initialised diffusers model (every parameter drawn afresh, RMS-norm gammas
and biases included) with `save_pretrained` and loads it through our `build`, so the checkpoint path
(names, layouts, config.json) is what is tested. The reference is what QwenImagePipeline does after
unpacking: `latents / (1 / latents_std) + latents_mean`, `vae.decode(...)[0][:, :, 0]`, then the image
processor's x / 2 + 0.5 clamped to [0, 1]."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS as ALL_PRESETS
from models import load_model
from models.qwen_image_vae import PRESETS, QwenImageVAEDecoder, QwenImageVAEOptions, build
from torch_reference import assert_informative, fresh_seed, rel_l2

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

TOL = 1e-4
# the Qwen-Image layout (16 latent channels, time upsampling in the two deepest up blocks), at test size
QWEN_SMALL = dict(base_dim=12, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                  temperal_downsample=[False, True, True])


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


def make_reference(tmp_path, config: dict, seed: int, extra_config: dict | None = None):
    """A diffusers AutoencoderKLQwenImage with every parameter random, non-trivial latents_mean/std,
    saved as a diffusers folder (config.json given `extra_config` keys on top)."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    z = config["z_dim"]
    config = {**config, "latents_mean": rng.normal(0, 0.5, z).round(4).tolist(),
              "latents_std": rng.uniform(0.5, 3.0, z).round(4).tolist()}
    vae = diffusers.AutoencoderKLQwenImage(**config).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:  # weights: U(+-1/sqrt(fan_in)), a fresh draw
                bound = 1.0 / float(np.sqrt(p[0].numel()))
                p.copy_(torch.empty_like(p).uniform_(-bound, bound))
    folder = tmp_path / "qwen_image_vae"
    vae.save_pretrained(folder)
    if extra_config:
        cfg_path = folder / "config.json"
        cfg_path.write_text(json.dumps({**json.loads(cfg_path.read_text()), **extra_config}))
    return vae, folder, config


def reference_decode(vae, config, latents: np.ndarray, denormalise: bool = True) -> np.ndarray:
    """QwenImagePipeline's decode of unpacked latents (N, C, 1, h, w) -> images N, H, W, 3 in [0, 1]."""
    z = torch.from_numpy(latents if latents.ndim == 5 else latents[:, :, None])
    if denormalise:
        c = config["z_dim"]
        latents_mean = torch.tensor(config["latents_mean"]).view(1, c, 1, 1, 1)
        latents_std = 1.0 / torch.tensor(config["latents_std"]).view(1, c, 1, 1, 1)
        z = z / latents_std + latents_mean
    with torch.no_grad():
        image = vae.decode(z, return_dict=False)[0][:, :, 0]  # N, 3, H, W
    return (image / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def reference_encode(vae, config, images_nhwc01: np.ndarray, normalise: bool = True) -> np.ndarray:
    """QwenImageEditPipeline._encode_vae_image on preprocessed images (x * 2 - 1, N, 3, 1, H, W):
    argmax latents, (mean - latents_mean) / latents_std -> N, C, h, w."""
    x = torch.from_numpy(images_nhwc01).permute(0, 3, 1, 2)[:, :, None]
    with torch.no_grad():
        mean = vae.encode(2.0 * x - 1.0).latent_dist.mode()
    if normalise:
        c = config["z_dim"]
        mean = (mean - torch.tensor(config["latents_mean"]).view(1, c, 1, 1, 1)) / \
            torch.tensor(config["latents_std"]).view(1, c, 1, 1, 1)
    return mean[:, :, 0].numpy()


@pytest.mark.parametrize("backend_name", backends())
def test_decode_matches_diffusers_and_the_pipeline(tmp_path, backend_name):
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, QWEN_SMALL, seed)
    model = build("qwen-test", "tiny-qwen-image-vae", get_backend(backend_name), str(folder))
    assert model.card()["backend"] == backend_name
    assert model.config.base_dim == 12, "config.json must replace the preset's architecture"
    rng = np.random.default_rng(seed)
    for shape in [(2, 16, 5, 7), (1, 16, 1, 7, 3)]:  # batch 2, odd sizes; the pipeline's 5-D form
        latents = rng.standard_normal(shape).astype(np.float32)
        ours = model.decode(latents, tiled=False)
        ref = reference_decode(vae, config, latents)
        assert ours.dtype == np.float32 and ours.shape == (shape[0], 8 * shape[-2], 8 * shape[-1], 3)
        assert_informative(ref, f"seed {seed}, {backend_name}, latents {shape}")
        err = rel_l2(ours, ref)
        print(f"{backend_name} {shape}: rel L2 {err:.2e}")
        assert err < TOL, f"seed {seed}, {backend_name}, latents {shape}: relative L2 {err:.2e}"
        # vacuity guard: the same comparison fails against a reference without the de-normalisation
        bare = rel_l2(ours, reference_decode(vae, config, latents, denormalise=False))
        assert bare > 100 * TOL, f"seed {seed}: the de-normalisation is not what the test sees ({bare:.2e})"


def test_published_architecture_matches_diffusers(tmp_path):
    """The qwen-image-vae preset's own architecture (96 base channels, two resnets per block)."""
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, dict(PRESETS["qwen-image-vae"]), seed)
    model = load_model("qi", "qwen-image-vae", get_backend("numpy"), weights=str(folder))
    latents = np.random.default_rng(seed).standard_normal((1, 16, 6, 5)).astype(np.float32)
    ref = reference_decode(vae, config, latents)
    ours = model.decode(latents)
    err = rel_l2(ours, ref)
    print(f"qwen-image-vae (1, 16, 6, 5): rel L2 {err:.2e}")
    assert err < TOL, f"seed {seed}: relative L2 {err:.2e}"
    assert rel_l2(ours, reference_decode(vae, config, latents, denormalise=False)) > 100 * TOL


@pytest.mark.parametrize("backend_name", backends())
def test_encode_matches_diffusers_and_the_edit_pipeline(tmp_path, backend_name):
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, QWEN_SMALL, seed)
    model = build("qwen-test", "tiny-qwen-image-vae", get_backend(backend_name), str(folder))
    assert model.has_encoder and model.card()["has_encoder"] is True
    rng = np.random.default_rng(seed)
    for shape in [(2, 40, 56, 3), (1, 37, 45, 3)]:  # a multiple of 8; odd sides (floored at each 2x)
        images = rng.random(shape, dtype=np.float32)
        ours = model.encode(images)
        ref = reference_encode(vae, config, images)
        assert ours.shape == ref.shape == (shape[0], 16, shape[1] // 8, shape[2] // 8)
        err = rel_l2(ours, ref)
        print(f"{backend_name} encode {shape}: rel L2 {err:.2e}")
        assert err < TOL, f"seed {seed}, {backend_name}, images {shape}: relative L2 {err:.2e}"
        # vacuity guard: the posterior mean without the pipeline's normalisation is not the answer
        assert rel_l2(ours, reference_encode(vae, config, images, normalise=False)) > 100 * TOL


def test_a_checkpoint_without_the_encoder_decodes_only(tmp_path):
    from safetensors.numpy import load_file, save_file

    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, QWEN_SMALL, seed)
    weights = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if not k.startswith(("encoder.", "quant_conv."))}, str(weights))
    model = build("qwen-test", "tiny-qwen-image-vae", get_backend("numpy"), str(folder))
    assert not model.has_encoder and model.card()["has_encoder"] is False
    latents = np.random.default_rng(seed).standard_normal((1, 16, 3, 4)).astype(np.float32)
    assert rel_l2(model.decode(latents), reference_decode(vae, config, latents)) < TOL
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 16, 16, 3), np.float32))


def to_original_wan_names(sd: dict, num_res_blocks: int, num_blocks: int) -> dict:
    """diffusers names -> the original Wan release's (as ComfyUI ships qwen_image_vae.safetensors):
    the Wan tests' decoder inverse plus the encoder's, checked against diffusers' converter."""
    import test_models_wan as wan_ref

    out = wan_ref.to_original_wan_names({k: v for k, v in sd.items() if k.startswith(("decoder.", "post_quant_conv."))},
                                        num_res_blocks=num_res_blocks, num_up_blocks=num_blocks)
    resnet = wan_ref._RESNET_TO_ORIGINAL
    fixed = {"quant_conv.": "conv1.", "encoder.conv_in.": "encoder.conv1.", "encoder.norm_out.": "encoder.head.0.",
             "encoder.conv_out.": "encoder.head.2.", "encoder.mid_block.resnets.0.": "encoder.middle.0.",
             "encoder.mid_block.attentions.0.": "encoder.middle.1.", "encoder.mid_block.resnets.1.": "encoder.middle.2."}
    for name, value in sd.items():
        if name.startswith("encoder.down_blocks."):
            k, rest = name[len("encoder.down_blocks."):].split(".", 1)
            out[f"encoder.downsamples.{k}.{resnet.get(rest, rest)}"] = value  # a resampler's names stay
            continue
        for old, new in fixed.items():
            if name.startswith(old):
                rest = name[len(old):]
                out[new + (resnet[rest] if ".resnets." in old else rest)] = value
    return out


def test_original_wan_checkpoint_names_with_the_encoder(tmp_path):
    """A single .safetensors in the original Wan naming, encoder included, at the real depth
    (diffusers' converter assumes it), read with the preset's config and overrides."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    safetensors_torch = pytest.importorskip("safetensors.torch")
    seed = fresh_seed()
    vae, _, config = make_reference(tmp_path, dict(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                                                   temperal_downsample=[False, True, True]), seed)
    sd = {k: v.contiguous() for k, v in vae.state_dict().items()}
    original = to_original_wan_names(sd, num_res_blocks=2, num_blocks=4)
    assert len(original) == len(sd)
    assert set(convert_wan_vae_to_diffusers(original)) == set(sd), "test fixture disagrees with diffusers"
    path = tmp_path / "qwen_image_vae.safetensors"
    safetensors_torch.save_file(original, str(path))
    model = build("qi", "qwen-image-vae", get_backend("numpy"), str(path), QwenImageVAEOptions(config={
        k: config[k] for k in ("base_dim", "latents_mean", "latents_std")}))
    assert model.card()["weights_naming"] == "original-wan" and model.has_encoder
    rng = np.random.default_rng(seed)
    latents = rng.standard_normal((1, 16, 3, 5)).astype(np.float32)
    assert rel_l2(model.decode(latents), reference_decode(vae, config, latents)) < TOL
    images = rng.random((1, 24, 40, 3), dtype=np.float32)
    assert rel_l2(model.encode(images), reference_encode(vae, config, images)) < TOL


def _tiled_pair(tmp_path, seed):
    """diffusers' model and ours with the same tiling: 64-px tiles every 48 px."""
    vae, folder, config = make_reference(tmp_path, QWEN_SMALL, seed)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                      tile_sample_stride_height=48, tile_sample_stride_width=48)
    model = build("qwen-test", "tiny-qwen-image-vae", get_backend("numpy"), str(folder),
                  QwenImageVAEOptions(tile_sample_min_size=64, tile_sample_stride=48))
    return vae, model, config


def test_tiled_decode_matches_diffusers_tiling(tmp_path):
    seed = fresh_seed()
    vae, model, config = _tiled_pair(tmp_path, seed)
    latents = np.random.default_rng(seed).standard_normal((2, 16, 13, 11)).astype(np.float32)
    ours = model.decode(latents, tiled=True)
    ref = reference_decode(vae, config, latents)
    assert_informative(ref, f"seed {seed}")
    err = rel_l2(ours, ref)
    assert err < TOL, f"seed {seed}: tiled relative L2 {err:.2e}"
    untiled = model.decode(latents, tiled=False)
    assert rel_l2(untiled, ref) > 10 * err, "the tiles must matter for this comparison"


def test_tiled_encode_matches_diffusers_tiling(tmp_path):
    seed = fresh_seed()
    vae, model, config = _tiled_pair(tmp_path, seed)
    images = np.random.default_rng(seed).random((2, 104, 136, 3), dtype=np.float32)  # 3 x 3 tiles
    ours = model.encode(images, tiled=True)
    ref = reference_encode(vae, config, images)
    assert ours.shape == ref.shape == (2, 16, 13, 17)
    err = rel_l2(ours, ref)
    assert err < TOL, f"seed {seed}: tiled relative L2 {err:.2e}"
    untiled = model.encode(images, tiled=False)
    assert rel_l2(untiled, ref) > 10 * err, "the tiles must matter for this comparison"
    assert rel_l2(model.encode(images[:, :64, :64], tiled=True), reference_encode(vae, config, images[:, :64, :64])) \
        < TOL, "one tile's worth is encoded whole, as diffusers does"


def test_extra_config_keys_are_tolerated(tmp_path):
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, QWEN_SMALL, seed,
                                         extra_config={"some_future_field": [1, 2], "scale_factor_spatial": 8})
    model = build("qwen-test", "tiny-qwen-image-vae", get_backend("numpy"), str(folder))
    assert list(model.config.latents_std) == config["latents_std"]
    latents = np.random.default_rng(seed).standard_normal((1, 16, 3, 4)).astype(np.float32)
    assert rel_l2(model.decode(latents), reference_decode(vae, config, latents)) < TOL


def test_published_preset_is_diffusers_defaults():
    params = inspect.signature(diffusers.AutoencoderKLQwenImage.__init__).parameters
    preset = PRESETS["qwen-image-vae"]
    for key, value in preset.items():
        default = params[key].default
        assert (list(default) if isinstance(default, (list, tuple)) else default) == value, key
    assert ALL_PRESETS["qwen-image-vae"].kind == "image-decoder"
    assert ALL_PRESETS["tiny-qwen-image-vae"].tiny


def test_tiny_preset_card_shapes_and_bad_latents():
    model = load_model("q", "tiny-qwen-image-vae", get_backend("numpy"))
    assert isinstance(model, QwenImageVAEDecoder) and model.kind == "image-decoder"
    assert model.has_encoder and model.latent_channels == 16 and model.spatial_factor == 8
    card = model.card()
    assert card["single_frame_latents"] is True and card["has_encoder"] is True
    assert card["config"]["latents_mean"] == PRESETS["tiny-qwen-image-vae"]["latents_mean"]
    x = np.random.default_rng(0).standard_normal((2, 16, 5, 3)).astype(np.float32)
    out = model.decode(x)
    assert out.shape == (2, 40, 24, 3) and 0 <= out.min() and out.max() <= 1
    np.testing.assert_array_equal(model.decode(x[:, :, None]), out)
    assert model.decode(x, uint8=True).dtype == np.uint8
    for bad in (x[:, :8], np.repeat(x[:, :, None], 2, axis=2), x[0, 0]):
        with pytest.raises(ValueError):
            model.decode(bad)
    assert model.encode(out).shape == (2, 16, 5, 3)
    for bad in (out[..., :2], out[:, :7], out[0]):
        with pytest.raises(ValueError):
            model.encode(bad)
