"""HunyuanImage 2.1 VAE (diffusers AutoencoderKLHunyuanImage + the HunyuanImage pipeline's latent
scaling) on the NumPy backend and on MLX's CPU device vs diffusers itself, same random weights in
every parameter, through the public load_model path: decode, encode, diffusers' tiled decode,
decoder-only and full checkpoints with strict loading, config refusals."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS, ModelConfigError, WeightsError, load_model
from models.hunyuanimage_vae import HunyuanImageVAEOptions

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from torch_reference import assert_informative, fresh_seed, rel_l2  # noqa: E402

TOL = 1e-4

# 4 levels (spatial factor 8): upsamples 128->64 (x repeated 2), 64->64 (4), 64->32 (2); downsamples
# average 2, 4, 2 channels; conv_in repeats the 16 latents 8 times, the encoder head averages 4
SMALL = dict(in_channels=3, out_channels=3, latent_channels=16, block_out_channels=(32, 64, 64, 128),
             layers_per_block=1, spatial_compression_ratio=8, sample_size=64, scaling_factor=0.75289)
TINY = dict(PRESETS["tiny-hunyuanimage-vae"].config)


def make_vae(cfg: dict, seed: int):
    """An AutoencoderKLHunyuanImage with every parameter moved off its init (biases nonzero, norms
    off identity), so a layer loaded wrong or skipped shows."""
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLHunyuanImage(**cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.copy_(p * (1.0 + 0.1 * torch.randn_like(p)) + 0.02 * torch.randn_like(p))
    return vae


def pipeline_decode(vae, x: np.ndarray, *, clamp: bool = True, descale: bool = True) -> np.ndarray:
    """HunyuanImagePipeline's last step: latents / scaling_factor, vae.decode, postprocess -> NHWC.
    descale=False: the vacuity guard's broken twin."""
    with torch.no_grad():
        z = torch.from_numpy(x)
        out = vae.decode(z / vae.config.scaling_factor if descale else z).sample
    out = (out / 2 + 0.5).clamp(0, 1) if clamp else out / 2 + 0.5
    return out.permute(0, 2, 3, 1).numpy()


def pipeline_encode(vae, images_nhwc: np.ndarray, *, scale: bool = True) -> np.ndarray:
    """The posterior mode (its mean) times scaling_factor, as the pipelines hand latents on."""
    x = torch.from_numpy(images_nhwc).permute(0, 3, 1, 2) * 2 - 1
    with torch.no_grad():
        lat = vae.encode(x).latent_dist.mode()
    return (lat * vae.config.scaling_factor if scale else lat).numpy()


def backend_named(name: str):
    if name == "mlx":
        pytest.importorskip("mlx.core")
    return get_backend(name)


