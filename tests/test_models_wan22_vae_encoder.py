"""Wan 2.2 video VAE encoder vs diffusers' AutoencoderKLWan(is_residual=True, patch_size=2).encode with
the same random weights, plus the Wan 2.2 TI2V pipeline's latent handling.

The reference is what WanImageToVideoPipeline.prepare_latents does with the preprocessed video
(x * 2 - 1, N, 3, F, H, W): `vae.encode(...)` argmax latents (the posterior mean), then
`(mean - latents_mean) * (1 / latents_std)`. Each test saves a freshly initialised diffusers model
(test_models_wan22_vae.make_reference: every parameter drawn afresh) and loads it through `build`."""
from __future__ import annotations

import numpy as np
import pytest

from convkernels import get_backend
from models import load_model
from models.wan22_vae import build
from test_models_wan22_vae import WAN22_ODD, WAN22_SMALL, make_reference, one_torch_thread  # noqa: F401
from torch_reference import fresh_seed, rel_l2

torch = pytest.importorskip("torch")
wan_module = pytest.importorskip("diffusers.models.autoencoders.autoencoder_kl_wan")

TOL = 1e-4
# the real [1, 2, 4, 4] multipliers at odd encoder widths (3 -> 3 -> 6 -> 12 -> 12), two resnets per block
WAN22_ODD_ENCODER = dict(WAN22_ODD, base_dim=3)


def backends() -> list:
    names = ["numpy"]
    try:
        import mlx.core  # noqa: F401
        names.append("mlx")  # MLX's CPU device here
    except ImportError:
        pass
    return names


def reference_encode(vae, config, video_nfhw01: np.ndarray, normalise: bool = True) -> np.ndarray:
    """The TI2V pipeline's encode of frames N,F,H,W,3 in [0, 1] -> N, z, T, h, w."""
    x = torch.from_numpy(video_nfhw01).permute(0, 4, 1, 2, 3)
    with torch.no_grad():
        mean = vae.encode(2.0 * x - 1.0).latent_dist.mode()
    if normalise:
        latents_mean = torch.tensor(config["latents_mean"]).view(1, -1, 1, 1, 1)
        latents_std = 1.0 / torch.tensor(config["latents_std"]).view(1, -1, 1, 1, 1)
        mean = (mean - latents_mean) * latents_std
    return mean.numpy()


def reference_without_avg_shortcut(vae, config, video: np.ndarray, monkeypatch) -> np.ndarray:
    """The same reference with every AvgDown3D shortcut contributing nothing."""
    with monkeypatch.context() as m:
        original = wan_module.AvgDown3D.forward
        m.setattr(wan_module.AvgDown3D, "forward", lambda self, x: torch.zeros_like(original(self, x)))
        return reference_encode(vae, config, video)


def check_encode(model, vae, config, shapes, seed, monkeypatch, label: str) -> None:
    rng = np.random.default_rng(seed)
    for n, f, h, w in shapes:
        video = rng.random((n, f, h, w, 3), dtype=np.float32)
        ours = model.encode(video)
        ref = reference_encode(vae, config, video)
        assert ours.dtype == np.float32
        assert ours.shape == ref.shape == (n, config["z_dim"], 1 + (f - 1) // 4, h // 16, w // 16)
        err = rel_l2(ours, ref)
        print(f"{label} encode {(n, f, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"seed {seed}, {label}, video {(n, f, h, w)}: relative L2 {err:.2e}"
        # vacuity guards: the posterior mean without the pipeline's normalisation, and the encoder
        # without its AvgDown3D shortcuts, are both far from what the test accepts
        bare = rel_l2(ours, reference_encode(vae, config, video, normalise=False))
        assert bare > 100 * TOL, f"seed {seed}: the normalisation is not what the test sees ({bare:.2e})"
        short = rel_l2(ours, reference_without_avg_shortcut(vae, config, video, monkeypatch))
        assert short > 100 * TOL, f"seed {seed}: the AvgDown3D shortcut is not what the test sees ({short:.2e})"


@pytest.mark.parametrize("backend_name", backends())
def test_encode_matches_diffusers_and_the_ti2v_pipeline(tmp_path, monkeypatch, backend_name):
    """One, two and three chunks (F = 1, 5, 9: the lone first frame, then 4 per chunk through the
    causal cache and the time-strided downsamplers), batch 2, non-square sides."""
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, WAN22_SMALL, seed)
    model = build("wan22-enc", "tiny-wan2.2-vae", get_backend(backend_name), str(folder))
    assert model.has_encoder and model.card()["has_encoder"] is True
    assert model.card()["backend"] == backend_name
    check_encode(model, vae, config, [(2, 1, 32, 48), (1, 5, 48, 16), (1, 9, 16, 32)], seed, monkeypatch,
                 backend_name)


def test_encode_at_the_real_depth_and_odd_widths(tmp_path, monkeypatch):
    """The published [1, 2, 4, 4] multipliers, two resnets per block, 3-channel base width."""
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, WAN22_ODD_ENCODER, seed)
    model = load_model("wan22-odd", "tiny-wan2.2-vae", get_backend("numpy"), weights=str(folder))
    assert model.config.base_dim == 3, "config.json replaces the preset's"
    check_encode(model, vae, config, [(1, 5, 48, 80)], seed, monkeypatch, "odd widths")


def test_round_trip_shapes():
    """decode(encode(x)) gives back a clip of the input's shape; encode(decode(z)) z's."""
    model = load_model("w", "tiny-wan2.2-vae", get_backend("numpy"))
    video = np.random.default_rng(0).random((2, 9, 32, 48, 3), dtype=np.float32)
    latents = model.encode(video)
    assert latents.shape == (2, 12, 3, 2, 3)
    frames = model.decode(latents)
    assert frames.shape == video.shape and frames.dtype == np.float32
    assert model.encode(frames).shape == latents.shape


def test_bad_videos_are_refused_with_the_reason():
    model = load_model("w", "tiny-wan2.2-vae", get_backend("numpy"))
    good = np.zeros((1, 5, 32, 32, 3), np.float32)
    cases = [(good[0], "N, F, H, W, 3"), (good[..., :2], "N, F, H, W, 3"), (good[:, :4], "1 \\+ 4k"),
             (good[:, :, :24], "multiples of 16"), (good[:, :, :, :8], "multiples of 16"),
             (good.astype(np.uint8), "floating point"), (np.full_like(good, np.nan), "NaN")]
    for bad, reason in cases:
        with pytest.raises(ValueError, match=reason):
            model.encode(bad)


def test_a_checkpoint_without_the_encoder_decodes_only(tmp_path):
    from safetensors.numpy import load_file, save_file

    seed = fresh_seed()
    _, folder, _ = make_reference(tmp_path, WAN22_SMALL, seed)
    weights = folder / "diffusion_pytorch_model.safetensors"
    tensors = load_file(str(weights))
    save_file({k: v for k, v in tensors.items() if not k.startswith(("encoder.", "quant_conv."))}, str(weights))
    model = build("wan22-dec", "tiny-wan2.2-vae", get_backend("numpy"), str(folder))
    assert not model.has_encoder and model.card()["has_encoder"] is False
    assert model.decode(np.zeros((1, 12, 2, 2, 2), np.float32)).shape == (1, 5, 32, 32, 3)
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 1, 16, 16, 3), np.float32))
