"""Wan 2.1 video VAE decoder vs diffusers' AutoencoderKLWan with the same random weights.

Each test saves a freshly initialised diffusers model with `save_pretrained` and loads it
through our `build`, so the checkpoint path (names, layouts, config.json) is what is tested,
not a hand-made copy of the weights."""
from __future__ import annotations

import inspect
import json

import numpy as np
import pytest

from convkernels import get_backend
from models import ModelOptions
from models.wan_vae import PRESETS, WanVAEDecoder, WanVAEOptions, build
from models.nn.weights import WeightsError
from reference_checks import assert_informative, fresh_seed, rel_l2

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")

# Wan 2.1's layout (time upsampling in the two deepest up blocks), at test size
WAN_SMALL = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                 temperal_downsample=[False, True, True])
# odd channel counts everywhere (7 -> 14 -> upsampler halves to 7), two resnets per block
WAN_ODD = dict(base_dim=7, z_dim=5, dim_mult=[1, 2, 2, 2], num_res_blocks=2,
               temperal_downsample=[False, True, True])


@pytest.fixture(autouse=True)
def one_torch_thread():
    """The CI box has 2 cores shared by parallel jobs; torch's thread pool oversubscribed there
    runs diffusers' many small per-tile ops over 10x slower. Restored after each test."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_reference(tmp_path, config: dict, seed: int):
    """A diffusers AutoencoderKLWan with random weights (gammas and biases perturbed too, so
    no parameter sits at a value that would hide a mistake), saved as a diffusers folder."""
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    z = config["z_dim"]
    config = {**config, "latents_mean": rng.normal(0, 0.5, z).round(4).tolist(),
              "latents_std": rng.uniform(0.5, 3.0, z).round(4).tolist()}
    vae = diffusers.AutoencoderKLWan(**config).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("gamma"):
                p.copy_(1.0 + 0.3 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
    folder = tmp_path / "wan_vae"
    vae.save_pretrained(folder)
    return vae, folder, config


def reference_decode(vae, config, latents: np.ndarray) -> np.ndarray:
    """What the diffusers Wan pipeline does: de-normalise, vae.decode, then x / 2 + 0.5."""
    mean = torch.tensor(config["latents_mean"]).view(1, -1, 1, 1, 1)
    std = torch.tensor(config["latents_std"]).view(1, -1, 1, 1, 1)
    z = torch.from_numpy(latents) / (1.0 / std) + mean
    with torch.no_grad():
        video = vae.decode(z).sample  # N, 3, F, H, W in [-1, 1]
    return (video / 2 + 0.5).permute(0, 2, 3, 4, 1).numpy()


@pytest.mark.parametrize("config,shapes,norm_band_bytes", [
    (WAN_SMALL, [(1, 1, 5, 7), (1, 3, 5, 7)], None),
    # RMS norms in row bands of a few rows, the last one short (large frames go that way)
    (WAN_ODD, [(2, 2, 3, 5), (1, 4, 3, 5)], 3000),
], ids=["wan-small", "wan-odd-channels-banded-norm"])
def test_decode_matches_diffusers(tmp_path, monkeypatch, config, shapes, norm_band_bytes):
    if norm_band_bytes is not None:  # the generic (layer_norm) RMS route, in bands
        from convkernels import BackendBase
        from convkernels.backends.numpy.backend import NumpyBackend
        monkeypatch.setattr(NumpyBackend, "_rms_norm", BackendBase._rms_norm)
        monkeypatch.setattr(BackendBase, "RMS_BAND_BYTES", norm_band_bytes)
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, config, seed)
    model = build("wan-test", "tiny-wan-vae", get_backend("numpy"), str(folder))
    assert model.config.base_dim == config["base_dim"], "config.json must replace the preset's architecture"
    rng = np.random.default_rng(seed)
    for n, t, h, w in shapes:
        latents = rng.standard_normal((n, config["z_dim"], t, h, w)).astype(np.float32)
        ours = model.decode(latents)
        ref = reference_decode(vae, config, latents)
        assert ours.dtype == np.float32
        assert ours.shape == (n, 1 + 4 * (t - 1), 8 * h, 8 * w, 3)
        assert_informative(ref, f"seed {seed}, latents {(n, t, h, w)}")
        err = rel_l2(ours, ref)
        assert err < 1e-4, f"seed {seed}, latents {(n, t, h, w)}: relative L2 {err:.2e}"


def test_decode_matches_diffusers_on_mlx_backend(tmp_path):
    """Same model code on the MLX backend (Metal on a Mac, CPU elsewhere)."""
    pytest.importorskip("mlx.core")
    try:
        backend = get_backend("mlx")
    except Exception as exc:  # mlx installed but unusable here
        pytest.skip(f"mlx backend unavailable: {exc}")
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, WAN_ODD, seed)
    model = build("wan-mlx", "tiny-wan-vae", backend, str(folder))
    assert model.card()["backend"] == "mlx"
    latents = np.random.default_rng(seed).standard_normal((1, config["z_dim"], 3, 3, 5)).astype(np.float32)
    err = rel_l2(model.decode(latents), reference_decode(vae, config, latents))
    assert err < 1e-4, f"seed {seed}: relative L2 {err:.2e} on mlx"


def test_decode_frames_streams_groups_that_concatenate_to_decode():
    backend = get_backend("numpy")
    model = build("tiny", "tiny-wan-vae", backend, None)
    seed = fresh_seed()
    latents = np.random.default_rng(seed).standard_normal((1, 4, 4, 3, 5)).astype(np.float32)

    calls = []
    inner = backend.conv3d

    def counting_conv3d(*a, **k):
        calls.append(1)
        return inner(*a, **k)

    backend.conv3d = counting_conv3d
    try:
        gen = model.decode_frames(latents)
        assert not calls, "nothing may be computed before the first group is asked for"
        groups, calls_at_yield = [], []
        for g in gen:
            groups.append(g)
            calls_at_yield.append(len(calls))
    finally:
        del backend.conv3d
    assert [g.shape[1] for g in groups] == [1, 4, 4, 4]
    # each group is computed on demand: work grows between yields, one latent frame at a time
    assert all(a < b for a, b in zip(calls_at_yield, calls_at_yield[1:]))
    assert calls_at_yield[1] - calls_at_yield[0] == calls_at_yield[2] - calls_at_yield[1]
    streamed = np.concatenate(groups, axis=1)
    whole = model.decode(latents)
    assert whole.shape == (1, 13, 24, 40, 3) and streamed.shape == whole.shape
    np.testing.assert_array_equal(streamed, whole)
    assert 0.0 <= whole.min() and whole.max() <= 1.0


def test_denormalisation_uses_config_mean_and_std():
    """decode(latents) == decode of the raw latents by a model whose mean/std are 0/1."""
    backend = get_backend("numpy")
    model = build("tiny", "tiny-wan-vae", backend, None)
    raw = build("raw", "tiny-wan-vae", backend, None,
                options=ModelOptions(config={"latents_mean": [0.0] * 4, "latents_std": [1.0] * 4}))
    latents = np.random.default_rng(fresh_seed()).standard_normal((1, 4, 2, 3, 3)).astype(np.float32)
    mean = np.asarray(PRESETS["tiny-wan-vae"]["latents_mean"], np.float32).reshape(1, 4, 1, 1, 1)
    std = np.asarray(PRESETS["tiny-wan-vae"]["latents_std"], np.float32).reshape(1, 4, 1, 1, 1)
    np.testing.assert_allclose(model.decode(latents), raw.decode(latents * std + mean), atol=1e-6)


def test_bad_checkpoint_lists_every_problem(tmp_path):
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, WAN_SMALL, seed)
    tensors = {k: v.contiguous() for k, v in vae.state_dict().items()}
    del tensors["decoder.mid_block.attentions.0.proj.weight"]
    tensors["decoder.extra_layer.weight"] = torch.zeros(3)
    tensors["decoder.conv_out.weight"] = torch.zeros(3, 16, 3, 3, 1)
    bad = tmp_path / "bad.safetensors"
    safetensors_torch.save_file(tensors, str(bad))
    with pytest.raises(WeightsError) as info:
        build("bad", "tiny-wan-vae", get_backend("numpy"), str(bad), ModelOptions(config={"base_dim": 16}))
    msg = str(info.value)
    assert "missing (1): decoder.mid_block.attentions.0.proj.weight" in msg
    assert "unexpected (1): decoder.extra_layer.weight" in msg
    assert "decoder.conv_out.weight: checkpoint (3, 16, 3, 3, 1) vs model (3, 16, 3, 3, 3)" in msg
    # the encoder half of a full checkpoint is not a problem
    assert "encoder.conv_in" not in msg


def test_wrong_class_and_unsupported_configs_are_refused(tmp_path):
    folder = tmp_path / "sd"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_class_name": "AutoencoderKL"}))
    safetensors_torch.save_file({"x": torch.zeros(1)}, str(folder / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(WeightsError, match="AutoencoderKL, not AutoencoderKLWan"):
        build("x", "wan2.1-vae", get_backend("numpy"), str(folder))
    with pytest.raises(ValueError, match="Wan 2.2"):
        build("x", "tiny-wan-vae", get_backend("numpy"), None, ModelOptions(config={"is_residual": True}))
    with pytest.raises(ValueError, match="unknown Wan VAE preset"):
        build("x", "no-such-preset", get_backend("numpy"), None)


def test_bad_latents_are_refused():
    model = build("tiny", "tiny-wan-vae", get_backend("numpy"), None)
    for bad in (np.zeros((1, 3, 2, 4, 4), np.float32), np.zeros((1, 4, 4, 4), np.float32),
                np.zeros((1, 4, 0, 4, 4), np.float32), np.full((1, 4, 1, 2, 2), np.nan, np.float32)):
        with pytest.raises(ValueError):
            model.decode(bad)
        with pytest.raises(ValueError):  # at the call, not at the first group: streams fail early
            model.decode_frames(bad)


def test_card_and_presets():
    model = build("tiny", "tiny-wan-vae", get_backend("numpy"), None)
    assert isinstance(model, WanVAEDecoder) and model.kind == "video-decoder"
    assert (model.latent_channels, model.spatial_factor, model.temporal_factor) == (4, 8, 4)
    card = model.card()
    for key in ("architecture", "preset", "weights", "backend", "dtype", "limits", "config"):
        assert key in card
    assert card["weights"] == "random init" and card["preset"] == "tiny-wan-vae"
    json.dumps(card)
    real = PRESETS["wan2.1-vae"]
    # the real preset is diffusers' own default config, which is Wan 2.1's
    sig = inspect.signature(diffusers.AutoencoderKLWan.__init__).parameters
    for key in ("base_dim", "z_dim", "dim_mult", "num_res_blocks", "temperal_downsample",
                "latents_mean", "latents_std"):
        assert list(np.atleast_1d(real[key])) == list(np.atleast_1d(sig[key].default)), key


def test_tiled_decode_matches_diffusers_tiling(tmp_path):
    """Small tiles (64 px, stride 48) so an 11x13 latent clip spans a 2x3 grid with partial
    edge tiles (the last column one latent wide); streamed frame groups must equal diffusers'
    tile-by-tile result."""
    seed = fresh_seed()
    config = dict(WAN_SMALL, base_dim=8)
    vae, folder, config = make_reference(tmp_path, config, seed)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                      tile_sample_stride_height=48, tile_sample_stride_width=48)
    model = build("wan-tiled", "tiny-wan-vae", get_backend("numpy"), str(folder),
                  WanVAEOptions(tile_sample_min_size=64, tile_sample_stride=48))
    rng = np.random.default_rng(seed)
    for t, h, w in ((3, 11, 13),):  # a 2x3 tile grid whose last row and column are partial
        latents = rng.standard_normal((1, config["z_dim"], t, h, w)).astype(np.float32)
        ref = reference_decode(vae, config, latents)
        groups = list(model.decode_frames(latents, tiled=True))
        assert [g.shape[1] for g in groups] == [1] + [4] * (t - 1)
        ours = np.concatenate(groups, axis=1)
        err = rel_l2(ours, ref)
        assert err < 1e-4, f"seed {seed}, latents {(t, h, w)}: tiled relative L2 {err:.2e}"
        # the tiles really blend: the untiled decode is measurably different
        assert rel_l2(model.decode(latents, tiled=False), ref) > 1e-3


def test_tiling_auto_threshold_and_single_tile():
    model = build("tiny", "tiny-wan-vae", get_backend("numpy"), None,
                  WanVAEOptions(tile_sample_min_size=32, tile_sample_stride=24, max_untiled_pixels=24 * 24))
    latents = np.random.default_rng(fresh_seed()).standard_normal((1, 4, 1, 5, 6)).astype(np.float32)
    untiled, tiled = model.decode(latents, tiled=False), model.decode(latents, tiled=True)
    assert rel_l2(untiled, tiled) > 1e-3
    np.testing.assert_array_equal(model.decode(latents), tiled)  # 40x48 px > 24x24: auto tiles
    small = latents[:, :, :, :3, :4]  # fits one 32 px tile: diffusers does not tile it either
    np.testing.assert_array_equal(model.decode(small, tiled=True), model.decode(small, tiled=False))


_RESNET_TO_ORIGINAL = {"norm1.gamma": "residual.0.gamma", "conv1.weight": "residual.2.weight",
                       "conv1.bias": "residual.2.bias", "norm2.gamma": "residual.3.gamma",
                       "conv2.weight": "residual.6.weight", "conv2.bias": "residual.6.bias",
                       "conv_shortcut.weight": "shortcut.weight", "conv_shortcut.bias": "shortcut.bias"}


def to_original_wan_names(sd: dict, num_res_blocks: int, num_up_blocks: int) -> dict:
    """diffusers decoder names -> the original Wan release's names (the test's own inverse,
    checked against diffusers' convert_wan_vae_to_diffusers before use)."""
    flat, k = {}, 0
    for i in range(num_up_blocks):
        for r in range(num_res_blocks + 1):
            flat[f"decoder.up_blocks.{i}.resnets.{r}."] = f"decoder.upsamples.{k}."
            k += 1
        if i != num_up_blocks - 1:
            flat[f"decoder.up_blocks.{i}.upsamplers.0."] = f"decoder.upsamples.{k}."
            k += 1
    fixed = {"post_quant_conv.": "conv2.", "decoder.conv_in.": "decoder.conv1.",
             "decoder.norm_out.": "decoder.head.0.", "decoder.conv_out.": "decoder.head.2.",
             "decoder.mid_block.resnets.0.": "decoder.middle.0.",
             "decoder.mid_block.attentions.0.": "decoder.middle.1.",
             "decoder.mid_block.resnets.1.": "decoder.middle.2.", **flat}
    out = {}
    for name, value in sd.items():
        for old, new in fixed.items():
            if name.startswith(old):
                rest = name[len(old):]
                is_resnet = ".resnets." in old or old.startswith("decoder.mid_block.resnets")
                out[new + (_RESNET_TO_ORIGINAL[rest] if is_resnet else rest)] = value
                break
    return out


