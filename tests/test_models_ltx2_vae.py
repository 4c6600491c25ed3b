"""LTX-2 video VAE (diffusers AutoencoderKLLTX2Video + the LTX-2 pipeline's de-normalisation and
decode timestep) on the NumPy backend and on MLX's CPU device vs diffusers itself, same random
weights in every parameter and buffer, through the public load_model path: the non-causal
decoder with reflect padding (the real config), the timestep-conditioned decoder (causal and not),
the noise option, frame groups, diffusers' tiled decode, strict loading and config refusals."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS, ModelConfigError, WeightsError, load_model
from models.ltx2_vae import LTX2VAEOptions

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from torch_reference import assert_informative, fresh_seed, rel_l2  # noqa: E402

TOL = 1e-4
#: the tiny preset: the real structure (4x4 patches, three residual 2x2x2 depth-to-space upsamplers:
#: 32x space, 8x time, non-causal, reflect padding) at 8 latent channels, widths 8..32
TINY = dict(PRESETS["tiny-ltx2-vae"].config)
TIMESTEP = {**TINY, "timestep_conditioning": True}


def make_vae(cfg: dict, seed: int):
    """An AutoencoderKLLTX2Video with every parameter moved off its init and the latent statistics
    away from 0 / 1, so a layer or buffer loaded wrong or skipped shows."""
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLLTX2Video(**cfg).eval()
    with torch.no_grad():
        for _, p in vae.named_parameters():
            p.copy_(p * (1.0 + 0.1 * torch.randn_like(p)) + 0.02 * torch.randn_like(p))
        vae.latents_mean.copy_(0.2 * torch.randn_like(vae.latents_mean))
        vae.latents_std.copy_(0.5 + torch.rand_like(vae.latents_std))
    return vae


def pipeline_decode(vae, x: np.ndarray, timestep: float | None = None, *, clamp: bool = True,
                    denormalise: bool = True, noise: np.ndarray | None = None, noise_scale: float = 0.0) -> np.ndarray:
    """LTX2Pipeline's last step on unpacked latents: (noise), latents * std / scaling_factor + mean,
    vae.decode(latents, timestep), postprocess -> N,F,H,W,3. denormalise=False: the vacuity guard's
    broken twin."""
    with torch.no_grad():
        z = torch.from_numpy(x)
        if noise is not None:
            z = (1 - noise_scale) * z + noise_scale * torch.from_numpy(noise)
        if denormalise:
            z = z * vae.latents_std.view(1, -1, 1, 1, 1) / vae.config.scaling_factor \
                + vae.latents_mean.view(1, -1, 1, 1, 1)
        temb = None if timestep is None else torch.full((x.shape[0],), timestep)
        out = vae.decode(z, temb).sample
    out = (out / 2 + 0.5).clamp(0, 1) if clamp else out / 2 + 0.5
    return out.permute(0, 2, 3, 4, 1).numpy()


def backend_named(name: str):
    if name == "mlx":
        pytest.importorskip("mlx.core")
    return get_backend(name)


@pytest.fixture(scope="module")
def tiny_vae(tmp_path_factory):
    seed = fresh_seed()
    vae = make_vae(TINY, seed)
    folder = tmp_path_factory.mktemp("ltx2_tiny")
    vae.save_pretrained(folder)
    return vae, str(folder), seed


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_decode_matches_the_pipeline(tiny_vae, backend_name):
    vae, folder, seed = tiny_vae
    model = load_model("l", "tiny-ltx2-vae", backend_named(backend_name), weights=folder)
    assert model.kind == "video-decoder"
    assert (model.latent_channels, model.spatial_factor, model.temporal_factor) == (8, 32, 8)
    rng = np.random.default_rng(seed)
    for n, t, h, w in [(2, 2, 3, 5), (1, 3, 2, 3)]:
        x = rng.standard_normal((n, 8, t, h, w)).astype(np.float32)
        ours, ref = model.decode(x, tiled=False), pipeline_decode(vae, x)
        assert ours.shape == (n, 1 + 8 * (t - 1), 32 * h, 32 * w, 3) and ours.dtype == np.float32
        assert_informative(ref, f"seed {seed}")
        err = rel_l2(ours, ref)
        print(f"{backend_name} decode {(n, t, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{backend_name} {(n, t, h, w)} seed {seed}: rel L2 {err:.2e}"
        raw_err = rel_l2(model.decode(x, tiled=False, clamp=False), pipeline_decode(vae, x, clamp=False))
        assert raw_err < TOL, f"{backend_name} unclamped {(n, t, h, w)} seed {seed}: rel L2 {raw_err:.2e}"
        broken = rel_l2(ours, pipeline_decode(vae, x, denormalise=False))
        assert broken > 100 * TOL, f"dropping the de-normalisation changes nothing (rel L2 {broken:.2e})"


def test_frame_groups_are_the_whole_decode_handed_out(tiny_vae):
    vae, folder, seed = tiny_vae
    model = load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=folder)
    x = np.random.default_rng(seed).standard_normal((1, 8, 3, 2, 3)).astype(np.float32)
    groups = list(model.decode_frames(x, tiled=False))
    assert [g.shape[1] for g in groups] == [1, 8, 8]
    assert rel_l2(np.concatenate(groups, axis=1), pipeline_decode(vae, x)) < TOL, f"seed {seed}"
    u8 = np.concatenate(list(model.decode_frames(x, tiled=False, uint8=True)), axis=1)
    assert u8.dtype == np.uint8 and u8.shape == (1, 17, 64, 96, 3)
    # bad latents raise when the groups are made, before any is asked for
    for bad in [(1, 8, 0, 2, 3), (1, 7, 2, 2, 3), (8, 2, 2, 3)]:
        with pytest.raises(ValueError, match=r"latents must be \(N, 8, T, h, w\)"):
            model.decode_frames(np.zeros(bad, np.float32))


@pytest.mark.parametrize("causal", [False, True])
def test_timestep_conditioned_decoder(tmp_path, causal):
    seed = fresh_seed()
    vae = make_vae({**TIMESTEP, "decoder_causal": causal}, seed)
    vae.save_pretrained(tmp_path)
    x = np.random.default_rng(seed).standard_normal((2, 8, 2, 3, 2)).astype(np.float32)
    default = load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=str(tmp_path))
    assert default.card()["timestep"] == 0.0 and default.card()["noise_scale"] == 0.0
    ours0, ref0 = default.decode(x), pipeline_decode(vae, x, 0.0)
    assert rel_l2(ours0, ref0) < TOL, f"timestep 0 seed {seed}: {rel_l2(ours0, ref0):.2e}"
    assert np.array_equal(ours0, default.decode(x)), "the default decode is not deterministic"
    model = load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=str(tmp_path),
                       options=LTX2VAEOptions(timestep=0.05))
    ours, ref = model.decode(x), pipeline_decode(vae, x, 0.05)
    err = rel_l2(ours, ref)
    print(f"timestep 0.05, causal={causal}: rel L2 {err:.2e}")
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"
    assert rel_l2(ref, ref0) > 100 * TOL, "the timestep changes nothing: the comparison proves nothing"
    # the pipeline's decode noise, drawn from the option's seed: (1 - s) * latents + s * noise
    noisy = load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=str(tmp_path),
                       options=LTX2VAEOptions(timestep=0.05, noise_scale=0.05, noise_seed=7))
    noise = np.random.default_rng(7).standard_normal(x.shape, dtype=np.float32)
    out = noisy.decode(x)
    assert rel_l2(out, pipeline_decode(vae, x, 0.05, noise=noise, noise_scale=0.05)) < TOL, f"seed {seed}"
    assert np.array_equal(out, noisy.decode(x)) and rel_l2(out, ours) > 100 * TOL


def test_tiled_decode_matches_diffusers_tiled(tiny_vae):
    vae, folder, seed = tiny_vae
    # 3-latent (96 px) tiles every 2 latents (64 px): 32 px blends; 4x6 latents keep every tile >= 2 rows
    model = load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=folder,
                       options=LTX2VAEOptions(tile_sample_min_size=96, tile_sample_stride=64))
    vae.enable_tiling(tile_sample_min_height=96, tile_sample_min_width=96, tile_sample_stride_height=64,
                      tile_sample_stride_width=64)
    try:
        x = np.random.default_rng(seed).standard_normal((1, 8, 2, 4, 6)).astype(np.float32)
        ours, ref = model.decode(x, tiled=True), pipeline_decode(vae, x)
    finally:
        vae.disable_tiling()
    err = rel_l2(ours, ref)
    untiled_diff = rel_l2(model.decode(x, tiled=False), ref)
    print(f"tiled decode: rel L2 {err:.2e} (untiled vs tiled reference {untiled_diff:.2e})")
    assert ours.shape == ref.shape == (1, 9, 128, 192, 3)
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"
    assert untiled_diff > 10 * TOL, "the tiles never met: the tiled comparison proves nothing"
    groups = list(model.decode_frames(x, tiled=True))
    assert [g.shape[1] for g in groups] == [1, 8] and rel_l2(np.concatenate(groups, axis=1), ours) < 1e-6


def _folder(tmp_path, name: str, sd: dict, config: dict):
    folder = tmp_path / name
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    safetensors_torch.save_file({k: v.detach().contiguous() for k, v in sd.items()},
                                str(folder / "diffusion_pytorch_model.safetensors"))
    return str(folder)


def test_strict_loading(tiny_vae, tmp_path):
    vae, folder, seed = tiny_vae
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    assert config["_class_name"] == "AutoencoderKLLTX2Video"
    sd = vae.state_dict()
    decoder_only = {k: v for k, v in sd.items() if not k.startswith("encoder.")}
    model = load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=_folder(tmp_path, "dec", decoder_only, config))
    x = np.random.default_rng(seed).standard_normal((1, 8, 1, 2, 2)).astype(np.float32)
    assert rel_l2(model.decode(x), pipeline_decode(vae, x)) < TOL, f"seed {seed}"
    for name in ("decoder.up_blocks.1.upsamplers.0.conv.conv.weight", "latents_std"):
        missing = {k: v for k, v in sd.items() if k != name}
        with pytest.raises(WeightsError, match=rf"missing \(1\): {name.replace('.', '[.]')}"):
            load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=_folder(tmp_path, f"miss{len(name)}",
                                                                                   missing, config))
    bad = {**sd, "decoder.conv_in.conv.weight": torch.zeros(3, 8, 3, 3, 3)}
    with pytest.raises(WeightsError, match=r"decoder\.conv_in\.conv\.weight"):
        load_model("l", "tiny-ltx2-vae", get_backend("numpy"), weights=_folder(tmp_path, "shape", bad, config))
    with pytest.raises(WeightsError, match="AutoencoderKLLTX2Video"):
        load_model("l", "tiny-ltx2-vae", get_backend("numpy"),
                   weights=_folder(tmp_path, "other", sd, {**config, "_class_name": "AutoencoderKL"}))


def test_configs_diffusers_cannot_run_are_refused():
    backend = get_backend("numpy")
    for bad, what in [({"decoder_inject_noise": True}, "inject_noise"),
                      ({"decoder_block_out_channels": [16, 48, 64]}, "up block 1"),
                      ({"upsample_type": ["spatial", "diagonal", "temporal"]}, "upsample_type"),
                      ({"spatial_compression_ratio": 16}, "spatial_compression_ratio"),
                      ({"decoder_spatial_padding_mode": "circular"}, "padding_mode")]:
        with pytest.raises(ModelConfigError, match=what):
            load_model("l", "tiny-ltx2-vae", backend, options=LTX2VAEOptions(config=bad))


def test_real_preset_structure_and_tiny_speed():
    import time
    cfg = PRESETS["ltx2-vae"].config
    assert (cfg["latent_channels"], cfg["decoder_causal"], cfg["timestep_conditioning"]) == (128, False, False)
    model = load_model("l", "tiny-ltx2-vae", get_backend("numpy"))
    assert model.weights_source == "random init"
    x = np.random.default_rng(0).standard_normal((1, 8, 2, 4, 4)).astype(np.float32)
    t0 = time.perf_counter()
    out = model.decode(x)
    assert out.shape == (1, 9, 128, 128, 3) and np.isfinite(out).all()
    assert time.perf_counter() - t0 < 5.0
    # a lone latent row or column (torch's reflect padding refuses it) repeats itself instead
    one = model.decode(x[:, :, :, :1])
    assert one.shape == (1, 9, 32, 128, 3) and np.isfinite(one).all()
