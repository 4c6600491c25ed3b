"""The tiny presets on the MLX backend (MLX's CPU device here) vs the independent references
(diffusers AutoencoderKL / AutoencoderKLWan (Wan 2.1 and 2.2), transformers ConvNext), with fresh random weights
saved and loaded through `models.load_model`, built the same way as tests/test_models_*.py."""
from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("mlx.core")
pytest.importorskip("torch")
pytest.importorskip("diffusers")
pytest.importorskip("transformers")

import test_models_convnext as cnx  # noqa: E402
import test_models_vae as vae_ref  # noqa: E402
import test_models_wan as wan_ref  # noqa: E402
import test_models_wan22_vae as wan22_ref  # noqa: E402
from reference_checks import assert_informative  # noqa: E402

from convkernels import get_backend  # noqa: E402
from models import PRESETS, load_model  # noqa: E402


@pytest.fixture
def mlx_backend():
    return get_backend("mlx")


def paths_taken(be) -> set[str]:
    return {c["path"] for c in be.conv_choices()}


@pytest.mark.parametrize("preset", ["tiny-vae", "tiny-flux-vae"])
def test_tiny_image_vae_on_mlx_matches_diffusers(tmp_path, mlx_backend, preset):
    seed = vae_ref.fresh_seed()
    cfg = {k: v for k, v in PRESETS[preset].config.items() if k not in ("down_block_types", "up_block_types")}
    ref_vae = vae_ref.make_vae(cfg, seed)
    ref_vae.save_pretrained(tmp_path)
    model = load_model("vae", preset, mlx_backend, weights=str(tmp_path))
    assert model.card()["backend"] == "mlx"
    lat = np.random.default_rng(seed).standard_normal((1, cfg["latent_channels"], 9, 11)).astype(np.float32)
    ours = model.decode(lat, tiled=False)
    ref = vae_ref.diffusers_decode(ref_vae, lat)
    assert ours.dtype == np.float32 and ours.shape == ref.shape
    assert_informative(ref, f"seed {seed}")
    err = vae_ref.rel_l2(ours, ref)
    assert err < vae_ref.TOL, f"{preset} seed {seed}: rel L2 {err:.2e}"
    assert "mlx_native" in paths_taken(mlx_backend)


def test_tiny_wan_vae_on_mlx_matches_diffusers(tmp_path, mlx_backend):
    seed = wan_ref.fresh_seed()
    cfg = {k: v for k, v in PRESETS["tiny-wan-vae"].config.items()
           if k not in ("latents_mean", "latents_std", "description")}
    ref_vae, folder, cfg = wan_ref.make_reference(tmp_path, cfg, seed)
    model = load_model("wan", "tiny-wan-vae", mlx_backend, weights=str(folder))
    lat = np.random.default_rng(seed).standard_normal((1, cfg["z_dim"], 2, 5, 7)).astype(np.float32)
    ours = model.decode(lat)
    ref = wan_ref.reference_decode(ref_vae, cfg, lat)
    assert ours.shape == (1, 5, 40, 56, 3)
    assert_informative(ref, f"seed {seed}")
    err = wan_ref.rel_l2(ours, ref)
    assert err < 1e-4, f"seed {seed}: rel L2 {err:.2e}"
    assert {c["op"] for c in mlx_backend.conv_choices()} >= {"conv3d"}



def test_tiny_wan22_vae_on_mlx_matches_diffusers(tmp_path, mlx_backend):
    """The tiny Wan 2.2 preset's own config (residual up blocks, 2x2 patches) vs diffusers, T = 3."""
    seed = wan22_ref.fresh_seed()
    cfg = {k: v for k, v in PRESETS["tiny-wan2.2-vae"].config.items() if k not in ("latents_mean", "latents_std")}
    ref_vae, folder, cfg = wan22_ref.make_reference(tmp_path, cfg, seed)
    model = load_model("wan22", "tiny-wan2.2-vae", mlx_backend, weights=str(folder))
    lat = np.random.default_rng(seed).standard_normal((1, cfg["z_dim"], 3, 3, 5)).astype(np.float32)
    ours = model.decode(lat)
    ref = wan22_ref.reference_decode(ref_vae, cfg, lat)
    assert ours.shape == (1, 9, 48, 80, 3)
    assert_informative(ref, f"seed {seed}")
    err = wan22_ref.rel_l2(ours, ref)
    assert err < 1e-4, f"seed {seed}: rel L2 {err:.2e}"


def test_tiny_convnext_on_mlx_matches_transformers(tmp_path_factory, mlx_backend):
    seed = int(np.random.default_rng().integers(1 << 30))
    cfg = PRESETS["tiny-convnext"].config
    arch = {"depths": list(cfg["depths"]), "hidden_sizes": list(cfg["dims"])}
    ref_model, folder = cnx.make_hf(tmp_path_factory, arch, True, seed=seed)
    model = load_model("enc", "tiny-convnext", mlx_backend, weights=str(folder))
    for size in (64, 45):  # 45 -> stage sizes 11, 5, 2, 1: none a multiple of 8
        cnx.check_parity(model, ref_model, size, batch=2, rng_seed=seed)
    assert any(c["groups"] > 1 for c in mlx_backend.conv_choices()), "depthwise convs must have run"