def test_original_wan_checkpoint_names(tmp_path):
    """A single .safetensors in the original Wan release's naming (as ComfyUI ships
    wan_2.1_vae.safetensors) loads and decodes like the diffusers model. The real Wan depth
    (dim_mult (1, 2, 4, 4), two resnets per block) because diffusers' converter assumes it."""
    from diffusers.loaders.single_file_utils import convert_wan_vae_to_diffusers
    seed = fresh_seed()
    config = dict(base_dim=8, z_dim=4, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                  temperal_downsample=[False, True, True])
    vae, _, config = make_reference(tmp_path, config, seed)
    decoder_sd = {k: v.contiguous() for k, v in vae.state_dict().items()
                  if k.startswith(("decoder.", "post_quant_conv."))}
    original = to_original_wan_names(decoder_sd, num_res_blocks=2, num_up_blocks=4)
    assert len(original) == len(decoder_sd)
    assert set(convert_wan_vae_to_diffusers(original)) == set(decoder_sd), "test fixture disagrees with diffusers"
    path = tmp_path / "wan_2.1_vae.safetensors"
    safetensors_torch.save_file(original, str(path))
    overrides = {k: config[k] for k in ("base_dim", "z_dim", "dim_mult", "num_res_blocks",
                                        "latents_mean", "latents_std")}
    model = build("wan-orig", "wan2.1-vae", get_backend("numpy"), str(path), ModelOptions(config=overrides))
    assert model.card()["weights_naming"] == "original-wan"
    latents = np.random.default_rng(seed).standard_normal((1, 4, 2, 3, 5)).astype(np.float32)
    err = rel_l2(model.decode(latents), reference_decode(vae, config, latents))
    assert err < 1e-4, f"seed {seed}: relative L2 {err:.2e}"


