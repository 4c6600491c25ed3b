"""FLUX.2 VAE (diffusers AutoencoderKLFlux2 + the FLUX.2 pipeline's latent handling) on the NumPy
backend and on MLX's CPU device vs diffusers itself, same random weights in every parameter and
random BatchNorm running statistics, through the public load_model path."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS, WeightsError, load_model
from models.autoencoder_kl import AutoencoderKLOptions

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline  # noqa: E402
from torch_reference import assert_informative, fresh_seed, rel_l2

TOL = 1e-4

# 4 levels (spatial factor 8, 16 with the 2x2 patches), odd widths per group; 8 latents -> 32 input channels
SMALL = dict(block_out_channels=(8, 16, 16, 24), layers_per_block=1, norm_num_groups=4, latent_channels=8,
             sample_size=64)
TINY = {k: v for k, v in PRESETS["tiny-flux2-vae"].config.items() if k not in ("down_block_types", "up_block_types")}


def make_flux2_vae(cfg: dict, seed: int):
    """An AutoencoderKLFlux2 with every parameter randomised and BatchNorm running statistics far
    from a fresh layer's 0 / 1, so dropping the de-normalisation shows."""
    n = len(cfg["block_out_channels"])
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLFlux2(down_block_types=("DownEncoderBlock2D",) * n,
                                       up_block_types=("UpDecoderBlock2D",) * n, **cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.mul_(1.0 + 0.1 * torch.randn_like(p))
        vae.bn.running_mean.copy_(0.7 * torch.randn_like(vae.bn.running_mean))
        vae.bn.running_var.copy_(torch.empty_like(vae.bn.running_var).uniform_(0.3, 3.0))
    return vae


def bn_mean_std(vae):
    mean = vae.bn.running_mean.view(1, -1, 1, 1)
    return mean, torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps)


def pipeline_decode(vae, x: np.ndarray, *, clamp: bool = True, denormalise: bool = True) -> np.ndarray:
    """What Flux2Pipeline does with the transformer's latents (after unpacking): de-normalise,
    unpatchify, decode, post-process -> NHWC. denormalise=False: the vacuity guard's broken twin."""
    mean, std = bn_mean_std(vae)
    with torch.no_grad():
        z = torch.from_numpy(x)
        z = z * std + mean if denormalise else z
        out = vae.decode(Flux2Pipeline._unpatchify_latents(z)).sample
    out = (out / 2 + 0.5).clamp(0, 1) if clamp else out / 2 + 0.5
    return out.permute(0, 2, 3, 1).numpy()


def pipeline_encode(vae, images_nhwc: np.ndarray, *, normalise: bool = True) -> np.ndarray:
    """Flux2Pipeline._encode_vae_image: posterior mode (its mean), patchify, normalise."""
    x = torch.from_numpy(images_nhwc).permute(0, 3, 1, 2) * 2 - 1
    mean, std = bn_mean_std(vae)
    with torch.no_grad():
        lat = Flux2Pipeline._patchify_latents(vae.encode(x).latent_dist.mode())
        return ((lat - mean) / std if normalise else lat).numpy()


def backend_named(name: str):
    if name == "mlx":
        pytest.importorskip("mlx.core")
    return get_backend(name)


