"""The TAESD family (diffusers AutoencoderTiny) vs diffusers itself, same random weights in every
parameter, saved with save_pretrained and loaded through the public load_model path (our
safetensors reader), on NumPy and on MLX (its CPU device where there is no Metal GPU)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS, WeightsError, load_model
from models.taesd import TAESDOptions
from torch_reference import assert_informative, fresh_seed, rel_l2

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")

TOL = 1e-4

# non-trivial scaling and shift (the published checkpoints have 1 and 0), so the
# de-normalisation is part of what is compared; odd widths; the real 4-stage structure
SMALL = dict(encoder_block_out_channels=(12, 12, 12, 12), decoder_block_out_channels=(10, 10, 10, 10),
             num_encoder_blocks=(1, 2, 1, 2), num_decoder_blocks=(2, 1, 2, 1), latent_channels=4,
             scaling_factor=0.7, shift_factor=0.15)
F1_LIKE = dict(SMALL, latent_channels=16, scaling_factor=1.3, shift_factor=-0.2)


def make_tiny(cfg: dict, seed: int):
    """A diffusers AutoencoderTiny with every parameter moved off its init (biases nonzero), its
    output conv then rescaled so random latents decode to about 0.5 +- 0.25 per channel: PyTorch's
    default init shrinks the signal through the plain conv stack, and an image of near-constant
    values would make the comparisons (and the vacuity guard) weak."""
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderTiny(**cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.mul_(1.0 + 0.1 * torch.randn_like(p))
        out_conv = vae.decoder.layers[-1]
        out_conv.bias.zero_()
        probe = torch.randn(2, cfg["latent_channels"], 8, 8)
        pre = vae.decoder(probe) / 2 + 0.5  # the conv's output without its bias, in image space
        mean, std = pre.mean(dim=(0, 2, 3)), pre.std(dim=(0, 2, 3))
        gain = 0.25 / std
        out_conv.weight.mul_(gain.view(-1, 1, 1, 1))
        # decoder output d = 2 * conv - 1 maps to image space as d / 2 + 0.5 = conv: bias in image units
        out_conv.bias.copy_(0.5 - mean * gain + 0.02 * torch.randn_like(mean))
    return vae


def reference_decode(vae, latents: np.ndarray, denormalise: bool = True, clamp: bool = True) -> np.ndarray:
    """What a diffusers pipeline does with its latents and AutoencoderTiny: / scaling_factor +
    shift_factor, decode, then VaeImageProcessor's (x / 2 + 0.5).clamp(0, 1)."""
    z = torch.from_numpy(latents)
    if denormalise:
        z = z / vae.config.scaling_factor + vae.config.shift_factor
    with torch.no_grad():
        out = vae.decode(z).sample / 2 + 0.5
    return (out.clamp(0, 1) if clamp else out).permute(0, 2, 3, 1).numpy()


def reference_encode(vae, images_nhwc01: np.ndarray) -> np.ndarray:
    """A pipeline's image -> latents: [0, 1] -> [-1, 1], encode, (latents - shift) * scale."""
    x = torch.from_numpy(images_nhwc01).permute(0, 3, 1, 2) * 2 - 1
    with torch.no_grad():
        lat = vae.encode(x).latents
    return ((lat - vae.config.shift_factor) * vae.config.scaling_factor).numpy()


@pytest.fixture(params=["numpy", "mlx"])
def backend(request):
    if request.param == "mlx":
        pytest.importorskip("mlx.core")
    return get_backend(request.param)