def test_registry_serves_the_wan_presets():
    models = pytest.importorskip("models")
    assert models.PRESETS["wan2.1-vae"].kind == "video-decoder"
    m = models.load_model("video", "tiny-wan-vae", get_backend("numpy"))
    assert m.kind == "video-decoder" and m.card()["weights"] == "random init"
    assert m.decode(np.zeros((1, 4, 2, 3, 3), np.float32)).shape == (1, 5, 24, 24, 3)


def test_feature_cache_stays_bounded(monkeypatch):
    """Memory must not grow with clip length: every cache slot holds at most CACHE_T frames
    and the number of slots is fixed after the first chunks."""
    import models.wan_vae.model as wan_vae
    from models.wan_vae.layers import CACHE_T, FeatureCache, holds_frames

    seen: list[FeatureCache] = []

    class Recording(FeatureCache):
        def __init__(self, slots=()):
            super().__init__(slots)
            seen.append(self)

    monkeypatch.setattr(wan_vae, "FeatureCache", Recording)
    model = build("tiny", "tiny-wan-vae", get_backend("numpy"), None)
    latents = np.random.default_rng(fresh_seed()).standard_normal((1, 4, 6, 2, 3)).astype(np.float32)
    sizes = []
    for _ in model.decode_frames(latents):
        state = seen[0]  # the decode's own; later ones are the steady step's views of it
        frames = [s.shape[1] for s in state.slots if holds_frames(s)]
        assert max(frames) <= CACHE_T
        sizes.append((len(state.slots), sum(frames)))
    assert sizes[1] == sizes[-1] and len(set(sizes[1:])) == 1, sizes


