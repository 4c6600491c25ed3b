"""Wan 2.2 video VAE decoder vs diffusers' AutoencoderKLWan(is_residual=True, patch_size=2) with
the same random weights, plus the Wan pipelines' de-normalisation.

Each test saves a freshly initialised diffusers model (every parameter randomised) with
`save_pretrained` and loads it through our `build`, so the checkpoint path (names, layouts,
config.json) is what is tested, not a hand-made copy of the weights."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from convkernels import get_backend
from models import ModelOptions, load_model
from models.wan22_vae import PRESETS, Wan22VAEDecoder, build
from models.wan22_vae.layers import dup_up_residual, unpatchify
from models.wan_vae import WanVAEOptions
from models.nn.weights import WeightsError
from torch_reference import assert_informative, fresh_seed, rel_l2

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")
wan_module = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_wan")

COMMON = dict(is_residual=True, in_channels=12, out_channels=12, patch_size=2, scale_factor_spatial=16,
              temperal_downsample=[False, True, True])
# Wan 2.2's layout at test size (every block's width the same: DupUp repeats 8, 8, 2)
WAN22_SMALL = dict(COMMON, base_dim=4, decoder_base_dim=8, z_dim=12, dim_mult=[1, 2, 2, 2], num_res_blocks=1)
# the real [1, 2, 4, 4] multipliers at odd widths (20 -> 20 -> 10 -> 5), two resnets per block
WAN22_ODD = dict(COMMON, base_dim=4, decoder_base_dim=5, z_dim=7, dim_mult=[1, 2, 4, 4], num_res_blocks=2)


@pytest.fixture(autouse=True)
def one_torch_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_reference(tmp_path, config: dict, seed: int):
    """A diffusers AutoencoderKLWan (Wan 2.2 form) with every parameter random, saved as a folder."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    z = config["z_dim"]
    config = {**config, "latents_mean": rng.normal(0, 0.5, z).round(4).tolist(),
              "latents_std": rng.uniform(0.3, 2.0, z).round(4).tolist()}
    vae = diffusers.AutoencoderKLWan(**config).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:  # weights: PyTorch's init, redrawn from this seed
                bound = 1.0 / np.sqrt(max(1, p[0].numel()))
                p.copy_(torch.empty_like(p).uniform_(-bound, bound))
    folder = tmp_path / "wan22_vae"
    vae.save_pretrained(folder)
    return vae, folder, config


def reference_decode(vae, config, latents: np.ndarray, denormalise: bool = True) -> np.ndarray:
    """What the diffusers Wan 2.2 pipeline does: latents / (1 / std) + mean, vae.decode, x / 2 + 0.5
    clamped to [0, 1] (the video processor)."""
    z = torch.from_numpy(latents)
    if denormalise:
        mean = torch.tensor(config["latents_mean"]).view(1, -1, 1, 1, 1)
        std = 1.0 / torch.tensor(config["latents_std"]).view(1, -1, 1, 1, 1)
        z = z / std + mean
    with torch.no_grad():
        video = vae.decode(z).sample  # N, 3, F, H, W in [-1, 1]
    return (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).numpy()


def check_parity(model, vae, config, shapes, seed):
    rng = np.random.default_rng(seed)
    for n, t, h, w in shapes:
        latents = rng.standard_normal((n, config["z_dim"], t, h, w)).astype(np.float32)
        ours = model.decode(latents)
        ref = reference_decode(vae, config, latents)
        assert ours.dtype == np.float32
        assert ours.shape == (n, 1 + 4 * (t - 1), 16 * h, 16 * w, 3)
        assert_informative(ref, f"seed {seed}, latents {(n, t, h, w)}")
        err = rel_l2(ours, ref)
        assert err < 1e-4, f"seed {seed}, latents {(n, t, h, w)}: relative L2 {err:.2e}"
        # vacuity guard: the same reference without the pipeline's de-normalisation is far off
        assert rel_l2(ours, reference_decode(vae, config, latents, denormalise=False)) > 1e-2


@pytest.mark.parametrize("config,shapes", [
    (WAN22_SMALL, [(1, 1, 3, 5), (1, 3, 3, 5)]),
    (WAN22_ODD, [(2, 3, 5, 3)]),
], ids=["wan22-small", "wan22-odd-channels"])
def test_decode_matches_diffusers(tmp_path, config, shapes):
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, config, seed)
    model = build("wan22-test", "tiny-wan2.2-vae", get_backend("numpy"), str(folder))
    assert model.config.decoder_base_dim == config["decoder_base_dim"], "config.json replaces the preset's"
    check_parity(model, vae, config, shapes, seed)


def test_decode_matches_diffusers_on_mlx_backend(tmp_path):
    """Same model code on the MLX backend (Metal on a Mac, CPU elsewhere)."""
    pytest.importorskip("mlx.core")
    try:
        backend = get_backend("mlx")
    except Exception as exc:  # mlx installed but unusable here
        pytest.skip(f"mlx backend unavailable: {exc}")
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, WAN22_ODD, seed)
    model = load_model("wan22-mlx", "tiny-wan2.2-vae", backend, weights=str(folder))
    assert model.card()["backend"] == "mlx"
    check_parity(model, vae, config, [(1, 3, 3, 5)], seed)


def test_single_safetensors_in_diffusers_naming_loads(tmp_path):
    """A bare .safetensors (no config.json) is read with the preset's config (overridden here)."""
    seed = fresh_seed()
    vae, _, config = make_reference(tmp_path, WAN22_SMALL, seed)
    path = tmp_path / "wan22.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(path))
    # the encoder is read too: its width (base_dim) must be the checkpoint's as well
    cfg = {k: config[k] for k in ("base_dim", "decoder_base_dim", "latents_mean", "latents_std")}
    model = build("wan22-file", "tiny-wan2.2-vae", get_backend("numpy"), str(path), ModelOptions(config=cfg))
    assert model.weights_naming == "diffusers" and model.has_encoder
    check_parity(model, vae, config, [(1, 2, 3, 3)], seed)


