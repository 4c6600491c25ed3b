"""HunyuanVideo 1.5 VAE decoder (diffusers AutoencoderKLHunyuanVideo15 + the HunyuanVideo 1.5
pipeline's latent scaling) on the NumPy backend and on MLX's CPU device vs diffusers itself, same
random weights in every parameter, through the public load_model path: the chunked decode (odd sizes,
batches compared per sample: diffusers' own attention mask fails for a batch of 2), its streamed frame
groups, diffusers' tiled decode, a width-changing config, strict loading and config refusals."""
from __future__ import annotations

import json

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS, ModelConfigError, WeightsError, load_model
from models.hunyuanvideo15_vae import HunyuanVideo15VAEOptions
from models.wan_vae.chunk_plan import ChunkPlan

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from torch_reference import assert_informative, fresh_seed, rel_l2  # noqa: E402

TOL = 1e-4
PRESET = "tiny-hunyuanvideo1.5-vae"
#: 8 latent channels, 8x space (two temporal+spatial upsamplers 64->32, 32->32, then a spatial-only
#: one 32->16), 4x time: every kind of upsampler and shortcut repeat the real VAE has
TINY = dict(PRESETS[PRESET].config)
C = TINY["latent_channels"]


def make_vae(cfg: dict, seed: int):
    """An AutoencoderKLHunyuanVideo15 with every parameter moved off its init (biases nonzero, RMS
    gammas off one), so a layer loaded wrong or skipped shows."""
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLHunyuanVideo15(**cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(p * (1.0 + 0.1 * torch.randn_like(p)) + 0.02 * torch.randn_like(p))
    return vae


def pipeline_decode(vae, x: np.ndarray, *, clamp: bool = True, descale: bool = True) -> np.ndarray:
    """HunyuanVideo15Pipeline's last step, one sample at a time (diffusers' decode of a batch of 2
    fails in its attention mask): latents / scaling_factor, vae.decode, x / 2 + 0.5 (clamped) ->
    N,F,H,W,3. descale=False: the vacuity guard's broken twin."""
    outs = []
    with torch.no_grad():
        for sample in np.split(x, x.shape[0]):
            z = torch.from_numpy(sample)
            outs.append(vae.decode(z / vae.config.scaling_factor if descale else z).sample)
    out = torch.cat(outs) / 2 + 0.5
    return (out.clamp(0, 1) if clamp else out).permute(0, 2, 3, 4, 1).numpy()


def backend_named(name: str):
    if name == "mlx":
        pytest.importorskip("mlx.core")
    return get_backend(name)


def latents(rng, *shape) -> np.ndarray:
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    seed = fresh_seed()
    # a scaling factor far from the real 1.03682, so that a decode that skipped the de-scaling is
    # far from the reference whatever the seed (at 1.03682 it moved the output by ~1e-2 only)
    vae = make_vae({**TINY, "scaling_factor": 0.55}, seed)
    folder = tmp_path_factory.mktemp("hunyuanvideo15_tiny")
    vae.save_pretrained(folder)
    return vae, str(folder), seed


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_decode_matches_the_pipeline(tiny_vae, backend_name):
    vae, folder, seed = tiny_vae
    model = load_model("h", PRESET, backend_named(backend_name), weights=folder)
    assert model.kind == "video-decoder" and model.has_encoder  # the encoder: test_models_hunyuanvideo15_vae_encoder.py
    assert (model.latent_channels, model.spatial_factor, model.temporal_factor) == (C, 8, 4)
    rng = np.random.default_rng(seed)
    for n, t, h, w in [(2, 2, 5, 3), (1, 1, 3, 4)]:
        x = latents(rng, n, C, t, h, w)
        ours, ref = model.decode(x, tiled=False), pipeline_decode(vae, x)
        assert ours.shape == (n, 1 + 4 * (t - 1), 8 * h, 8 * w, 3) and ours.dtype == np.float32
        assert_informative(ref, f"seed {seed}")
        err = rel_l2(ours, ref)
        print(f"{backend_name} decode {(n, t, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{backend_name} {(n, t, h, w)} seed {seed}: rel L2 {err:.2e}"
        raw_err = rel_l2(model.decode(x, tiled=False, clamp=False), pipeline_decode(vae, x, clamp=False))
        assert raw_err < TOL, f"{backend_name} unclamped {(n, t, h, w)} seed {seed}: rel L2 {raw_err:.2e}"
        broken = rel_l2(ours, pipeline_decode(vae, x, descale=False))
        assert broken > 100 * TOL, f"dropping the de-scaling changes nothing (rel L2 {broken:.2e})"


def test_diffusers_own_decode_fails_for_a_batch_of_two(tiny_vae):
    """Why the references decode per sample: the mask (B, L, L) does not broadcast against SDPA's
    (B, 1, L, L). Should diffusers fix it, this says so (and the per-sample split can go)."""
    vae, _, _ = tiny_vae
    with torch.no_grad(), pytest.raises(RuntimeError):
        vae.decode(torch.zeros(2, C, 2, 2, 2))


def test_streamed_groups_are_the_decode_in_any_chunking(tiny_vae):
    vae, folder, seed = tiny_vae
    model = load_model("h", PRESET, get_backend("numpy"), weights=folder)
    x = latents(np.random.default_rng(seed), 1, C, 4, 3, 2)
    groups = list(model.decode_frames(x, tiled=False))
    assert [g.shape[1] for g in groups] == [1, 4, 4, 4]
    whole = model.decode(x, tiled=False)
    assert np.array_equal(np.concatenate(groups, axis=1), whole)
    # runs of 2 and 3 latent frames after the first (what a row shard's band may take): the cache,
    # the first-frame rule and the frame-causal attention make any run exact
    for run in (2, 3):
        runs = list(model.decode_frames(x, tiled=False, chunks=ChunkPlan(run, False)))
        assert [g.shape[1] for g in runs] == [1, 4, 4, 4]
        err = rel_l2(np.concatenate(runs, axis=1), whole)
        assert err < 1e-6, f"runs of {run}: rel L2 {err:.2e}"
    assert rel_l2(whole, pipeline_decode(vae, x)) < TOL, f"seed {seed}"
    # uint8 groups are the float frames' pixels_to_uint8
    u8 = np.concatenate(list(model.decode_frames(x, tiled=False, uint8=True)), axis=1)
    assert u8.dtype == np.uint8 and np.abs(u8.astype(int) - np.floor(whole * 255 + 0.5)).max() <= 1


def test_tiled_decode_matches_diffusers_tiled(tiny_vae):
    vae, folder, seed = tiny_vae
    # 32-pixel tiles (4 latents), a tile every 3 latents, blended over 8 pixels
    model = load_model("h", PRESET, get_backend("numpy"), weights=folder,
                       options=HunyuanVideo15VAEOptions(tile_sample_min_size=32))
    vae.enable_tiling(tile_sample_min_height=32, tile_sample_min_width=32, tile_latent_min_height=4,
                      tile_latent_min_width=4, tile_overlap_factor=0.25)
    try:
        x = latents(np.random.default_rng(seed), 1, C, 2, 7, 5)
        ours, ref = model.decode(x, tiled=True), pipeline_decode(vae, x)
        raw, raw_ref = model.decode(x, tiled=True, clamp=False), pipeline_decode(vae, x, clamp=False)
    finally:
        vae.disable_tiling()
    err = rel_l2(ours, ref)
    untiled_diff = rel_l2(model.decode(x, tiled=False), ref)
    print(f"tiled decode, 4-latent tiles: rel L2 {err:.2e} (untiled vs tiled reference {untiled_diff:.2e})")
    assert ours.shape == ref.shape == (1, 5, 56, 40, 3)
    assert err < TOL and rel_l2(raw, raw_ref) < TOL, f"seed {seed}: rel L2 {err:.2e}"
    assert untiled_diff > 10 * TOL, "the tiles never met: the tiled comparison proves nothing"
    with pytest.raises(ModelConfigError, match="tile consistently"):
        load_model("h", PRESET, get_backend("numpy"), options=HunyuanVideo15VAEOptions(tile_sample_min_size=40))


def test_width_changing_resnets_match(tmp_path):
    """upsample_match_channel=False: each upsampler keeps its width and the next level's first
    resnet changes it through its 1x1x1 conv_shortcut."""
    seed = fresh_seed()
    cfg = {**TINY, "upsample_match_channel": False}
    vae = make_vae(cfg, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("h", PRESET, get_backend("numpy"), weights=str(tmp_path))
    x = latents(np.random.default_rng(seed), 1, C, 2, 3, 2)
    err = rel_l2(model.decode(x), pipeline_decode(vae, x))
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"


def _folder(tmp_path, name: str, sd: dict, config: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file({k: v.detach().contiguous() for k, v in sd.items()},
                                str(folder / "diffusion_pytorch_model.safetensors"))
    return str(folder)


def test_decoder_only_and_strict_loading(tiny_vae, tmp_path):
    vae, folder, seed = tiny_vae
    with open(f"{folder}/config.json") as f:
        config = json.load(f)
    assert config["_class_name"] == "AutoencoderKLHunyuanVideo15"
    sd = vae.state_dict()
    decoder_only = {k: v for k, v in sd.items() if k.startswith("decoder.")}
    model = load_model("h", PRESET, get_backend("numpy"), weights=_folder(tmp_path, "dec", decoder_only, config))
    assert not model.has_encoder
    x = latents(np.random.default_rng(seed), 1, C, 2, 2, 3)
    assert rel_l2(model.decode(x), pipeline_decode(vae, x)) < TOL, f"seed {seed}"
    gone = "decoder.up_blocks.1.upsamplers.0.conv.conv.weight"
    with pytest.raises(WeightsError, match=rf"missing \(1\): {gone.replace('.', '[.]')}"):
        load_model("h", PRESET, get_backend("numpy"),
                   weights=_folder(tmp_path, "miss", {k: v for k, v in sd.items() if k != gone}, config))
    bent = "decoder.mid_block.attentions.0.to_k.weight"
    with pytest.raises(WeightsError, match=bent.replace(".", "[.]")):
        load_model("h", PRESET, get_backend("numpy"),
                   weights=_folder(tmp_path, "shape", {**sd, bent: torch.zeros(64, 64, 1, 1)}, config))
    extra = {**sd, "decoder.up_blocks.3.upsamplers.0.conv.conv.weight": torch.zeros(3)}
    with pytest.raises(WeightsError, match=r"unexpected \(1\): decoder\.up_blocks\.3\.upsamplers"):
        load_model("h", PRESET, get_backend("numpy"), weights=_folder(tmp_path, "extra", extra, config))
    with pytest.raises(WeightsError, match="AutoencoderKLHunyuanVideo15"):
        load_model("h", PRESET, get_backend("numpy"),
                   weights=_folder(tmp_path, "other", sd, {**config, "_class_name": "AutoencoderKLWan"}))


def test_configs_diffusers_cannot_run_are_refused():
    backend = get_backend("numpy")
    for bad, what in [({"spatial_compression_ratio": 32}, "2 \\*\\* 3"),
                      ({"temporal_compression_ratio": 16}, "temporal 16 <= spatial"),
                      ({"latent_channels": 48}, "latent_channels 48"),
                      ({"block_out_channels": [16, 32, 48, 64]}, "an upsample 48->32")]:
        with pytest.raises(ModelConfigError, match=what):
            load_model("h", PRESET, backend, options=HunyuanVideo15VAEOptions(config=bad))
    with pytest.raises(ValueError, match=r"latents must be \(N, 8, T, h, w\)"):
        load_model("h", PRESET, backend).decode(np.zeros((1, 8, 3, 3), np.float32))


def test_tiny_preset_random_init_is_quick():
    import time
    model = load_model("h", PRESET, get_backend("numpy"))
    assert model.weights_source == "random init"
    x = latents(np.random.default_rng(0), 1, C, 3, 4, 4)
    t0 = time.perf_counter()
    out = model.decode(x)
    assert out.shape == (1, 9, 32, 32, 3) and np.isfinite(out).all() and out.std() > 0
    assert time.perf_counter() - t0 < 10.0
    card = model.card()
    assert (card["scaling_factor"], card["shift_factor"], card["temporal_factor"]) == (1.03682, 0.0, 4)