@pytest.fixture(scope="module")
def small_vae(tmp_path_factory):
    seed = fresh_seed()
    vae = make_flux2_vae(SMALL, seed)
    folder = tmp_path_factory.mktemp("flux2_small")
    vae.save_pretrained(folder)
    return vae, str(folder), seed


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_decode_matches_the_pipeline(small_vae, backend_name):
    vae, folder, seed = small_vae
    model = load_model("f2", "flux2-vae", backend_named(backend_name), weights=folder)
    assert model.kind == "image-decoder" and model.has_encoder
    assert (model.latent_channels, model.spatial_factor) == (4 * SMALL["latent_channels"], 16)
    assert model.card()["packed_latents"] == "row-major tokens"
    rng = np.random.default_rng(seed)
    for n, h, w in [(1, 5, 7), (2, 3, 1)]:
        x = rng.standard_normal((n, model.latent_channels, h, w)).astype(np.float32)
        ours, ref = model.decode(x, tiled=False), pipeline_decode(vae, x)
        assert ours.shape == (n, 16 * h, 16 * w, 3) and ours.dtype == np.float32
        assert_informative(ref, f"seed {seed}")
        err = rel_l2(ours, ref)
        print(f"{backend_name} decode {(n, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{backend_name} {(n, h, w)} seed {seed}: rel L2 {err:.2e}"
        raw_err = rel_l2(model.decode(x, tiled=False, clamp=False), pipeline_decode(vae, x, clamp=False))
        assert raw_err < TOL, f"{backend_name} unclamped {(n, h, w)} seed {seed}: rel L2 {raw_err:.2e}"
        # the vacuity guard: the same comparison against a pipeline without the de-normalisation fails
        broken = rel_l2(ours, pipeline_decode(vae, x, denormalise=False))
        print(f"{backend_name} decode {(n, h, w)} vs a reference without the de-normalisation: {broken:.2e}")
        assert broken > 100 * TOL, f"dropping the BN de-normalisation changes nothing (rel L2 {broken:.2e})"


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_encode_matches_the_pipeline(small_vae, backend_name):
    vae, folder, seed = small_vae
    model = load_model("f2", "flux2-vae", backend_named(backend_name), weights=folder)
    rng = np.random.default_rng(seed)
    # (80, 48): a 5x3 grid of patches; (83, 49): sides not multiples of 16 whose H/8, W/8 floor to even
    for n, h, w in [(1, 80, 48), (2, 83, 49)]:
        img = rng.uniform(0, 1, (n, h, w, 3)).astype(np.float32)
        ours, ref = model.encode(img), pipeline_encode(vae, img)
        assert ours.shape == (n, model.latent_channels, h // 16, w // 16)
        err = rel_l2(ours, ref)
        print(f"{backend_name} encode {(n, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{backend_name} encode {(n, h, w)} seed {seed}: rel L2 {err:.2e}"
        broken = rel_l2(ours, pipeline_encode(vae, img, normalise=False))
        print(f"{backend_name} encode {(n, h, w)} vs a reference without the normalisation: {broken:.2e}")
        assert broken > 100 * TOL, f"dropping the BN normalisation changes nothing (rel L2 {broken:.2e})"
    with pytest.raises(ValueError, match="2x2 patches"):
        model.encode(np.zeros((1, 72, 64, 3), np.float32))  # 72 / 8 = 9 latent rows: no whole patches


def test_tiled_decode_matches_diffusers_tiled(small_vae):
    """Tiles are of the unpatchified latents (what vae.decode sees), as diffusers' tiled decode cuts them."""
    vae, folder, seed = small_vae
    tile = 8
    model = load_model("f2", "flux2-vae", get_backend("numpy"), weights=folder,
                       options=AutoencoderKLOptions(tile_latent_size=tile))
    vae.enable_tiling()
    vae.tile_latent_min_size, vae.tile_sample_min_size = tile, tile * 8
    try:
        x = np.random.default_rng(seed).standard_normal((1, model.latent_channels, 7, 5)).astype(np.float32)
        ours, ref = model.decode(x, tiled=True), pipeline_decode(vae, x)
    finally:
        vae.disable_tiling()
    err = rel_l2(ours, ref)
    untiled_diff = rel_l2(model.decode(x, tiled=False), ref)
    print(f"tiled decode, {tile}-latent tiles: rel L2 {err:.2e} (untiled vs tiled reference {untiled_diff:.2e})")
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"
    assert untiled_diff > 10 * TOL, "the tiles never met: the tiled comparison proves nothing"


def test_tiled_encode_matches_diffusers_tiled(small_vae):
    vae, folder, seed = small_vae
    tile = 8
    model = load_model("f2", "flux2-vae", get_backend("numpy"), weights=folder,
                       options=AutoencoderKLOptions(tile_latent_size=tile))
    vae.enable_tiling()
    vae.tile_latent_min_size, vae.tile_sample_min_size = tile, tile * 8
    try:
        img = np.random.default_rng(seed).uniform(0, 1, (1, 160, 112, 3)).astype(np.float32)
        ours, ref = model.encode(img, tiled=True), pipeline_encode(vae, img)
    finally:
        vae.disable_tiling()
    err = rel_l2(ours, ref)
    print(f"tiled encode, {tile}-latent tiles: rel L2 {err:.2e}")
    assert ours.shape == (1, model.latent_channels, 10, 7)
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"
    assert rel_l2(model.encode(img, tiled=False), ref) > 10 * TOL, "the tiles never met"


def test_single_safetensors_preset_names_and_bn_stats(tmp_path):
    """A lone .safetensors takes its architecture from the preset; BatchNorm's counter is dropped;
    its running statistics are required."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    seed = fresh_seed()
    vae = make_flux2_vae(TINY, seed)
    sd = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}
    assert "bn.num_batches_tracked" in sd
    path = tmp_path / "ae.safetensors"
    safetensors_torch.save_file(sd, str(path))
    model = load_model("f2", "tiny-flux2-vae", get_backend("numpy"), weights=str(path))
    x = np.random.default_rng(seed).standard_normal((1, 128, 3, 5)).astype(np.float32)
    err = rel_l2(model.decode(x), pipeline_decode(vae, x))
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"
    # a whole-pipeline `vae.` prefix loads too
    safetensors_torch.save_file({f"vae.{k}": v for k, v in sd.items()}, str(path))
    assert rel_l2(load_model("f2", "tiny-flux2-vae", get_backend("numpy"), weights=str(path)).decode(x),
                  pipeline_decode(vae, x)) < TOL
    # served under FLUX.1's preset, the error names the right one
    with pytest.raises(WeightsError, match=r"FLUX\.2 VAE checkpoint.*flux2-vae"):
        load_model("f1", "tiny-flux-vae", get_backend("numpy"), weights=str(path))
    safetensors_torch.save_file({k: v for k, v in sd.items() if not k.startswith("bn.")}, str(path))
    with pytest.raises(WeightsError, match=r"bn\.running_mean"):
        load_model("f2", "tiny-flux2-vae", get_backend("numpy"), weights=str(path))


def test_config_json_extra_keys_and_refusals(small_vae, tmp_path):
    _, folder, _ = small_vae
    with open(os.path.join(folder, "config.json")) as f:
        cfg = json.load(f)
    assert cfg["_class_name"] == "AutoencoderKLFlux2"
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "force_upcast": True, "some_future_key": [1, 2]}))
    os.symlink(os.path.join(folder, "diffusion_pytorch_model.safetensors"),
               tmp_path / "diffusion_pytorch_model.safetensors")
    model = load_model("f2", "flux2-vae", get_backend("numpy"), weights=str(tmp_path))
    assert model.config.batch_norm_eps == cfg["batch_norm_eps"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "patch_size": [1, 1]}))
    with pytest.raises(ValueError, match="patch_size"):
        load_model("f2", "flux2-vae", get_backend("numpy"), weights=str(tmp_path))
    with pytest.raises(WeightsError, match="AutoencoderKLFlux2"):  # an FLUX.1 folder is another class
        (tmp_path / "config.json").write_text(json.dumps({**cfg, "_class_name": "AutoencoderKL"}))
        load_model("f2", "flux2-vae", get_backend("numpy"), weights=str(tmp_path))


def test_decoder_block_out_channels(tmp_path):
    """FLUX.2's config may give the decoder widths of its own."""
    seed = fresh_seed()
    vae = make_flux2_vae({**SMALL, "decoder_block_out_channels": (4, 8, 12, 16)}, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("f2", "flux2-vae", get_backend("numpy"), weights=str(tmp_path))
    x = np.random.default_rng(seed).standard_normal((1, model.latent_channels, 3, 4)).astype(np.float32)
    err = rel_l2(model.decode(x), pipeline_decode(vae, x))
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"


def test_tiny_preset_random_init_is_quick():
    import time
    model = load_model("f2", "tiny-flux2-vae", get_backend("numpy"))
    assert model.weights_source == "random init"
    x = np.random.default_rng(0).standard_normal((1, 128, 4, 4)).astype(np.float32)
    t0 = time.perf_counter()
    out = model.decode(x)
    assert out.shape == (1, 64, 64, 3) and np.isfinite(out).all()
    assert model.encode(out).shape == (1, 128, 4, 4)
    assert time.perf_counter() - t0 < 5.0