@pytest.mark.slow
def test_real_wan21_config_matches_diffusers():
    """The real preset (base_dim 96, 16 latent channels, 384-channel mid block) at a tiny
    spatial size: diffusers' default AutoencoderKLWan, its random init, its state dict."""
    from models.wan_vae import WanVAEConfig
    seed = fresh_seed()
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKLWan().eval()
    tensors = {k: v.numpy() for k, v in vae.state_dict().items()}
    cfg = WanVAEConfig.from_dict(PRESETS["wan2.1-vae"])
    model = WanVAEDecoder("wan21", "wan2.1-vae", get_backend("numpy"), cfg, tensors)
    latents = np.random.default_rng(seed).standard_normal((1, 16, 2, 2, 3)).astype(np.float32)
    err = rel_l2(model.decode(latents), reference_decode(vae, PRESETS["wan2.1-vae"], latents))
    assert err < 1e-4, f"seed {seed}: relative L2 {err:.2e}"


def test_a_backend_that_runs_ahead_gets_one_frame_group_of_look_ahead():
    """On a backend whose copies to the host overlap later work (cuda), frame group k+1 is queued
    before group k is waited for, from the second group on; the first group leaves before any
    later work is queued (its latency is the stream's start). The frames are the same."""
    from convkernels.backends.numpy.backend import NumpyBackend

    events = []

    class RunsAhead(NumpyBackend):
        runs_ahead = True

        def conv3d(self, *a, **k):
            events.append("conv")
            return super().conv3d(*a, **k)

        def to_host_async(self, x, clip=None, *, uint8=False):
            chunk = events.count("send")
            events.append("send")
            host = super().to_host_async(x, clip, uint8=uint8)

            class Waited:
                def result(self_inner):
                    events.append(f"wait {chunk}")
                    return host.result()
            return Waited()

    latents = np.random.default_rng(fresh_seed()).standard_normal((1, 4, 4, 3, 5)).astype(np.float32)
    ahead = build("tiny", "tiny-wan-vae", RunsAhead())
    frames = ahead.decode(latents)
    order = [e for e in events if e != "conv"]
    assert order == ["send", "wait 0", "send", "send", "wait 1", "send", "wait 2", "wait 3"]
    # the chunk queued before "wait 1" did its convs before it: look-ahead, not just bookkeeping
    second_send = [i for i, e in enumerate(events) if e == "send"][2]
    assert events[second_send - 1] == "conv" and events.index("wait 1") > second_send
    np.testing.assert_array_equal(frames, build("tiny", "tiny-wan-vae", get_backend("numpy")).decode(latents))