def test_tiled_decode_matches_diffusers_tiling(tmp_path):
    """64-px tiles every 48 px (4 latents every 3): a 2x3 grid with partial edge tiles, blended in
    the patched pixels as diffusers does."""
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, WAN22_SMALL, seed)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                      tile_sample_stride_height=48, tile_sample_stride_width=48)
    model = build("wan22-tiled", "tiny-wan2.2-vae", get_backend("numpy"), str(folder),
                  WanVAEOptions(tile_sample_min_size=64, tile_sample_stride=48))
    latents = np.random.default_rng(seed).standard_normal((1, config["z_dim"], 2, 5, 7)).astype(np.float32)
    ref = reference_decode(vae, config, latents)
    groups = list(model.decode_frames(latents, tiled=True))
    assert [g.shape[1] for g in groups] == [1, 4]
    err = rel_l2(np.concatenate(groups, axis=1), ref)
    assert err < 1e-4, f"seed {seed}: tiled relative L2 {err:.2e}"
    assert rel_l2(model.decode(latents, tiled=False), ref) > 1e-3  # the tiles really blend


def test_shortcut_and_unpatchify_ops_match_diffusers():
    """DupUp3D (first chunk and later ones) and unpatchify on the backend vs diffusers' modules."""
    b = get_backend("numpy")
    rng = np.random.default_rng(fresh_seed())
    for cin, cout, ft, first in ((6, 6, 2, False), (6, 6, 2, True), (8, 4, 2, False), (6, 3, 1, False)):
        x = rng.standard_normal((2, cin, 3, 4, 5)).astype(np.float32)
        ref = wan_module.DupUp3D(cin, cout, ft, 2)(torch.from_numpy(x), first_chunk=first).numpy()
        r = dup_up_residual(b.asarray(np.ascontiguousarray(x.transpose(0, 2, 3, 4, 1))), cout, ft, 2, first)
        ours = b.to_host(b.shuffled_frames(r))  # as the upsampler's op takes it: frames
        want = ref.transpose(0, 2, 3, 4, 1)
        np.testing.assert_array_equal(ours, want.reshape(-1, *want.shape[2:]))
    x = rng.standard_normal((1, 12, 2, 3, 4)).astype(np.float32)
    ref = wan_module.unpatchify(torch.from_numpy(x), 2).numpy()
    ours = b.to_host(unpatchify(b, b.asarray(np.ascontiguousarray(x.transpose(0, 2, 3, 4, 1))), 2))
    np.testing.assert_array_equal(ours, ref.transpose(0, 2, 3, 4, 1))


def test_decode_frames_streams_groups_that_concatenate_to_decode():
    model = build("tiny", "tiny-wan2.2-vae", get_backend("numpy"), None)
    latents = np.random.default_rng(fresh_seed()).standard_normal((1, 12, 4, 3, 5)).astype(np.float32)
    groups = list(model.decode_frames(latents))
    assert [g.shape[1] for g in groups] == [1, 4, 4, 4]
    whole = model.decode(latents)
    assert whole.shape == (1, 13, 48, 80, 3)
    np.testing.assert_array_equal(np.concatenate(groups, axis=1), whole)
    assert 0.0 <= whole.min() and whole.max() <= 1.0
    u8 = np.concatenate(list(model.decode_frames(latents, uint8=True)), axis=1)
    assert u8.dtype == np.uint8 and np.abs(u8.astype(int) - np.floor(whole * 255 + 0.5)).max() == 0


def test_card_presets_and_refusals(tmp_path):
    model = build("tiny", "tiny-wan2.2-vae", get_backend("numpy"), None)
    assert isinstance(model, Wan22VAEDecoder) and model.kind == "video-decoder"
    assert (model.latent_channels, model.spatial_factor, model.temporal_factor) == (12, 16, 4)
    json.dumps(model.card())
    real = PRESETS["wan2.2-vae"]
    assert (real["z_dim"], real["base_dim"], real["decoder_base_dim"], real["patch_size"]) == (48, 160, 256, 2)
    assert len(real["latents_mean"]) == len(real["latents_std"]) == 48
    # every field of the real preset is one of diffusers' AutoencoderKLWan arguments
    assert set(real) <= set(inspect.signature(diffusers.AutoencoderKLWan.__init__).parameters)
    with pytest.raises(ValueError, match="Wan 2.1"):
        build("x", "tiny-wan2.2-vae", get_backend("numpy"), None, ModelOptions(config={"is_residual": False}))
    with pytest.raises(ValueError, match="out_channels"):
        build("x", "tiny-wan2.2-vae", get_backend("numpy"), None, ModelOptions(config={"out_channels": 3}))
    original = tmp_path / "original.safetensors"
    safetensors_torch.save_file({"decoder.middle.0.residual.0.gamma": torch.ones(4, 1, 1, 1)}, str(original))
    with pytest.raises(WeightsError, match="diffusers naming"):
        build("x", "tiny-wan2.2-vae", get_backend("numpy"), str(original))


def test_a_wan22_checkpoint_under_a_wan21_preset_is_pointed_to_wan22(tmp_path):
    vae, _, _ = make_reference(tmp_path, WAN22_SMALL, fresh_seed())
    path = tmp_path / "wan22.safetensors"
    safetensors_torch.save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(path))
    with pytest.raises(WeightsError, match=r"Wan 2\.2 VAE checkpoint.*wan2\.2-vae"):
        load_model("w", "tiny-wan-vae", get_backend("numpy"), weights=str(path))