@pytest.mark.parametrize("cfg_name,cfg,sizes", [
    ("small", SMALL, [(1, 9, 13), (2, 7, 11)]),
    ("f1_like", F1_LIKE, [(1, 11, 5)]),
])
def test_decode_matches_diffusers(tmp_path, backend, cfg_name, cfg, sizes):
    seed = fresh_seed()
    vae = make_tiny(cfg, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("t", "tiny-taesd", backend, weights=str(tmp_path))
    assert model.kind == "image-decoder" and model.has_encoder and model.spatial_factor == 8
    assert model.latent_channels == cfg["latent_channels"]
    rng = np.random.default_rng(seed)
    for n, h, w in sizes:
        # 2x the unit scale: the decoder's tanh squash (|z| near 3) is exercised too
        lat = (2 * rng.standard_normal((n, cfg["latent_channels"], h, w))).astype(np.float32)
        ours = model.decode(lat, tiled=False)
        ref = reference_decode(vae, lat)
        assert ours.dtype == np.float32 and ours.shape == (n, 8 * h, 8 * w, 3)
        assert_informative(ref, f"{cfg_name} {(n, h, w)} seed {seed}")
        err = rel_l2(ours, ref)
        print(f"{backend.name} {cfg_name} decode {(n, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{cfg_name} {(n, h, w)} seed {seed}: rel L2 {err:.2e}"
        raw = model.decode(lat, tiled=False, clamp=False)  # 2 * raw - 1 is diffusers' .sample
        raw_err = rel_l2(raw, reference_decode(vae, lat, clamp=False))
        assert raw_err < TOL, f"{cfg_name} raw {(n, h, w)} seed {seed}: rel L2 {raw_err:.2e}"
        # the vacuity guard: the same comparison against a reference without the de-normalisation fails
        assert rel_l2(ours, reference_decode(vae, lat, denormalise=False)) > 100 * TOL


@pytest.mark.parametrize("cfg_name,cfg", [("small", SMALL), ("f1_like", F1_LIKE)])
def test_encode_matches_diffusers(tmp_path, backend, cfg_name, cfg):
    seed = fresh_seed()
    vae = make_tiny(cfg, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("t", "tiny-taesd", backend, weights=str(tmp_path))
    rng = np.random.default_rng(seed)
    for n, h, w in [(1, 40, 56), (2, 37, 21)]:
        img = rng.uniform(0, 1, (n, h, w, 3)).astype(np.float32)
        ours = model.encode(img, tiled=False)
        # sides not a multiple of 8 are floored (diffusers' untiled encode rounds up: its last
        # latent half sees padding; the others are the same)
        ref = reference_encode(vae, img)[:, :, :h // 8, :w // 8]
        err = rel_l2(ours, ref)
        print(f"{backend.name} {cfg_name} encode {(n, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{cfg_name} encode {(n, h, w)} seed {seed}: rel L2 {err:.2e}"


@pytest.mark.parametrize("tile", [16, 12])
def test_tiled_decode_and_encode_equal_diffusers_tiling(tmp_path, backend, tile):
    """AutoencoderTiny's own tiled rule (ramp-blended, uncropped tiles, overlap 1/8), at small
    tiles so a small input spans several (12: the encode's blend, 12 px, is not whole latents);
    encode with 4 latent channels (diffusers' tiled encode allocates exactly 4)."""
    seed = fresh_seed()
    vae = make_tiny(SMALL, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("t", "tiny-taesd", backend, weights=str(tmp_path), options=TAESDOptions(tile_latent_size=tile))
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = tile * 8, tile
    rng = np.random.default_rng(seed)
    lat = rng.standard_normal((1, 4, 37, 23)).astype(np.float32)
    ours = model.decode(lat, tiled=True)
    ref = reference_decode(vae, lat)
    err = rel_l2(ours, ref)
    print(f"{backend.name} tiled decode, tile {tile}: rel L2 {err:.2e}")
    assert err < TOL, f"tiled decode seed {seed}: rel L2 {err:.2e}"
    # tiling changes the result: the comparison above is not the untiled decode's
    assert rel_l2(model.decode(lat, tiled=False), ref) > 10 * TOL
    img = rng.uniform(0, 1, (1, 296, 184, 3)).astype(np.float32)
    ours = model.encode(img, tiled=True)
    ref = reference_encode(vae, img)
    err = rel_l2(ours, ref)
    print(f"{backend.name} tiled encode, tile {tile}: rel L2 {err:.2e}")
    assert err < TOL, f"tiled encode seed {seed}: rel L2 {err:.2e}"
    assert rel_l2(model.encode(img, tiled=False), ref) > 10 * TOL


def test_decoder_only_safetensors_in_diffusers_naming(tmp_path):
    """A lone .safetensors (no config.json) in diffusers' names takes the preset's architecture;
    a decoder-only file loads and refuses to encode."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    seed = fresh_seed()
    cfg = {k: v for k, v in PRESETS["tiny-taesd"].config.items()}
    vae = make_tiny(cfg, seed)
    decoder = {k: v.contiguous() for k, v in vae.state_dict().items() if k.startswith("decoder.")}
    path = tmp_path / "taesd_decoder.safetensors"
    safetensors_torch.save_file(decoder, str(path))
    model = load_model("t", "tiny-taesd", get_backend("numpy"), weights=str(path))
    assert not model.has_encoder and model.card()["has_encoder"] is False
    lat = np.random.default_rng(seed).standard_normal((1, 4, 5, 9)).astype(np.float32)
    assert rel_l2(model.decode(lat), reference_decode(vae, lat)) < TOL
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 16, 16, 3), np.float32))
    # a checkpoint of another shape is refused with every problem named
    safetensors_torch.save_file({**decoder, "decoder.layers.0.weight": torch.zeros(16, 3, 3, 3)}, str(path))
    with pytest.raises(WeightsError, match="mis-shaped"):
        load_model("t", "tiny-taesd", get_backend("numpy"), weights=str(path))


def test_config_json_with_extra_keys_loads(tmp_path):
    """diffusers writes keys AutoencoderTiny does not take as arguments (block_out_channels,
    latent_magnitude ...); a newer diffusers may write more: they are read and ignored."""
    seed = fresh_seed()
    vae = make_tiny(SMALL, seed)
    vae.save_pretrained(tmp_path)
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    assert "block_out_channels" in cfg and "latent_magnitude" in cfg
    cfg["some_future_key"] = {"nested": [1, 2]}
    cfg_path.write_text(json.dumps(cfg))
    model = load_model("t", "taesd", get_backend("numpy"), weights=str(tmp_path))
    card = model.card()
    assert card["scaling_factor"] == 0.7 and card["shift_factor"] == 0.15
    assert card["config"]["decoder_block_out_channels"] == [10, 10, 10, 10]
    lat = np.random.default_rng(seed).standard_normal((1, 4, 6, 5)).astype(np.float32)
    assert rel_l2(model.decode(lat), reference_decode(vae, lat)) < TOL
    cfg["act_fn"] = "silu"
    cfg_path.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="act_fn"):
        load_model("t", "taesd", get_backend("numpy"), weights=str(tmp_path))


@pytest.mark.parametrize("preset,latent_channels", [("taesd", 4), ("taesdxl", 4), ("taef1", 16)])
def test_published_presets_are_autoencoder_tiny_defaults(preset, latent_channels):
    """The published config.json files keep AutoencoderTiny's defaults but for latent_channels;
    the published checkpoints decode the pipeline's latents as they are (scale 1, shift 0)."""
    ref = dict(diffusers.AutoencoderTiny(latent_channels=latent_channels).config)
    ours = PRESETS[preset].config
    for key, value in ours.items():
        want = list(ref[key]) if isinstance(ref[key], (list, tuple)) else ref[key]
        assert value == want, f"{preset}.{key}: {value} vs diffusers' {want}"
    model = load_model(preset, preset, get_backend("numpy"))
    assert (model.scaling_factor, model.shift_factor, model.latent_channels) == (1.0, 0.0, latent_channels)
    assert model.card()["limits"]["tile_latent_size"] == 64 and model.tiling.overlap == 0.125
    out = model.decode(np.random.default_rng(0).standard_normal((1, latent_channels, 4, 5)).astype(np.float32))
    assert out.shape == (1, 32, 40, 3) and np.isfinite(out).all()


def original_names(state: dict, half: str) -> dict:
    """madebyollin's taesd_{encoder,decoder}.safetensors naming of one half of a diffusers state
    dict: bare Sequential indices, the decoder's shifted by its leading clamp layer."""
    shift = 1 if half == "decoder" else 0
    out = {}
    for k, v in state.items():
        if k.startswith(f"{half}.layers."):
            index, rest = k[len(f"{half}.layers."):].split(".", 1)
            out[f"{int(index) + shift}.{rest}"] = v.contiguous()
    return out


def test_original_taesd_files_load(tmp_path):
    """An original decoder file alone decodes; an original encoder file alone is an encoder-only
    checkpoint (the decoder is missing); a madebyollin-style folder (diffusers checkpoint plus the
    original files of the same weights) loads its diffusers names."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    seed = fresh_seed()
    cfg = dict(PRESETS["tiny-taesd"].config)
    vae = make_tiny(cfg, seed)
    state = vae.state_dict()
    decoder_file = tmp_path / "taesd_decoder.safetensors"
    safetensors_torch.save_file(original_names(state, "decoder"), str(decoder_file))
    model = load_model("t", "tiny-taesd", get_backend("numpy"), weights=str(decoder_file))
    assert model.card()["checkpoint_naming"] == "original-decoder" and not model.has_encoder
    lat = np.random.default_rng(seed).standard_normal((1, 4, 7, 5)).astype(np.float32)
    err = rel_l2(model.decode(lat), reference_decode(vae, lat))
    assert err < TOL, f"original decoder naming, seed {seed}: rel L2 {err:.2e}"
    encoder_file = tmp_path / "taesd_encoder.safetensors"
    safetensors_torch.save_file(original_names(state, "encoder"), str(encoder_file))
    with pytest.raises(WeightsError, match="missing"):
        load_model("t", "tiny-taesd", get_backend("numpy"), weights=str(encoder_file))
    folder = tmp_path / "repo"
    vae.save_pretrained(folder)
    for name in ("taesd_decoder.safetensors", "taesd_encoder.safetensors"):
        (folder / name).write_bytes((tmp_path / name).read_bytes())
    model = load_model("t", "tiny-taesd", get_backend("numpy"), weights=str(folder))
    assert model.card()["checkpoint_naming"] == "diffusers" and model.has_encoder
    assert rel_l2(model.decode(lat), reference_decode(vae, lat)) < TOL


def test_auto_tiling_follows_the_memory_budget():
    """tiled=None: one piece while the estimate fits the budget, AutoencoderTiny's tiles past it."""
    lat = np.random.default_rng().standard_normal((1, 4, 20, 18)).astype(np.float32)
    roomy = load_model("t", "tiny-taesd", get_backend("numpy"), options=TAESDOptions(tile_latent_size=8))
    tight = load_model("t", "tiny-taesd", get_backend("numpy"),
                       options=TAESDOptions(tile_latent_size=8, memory_budget_bytes=1))
    untiled, tiled = roomy.decode(lat, tiled=False), roomy.decode(lat, tiled=True)
    assert rel_l2(tiled, untiled) > 10 * TOL  # the two differ, so which one ran shows
    assert np.array_equal(roomy.decode(lat), untiled)
    assert np.array_equal(tight.decode(lat), tiled)
    img = np.random.default_rng().uniform(0, 1, (1, 160, 144, 3)).astype(np.float32)
    assert np.array_equal(tight.encode(img), roomy.encode(img, tiled=True))
    assert np.array_equal(roomy.encode(img), roomy.encode(img, tiled=False))