def backend_or_skip(name: str):
    if name == "mlx":
        pytest.importorskip("mlx.core")
    try:
        return get_backend(name)
    except Exception as exc:
        pytest.skip(f"{name} backend unavailable: {exc}")


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
@pytest.mark.parametrize("activation", [None, "silu"])
def test_backend_rms_norm_matches_torch(backend_name, activation):
    """The backend's rms_norm (the Wan norm's op) vs torch.nn.functional.rms_norm: odd channel
    counts, 4-D and 5-D inputs, a tiny-eps case like Wan's and a vector of zeros."""
    backend = backend_or_skip(backend_name)
    rng = np.random.default_rng(fresh_seed())
    F = torch.nn.functional
    for shape, eps in (((2, 5, 7, 13), 1e-6), ((1, 3, 4, 5, 33), 1e-24 / 33)):
        x = rng.standard_normal(shape).astype(np.float32) * rng.uniform(0.1, 10)
        x[0, 0, 0] = 0.0  # a zero vector: eps keeps it finite (0), as F.normalize does
        w = rng.uniform(0.5, 1.5, shape[-1]).astype(np.float32)
        ours = backend.to_host(backend.rms_norm(backend.asarray(x), backend.asarray(w), eps, activation))
        ref = F.rms_norm(torch.from_numpy(x).double(), (shape[-1],), torch.from_numpy(w).double(), eps)
        if activation == "silu":
            ref = F.silu(ref)
        assert np.isfinite(ours).all()
        assert rel_l2(ours, ref.numpy()) < 1e-5
    with pytest.raises(ValueError, match="rms_norm: weight"):
        backend.rms_norm(backend.asarray(np.zeros((2, 3), np.float32)), backend.asarray(np.ones(4, np.float32)))


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_backend_rms_norm_behind_a_prefix_matches_torch_cat(backend_name):
    """rms_norm(x, prefix=frames) == torch.cat([frames, silu(rms_norm(x))], 1): the causal conv's
    cached frames in front of the norm's output; odd channels, one and two videos; a prefix
    that does not fit is refused with the shapes named."""
    backend = backend_or_skip(backend_name)
    rng = np.random.default_rng(fresh_seed())
    F = torch.nn.functional
    for n, t, t0 in ((1, 3, 2), (2, 1, 2), (1, 4, 1)):
        x = rng.standard_normal((n, t, 5, 7, 13)).astype(np.float32)
        pre = rng.standard_normal((n, t0, 5, 7, 13)).astype(np.float32)
        w = rng.uniform(0.5, 1.5, 13).astype(np.float32)
        ours = backend.to_host(backend.rms_norm(backend.asarray(x), backend.asarray(w), 1e-6, "silu",
                                                prefix=backend.asarray(pre)))
        normed = F.silu(F.rms_norm(torch.from_numpy(x).double(), (13,), torch.from_numpy(w).double(), 1e-6))
        ref = torch.cat([torch.from_numpy(pre).double(), normed], dim=1).numpy()
        assert ours.shape == ref.shape
        assert rel_l2(ours, ref) < 1e-5
    x = backend.asarray(np.zeros((1, 2, 3, 4, 5), np.float32))
    with pytest.raises(ValueError, match=r"prefix must match x \(1, 2, 3, 4, 5\).*\(1, 2, 3, 4, 6\)"):
        backend.rms_norm(x, prefix=backend.asarray(np.zeros((1, 2, 3, 4, 6), np.float32)))