@pytest.fixture(scope="module")
def small_vae(tmp_path_factory):
    seed = fresh_seed()
    vae = make_vae(SMALL, seed)
    folder = tmp_path_factory.mktemp("hunyuanimage_small")
    vae.save_pretrained(folder)
    return vae, str(folder), seed


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_decode_matches_the_pipeline(small_vae, backend_name):
    vae, folder, seed = small_vae
    model = load_model("h", "hunyuanimage2.1-vae", backend_named(backend_name), weights=folder)
    assert model.kind == "image-decoder" and model.has_encoder
    assert (model.latent_channels, model.spatial_factor) == (16, 8)
    rng = np.random.default_rng(seed)
    for n, h, w in [(2, 5, 3), (1, 3, 7)]:
        x = rng.standard_normal((n, model.latent_channels, h, w)).astype(np.float32)
        ours, ref = model.decode(x, tiled=False), pipeline_decode(vae, x)
        assert ours.shape == (n, 8 * h, 8 * w, 3) and ours.dtype == np.float32
        assert_informative(ref, f"seed {seed}")
        err = rel_l2(ours, ref)
        print(f"{backend_name} decode {(n, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{backend_name} {(n, h, w)} seed {seed}: rel L2 {err:.2e}"
        raw_err = rel_l2(model.decode(x, tiled=False, clamp=False), pipeline_decode(vae, x, clamp=False))
        assert raw_err < TOL, f"{backend_name} unclamped {(n, h, w)} seed {seed}: rel L2 {raw_err:.2e}"
        # the vacuity guard: the same comparison against a pipeline without / scaling_factor fails
        broken = rel_l2(ours, pipeline_decode(vae, x, descale=False))
        print(f"{backend_name} decode {(n, h, w)} vs a reference without the de-scaling: {broken:.2e}")
        assert broken > 100 * TOL, f"dropping the de-scaling changes nothing (rel L2 {broken:.2e})"


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_encode_matches_the_pipeline(small_vae, backend_name):
    vae, folder, seed = small_vae
    model = load_model("h", "hunyuanimage2.1-vae", backend_named(backend_name), weights=folder)
    img = np.random.default_rng(seed).uniform(0, 1, (2, 40, 24, 3)).astype(np.float32)
    ours, ref = model.encode(img), pipeline_encode(vae, img)
    assert ours.shape == (2, 16, 5, 3)
    err = rel_l2(ours, ref)
    print(f"{backend_name} encode: rel L2 {err:.2e}")
    assert err < TOL, f"{backend_name} encode seed {seed}: rel L2 {err:.2e}"
    broken = rel_l2(ours, pipeline_encode(vae, img, scale=False))
    assert broken > 100 * TOL, f"dropping the scaling changes nothing (rel L2 {broken:.2e})"
    with pytest.raises(ValueError, match="multiples of 8"):
        model.encode(np.zeros((1, 36, 24, 3), np.float32))
    with pytest.raises(ValueError, match="tiled encode is not offered"):
        model.encode(img, tiled=True)


def test_tiled_decode_matches_diffusers_tiled(small_vae):
    vae, folder, seed = small_vae
    tile = 4  # 32-pixel tiles, overlap 8 pixels / 1 latent
    model = load_model("h", "hunyuanimage2.1-vae", get_backend("numpy"), weights=folder,
                       options=HunyuanImageVAEOptions(tile_latent_size=tile))
    vae.enable_tiling(tile_sample_min_size=tile * 8)
    try:
        x = np.random.default_rng(seed).standard_normal((1, 16, 7, 5)).astype(np.float32)
        ours, ref = model.decode(x, tiled=True), pipeline_decode(vae, x)
    finally:
        vae.disable_tiling()
    err = rel_l2(ours, ref)
    untiled_diff = rel_l2(model.decode(x, tiled=False), ref)
    print(f"tiled decode, {tile}-latent tiles: rel L2 {err:.2e} (untiled vs tiled reference {untiled_diff:.2e})")
    assert ours.shape == ref.shape == (1, 56, 40, 3)
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"
    assert untiled_diff > 10 * TOL, "the tiles never met: the tiled comparison proves nothing"


def _folder(tmp_path, name: str, sd: dict, config: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file({k: v.detach().contiguous() for k, v in sd.items()},
                                str(folder / "diffusion_pytorch_model.safetensors"))
    return str(folder)


def test_decoder_only_and_strict_loading(small_vae, tmp_path):
    vae, folder, seed = small_vae
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["_class_name"] == "AutoencoderKLHunyuanImage"
    sd = vae.state_dict()
    decoder_only = {k: v for k, v in sd.items() if k.startswith("decoder.")}
    model = load_model("h", "hunyuanimage2.1-vae", get_backend("numpy"),
                       weights=_folder(tmp_path, "dec", decoder_only, config))
    assert not model.has_encoder and model.card()["has_encoder"] is False
    x = np.random.default_rng(seed).standard_normal((1, 16, 3, 4)).astype(np.float32)
    assert rel_l2(model.decode(x), pipeline_decode(vae, x)) < TOL, f"seed {seed}"
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 16, 16, 3), np.float32))
    missing = {k: v for k, v in sd.items() if k != "decoder.up_blocks.2.conv.weight"}
    with pytest.raises(WeightsError, match=r"missing \(1\): decoder\.up_blocks\.2\.conv\.weight"):
        load_model("h", "hunyuanimage2.1-vae", get_backend("numpy"), weights=_folder(tmp_path, "miss", missing, config))
    extra = {**sd, "decoder.up_blocks.3.conv_shortcut.weight": torch.zeros(3)}
    with pytest.raises(WeightsError, match=r"unexpected \(1\): decoder\.up_blocks\.3\.conv_shortcut\.weight"):
        load_model("h", "hunyuanimage2.1-vae", get_backend("numpy"), weights=_folder(tmp_path, "extra", extra, config))
    partial_encoder = {k: v for k, v in sd.items() if k != "encoder.conv_in.weight"}
    with pytest.raises(WeightsError, match=r"encoder\.conv_in\.weight"):
        load_model("h", "hunyuanimage2.1-vae", get_backend("numpy"),
                   weights=_folder(tmp_path, "partial", partial_encoder, config))
    with pytest.raises(WeightsError, match="AutoencoderKLHunyuanImage"):
        load_model("h", "hunyuanimage2.1-vae", get_backend("numpy"),
                   weights=_folder(tmp_path, "other", sd, {**config, "_class_name": "AutoencoderKL"}))


def test_configs_diffusers_cannot_run_are_refused():
    backend = get_backend("numpy")
    for bad, what in [({"block_out_channels": [32, 48]}, "multiples of 32"),
                      ({"upsample_match_channel": False}, "change width"),
                      ({"spatial_compression_ratio": 8}, "spatial_compression_ratio"),
                      ({"latent_channels": 48}, "latent_channels")]:
        with pytest.raises(ModelConfigError, match=what):
            load_model("h", "tiny-hunyuanimage-vae", backend, options=HunyuanImageVAEOptions(config=bad))


def test_tiny_preset_matches_diffusers_and_is_quick(tmp_path):
    import time
    model = load_model("h", "tiny-hunyuanimage-vae", get_backend("numpy"))
    assert model.weights_source == "random init" and model.spatial_factor == 4
    x = np.random.default_rng(0).standard_normal((1, 16, 8, 8)).astype(np.float32)
    t0 = time.perf_counter()
    out = model.decode(x)
    assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all()
    assert model.encode(out).shape == (1, 16, 8, 8)
    assert time.perf_counter() - t0 < 5.0
    seed = fresh_seed()
    vae = make_vae(TINY, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("h", "tiny-hunyuanimage-vae", get_backend("numpy"), weights=str(tmp_path))
    assert rel_l2(model.decode(x), pipeline_decode(vae, x)) < TOL, f"seed {seed}"