def decode_through_recording_backend(tmp_path, latent_frames: int, records: bool):
    """A numpy backend whose `graphed` wrapper logs each call's input and output shapes and
    answers `records` as given (a CUDA backend's wrapper answers True until a shape runs eagerly
    for good); the decode of fresh latents and diffusers' error against it."""
    be = get_backend("numpy")
    calls = []

    def recording_graphed(fn):
        def step(*xs):
            out = fn(*xs)
            calls.append(([tuple(x.shape) for x in xs], [tuple(o.shape) for o in out]))
            return out
        step.records = lambda *xs: records
        return step

    be.graphed = recording_graphed
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path, WAN_ODD, seed)
    model = build("tiny", "tiny-wan-vae", be, str(folder))
    latents = np.random.default_rng(seed).standard_normal((1, config["z_dim"], latent_frames, 3, 4))
    latents = latents.astype(np.float32)
    err = rel_l2(model.decode(latents), reference_decode(vae, config, latents))
    return calls, err, seed


def test_steady_chunks_go_through_the_recordable_step_with_repeating_shapes(tmp_path):
    """From the third latent frame on, each chunk runs through what `backend.graphed` returned
    (a CUDA backend records and replays it), taking and giving device arrays only, with the
    same shapes every chunk: otherwise every replay would be a new capture. The frames still
    match diffusers'."""
    calls, err, seed = decode_through_recording_backend(tmp_path, 6, records=True)
    assert len(calls) == 6 - 2, calls
    assert all(c == calls[0] for c in calls), "steady chunks changed their shapes"
    ins, outs = calls[0]
    assert ins[1:] == outs[1:], "the cache given back must fit the next call"
    assert err < 1e-4, f"seed {seed}: relative L2 {err:.2e}"


def test_a_step_that_runs_eagerly_for_good_takes_the_in_place_route(tmp_path):
    """Where the recording backend says a step shape will only ever run eagerly (its graph was
    over the byte bound), the decode uses its own eager route, which frees each old cache slot as
    the new one is made, instead of holding the whole old cache through the functional step."""
    calls, err, seed = decode_through_recording_backend(tmp_path, 5, records=False)
    assert calls == [] and err < 1e-4, f"seed {seed}: relative L2 {err:.2e}, step calls {len(calls)}"


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
@pytest.mark.parametrize("tiled", [False, True])
def test_uint8_frames_are_to_uint8_of_the_float_frames(backend_name, tiled):
    """decode(uint8=True) and decode_frames(uint8=True) == to_uint8 of the float32 frames bit
    for bit: untiled, each group converted by the backend before its copy; tiled (a 2x2 grid of
    32 px tiles), stitched in float32 and converted on the host."""
    from pixel_cases import host_to_uint8

    backend = backend_or_skip(backend_name)
    model = build("tiny", "tiny-wan-vae", backend, None, WanVAEOptions(tile_sample_min_size=32, tile_sample_stride=24))
    latents = (np.random.default_rng(fresh_seed()).standard_normal((1, 4, 3, 5, 7)) * 3).astype(np.float32)
    floats = list(model.decode_frames(latents, tiled=tiled))
    calls = []
    inner = backend.to_host_async
    backend.to_host_async = lambda x, clip=None, *, uint8=False: calls.append(uint8) or inner(x, clip, uint8=uint8)
    try:
        groups = list(model.decode_frames(latents, tiled=tiled, uint8=True))
    finally:
        del backend.to_host_async
    assert [g.shape[1] for g in groups] == [1, 4, 4] and all(g.dtype == np.uint8 for g in groups)
    for g, f in zip(groups, floats):
        np.testing.assert_array_equal(g, host_to_uint8(f))
    assert (len(calls) > 3 and not any(calls)) if tiled else calls == [True] * 3, calls
    whole = model.decode(latents, tiled=tiled, uint8=True)
    assert whole.dtype == np.uint8 and whole.shape == (1, 9, 40, 56, 3)
    np.testing.assert_array_equal(whole, np.concatenate(groups, axis=1))
    np.testing.assert_array_equal(whole, host_to_uint8(model.decode(latents, tiled=tiled)))
    assert len(np.unique(whole)) > 150
    if tiled:  # the tiles really blend: untiled differs
        assert (whole != model.decode(latents, tiled=False, uint8=True)).mean() > 0.01
