"""Image VAE (diffusers AutoencoderKL) on the NumPy backend vs diffusers itself, same random
weights, through the public load_model path: save_pretrained folder or a single .safetensors."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS, ModelConfigError, ModelOptions, WeightsError, load_model
from models.autoencoder_kl import AutoencoderKLOptions
from reference_checks import assert_informative, fresh_seed, rel_l2  # noqa: F401 (re-used by other test files)

GOLDEN = os.path.join(os.path.dirname(os.path.abspath(__file__)), "golden")


def _refs():
    """torch and diffusers, or skip the calling test (the golden test needs neither)."""
    return pytest.importorskip("torch"), pytest.importorskip("diffusers")

TOL = 1e-4

# small configs: odd widths / groups of 3, SD's 4-level block structure, FLUX's 16 latents
SMALL = dict(block_out_channels=(9, 15), layers_per_block=1, norm_num_groups=3, latent_channels=3,
             sample_size=32, scaling_factor=0.5)
SD_LIKE = dict(block_out_channels=(8, 16, 24, 24), layers_per_block=2, norm_num_groups=8, latent_channels=4,
               sample_size=64, scaling_factor=0.18215)
FLUX_LIKE = dict(block_out_channels=(8, 16, 16, 24), layers_per_block=1, norm_num_groups=4, latent_channels=16,
                 sample_size=64, scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False,
                 use_post_quant_conv=False)


def make_vae(cfg: dict, seed: int):
    """A diffusers AutoencoderKL with every parameter (norms included) randomised."""
    torch, diffusers = _refs()
    n = len(cfg["block_out_channels"])
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * n,
                                  up_block_types=("UpDecoderBlock2D",) * n, **cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.mul_(1.0 + 0.1 * torch.randn_like(p))
    return vae


def diffusers_decode(vae, latents: np.ndarray) -> np.ndarray:
    torch, _ = _refs()
    sf, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
    with torch.no_grad():
        out = vae.decode(torch.from_numpy(latents) / sf + shift).sample
    return (out / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).numpy()


def diffusers_decode_raw(vae, latents: np.ndarray) -> np.ndarray:
    torch, _ = _refs()
    sf, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
    with torch.no_grad():
        return vae.decode(torch.from_numpy(latents) / sf + shift).sample.permute(0, 2, 3, 1).numpy()


def diffusers_encode(vae, images_nhwc: np.ndarray) -> np.ndarray:
    torch, _ = _refs()
    sf, shift = vae.config.scaling_factor, vae.config.shift_factor or 0.0
    x = torch.from_numpy(images_nhwc).permute(0, 3, 1, 2) * 2 - 1
    with torch.no_grad():
        mean = vae.encode(x).latent_dist.mean
    return ((mean - shift) * sf).numpy()


@pytest.fixture(scope="module")
def backend():
    return get_backend("numpy")


@pytest.mark.parametrize("cfg_name,cfg,sizes", [
    ("small", SMALL, [(1, 9, 13), (2, 17, 11)]),
    ("sd_like", SD_LIKE, [(1, 9, 13), (1, 17, 11)]),
    ("flux_like", FLUX_LIKE, [(2, 11, 7)]),
])
def test_decode_matches_diffusers(tmp_path, backend, cfg_name, cfg, sizes):
    seed = fresh_seed()
    vae = make_vae(cfg, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("vae", "sd-vae", backend, weights=str(tmp_path))
    assert model.kind == "image-decoder" and model.has_encoder
    assert model.latent_channels == cfg["latent_channels"]
    assert model.spatial_factor == 2 ** (len(cfg["block_out_channels"]) - 1)
    rng = np.random.default_rng(seed)
    for n, h, w in sizes:
        lat = rng.standard_normal((n, cfg["latent_channels"], h, w)).astype(np.float32)
        ours = model.decode(lat, tiled=False)
        ref = diffusers_decode(vae, lat)
        assert ours.dtype == np.float32
        assert ours.min() >= 0.0 and ours.max() <= 1.0
        assert_informative(ref, f"seed {seed}")
        err = rel_l2(ours, ref)
        assert err < TOL, f"{cfg_name} {(n, h, w)} seed {seed}: rel L2 {err:.2e}"
        # and before the clamp (clamp=False: x / 2 + 0.5 of diffusers' raw .sample)
        unclamped = model.decode(lat, tiled=False, clamp=False)
        raw_err = rel_l2(2 * unclamped - 1, diffusers_decode_raw(vae, lat))
        assert raw_err < TOL, f"{cfg_name} raw {(n, h, w)} seed {seed}: rel L2 {raw_err:.2e}"


WIDE = dict(block_out_channels=(32, 48), layers_per_block=1, norm_num_groups=8, latent_channels=4,
            sample_size=32, scaling_factor=0.5)


@pytest.mark.parametrize("path", ["winograd_f2x3", "winograd_f4x3"])
def test_decode_through_each_winograd_path_matches_diffusers(tmp_path, path):
    """The Winograd paths take 3x3 convs of 32+ channels, wider than the configs above: a decoder
    with every such conv forced onto one of them (F(4x4) has ~7x F(2x2)'s rounding error per conv)."""
    from convkernels import _cpu
    if path == "winograd_f4x3" and not _cpu.AVAILABLE:
        pytest.skip("F(4x4, 3x3) has only the compiled transforms (no compiler at install time)")
    seed = fresh_seed()
    vae = make_vae(WIDE, seed)
    vae.save_pretrained(tmp_path)
    be = get_backend("numpy")
    be.paths.forced = path
    model = load_model("vae", "sd-vae", be, weights=str(tmp_path))
    lat = np.random.default_rng(seed).standard_normal((1, 4, 11, 13)).astype(np.float32)
    err = rel_l2(model.decode(lat, tiled=False, clamp=False), diffusers_decode_raw(vae, lat) / 2 + 0.5)
    used = [c["path"] for c in be.conv_choices()]
    assert used.count(path) >= 4, used
    print(f"decode with {path} on {used.count(path)} conv keys: rel L2 {err:.2e}")
    assert err < TOL, f"{path} seed {seed}: rel L2 {err:.2e}"


@pytest.mark.parametrize("cfg_name,cfg,sizes", [
    ("small", SMALL, [(2, 35, 21)]),
    ("sd_like", SD_LIKE, [(1, 72, 40), (1, 37, 53)]),
    ("flux_like", FLUX_LIKE, [(1, 45, 33)]),
])
def test_encode_matches_diffusers(tmp_path, backend, cfg_name, cfg, sizes):
    seed = fresh_seed()
    vae = make_vae(cfg, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("vae", "sd-vae", backend, weights=str(tmp_path))
    rng = np.random.default_rng(seed)
    for n, h, w in sizes:
        img = rng.uniform(0, 1, (n, h, w, 3)).astype(np.float32)
        ours = model.encode(img)
        ref = diffusers_encode(vae, img)
        err = rel_l2(ours, ref)
        assert err < TOL, f"{cfg_name} encode {(n, h, w)} seed {seed}: rel L2 {err:.2e}"


def test_single_safetensors_with_preset_and_legacy_attention_names(tmp_path, backend):
    """A lone .safetensors (no config.json) takes its architecture from the preset; legacy
    attention names (query/key/value/proj_attn, 1x1-conv shaped) load too; decoder-only works."""
    safetensors_torch = pytest.importorskip("safetensors.torch")
    seed = fresh_seed()
    cfg = {k: v for k, v in PRESETS["tiny-vae"].config.items() if k not in ("down_block_types", "up_block_types")}
    vae = make_vae(cfg, seed)
    sd = {k: v.detach().contiguous() for k, v in vae.state_dict().items() if not k.startswith(("encoder.", "quant_conv."))}
    legacy = {}
    for k, v in sd.items():
        for new, old in (("to_q", "query"), ("to_k", "key"), ("to_v", "value"), ("to_out.0", "proj_attn")):
            if f".attentions.0.{new}." in k:
                k = k.replace(f".{new}.", f".{old}.")
                v = v[:, :, None, None].contiguous() if v.ndim == 2 else v
        legacy[k] = v
    assert any(".query." in k for k in legacy)
    path = tmp_path / "vae.safetensors"
    safetensors_torch.save_file(legacy, str(path))
    model = load_model("vae", "tiny-vae", backend, weights=str(path))
    assert not model.has_encoder
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 16, 16, 3), np.float32))
    lat = np.random.default_rng(seed).standard_normal((1, 4, 10, 7)).astype(np.float32)
    err = rel_l2(model.decode(lat, tiled=False), diffusers_decode(vae, lat))
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"
    card = model.card()
    assert card["weights"] == str(path) and card["preset"] == "tiny-vae"
    # the literal upsample-then-conv mode computes the same function as the default sub-pixel one
    literal = load_model("vae", "tiny-vae", backend, weights=str(path),
                         options=AutoencoderKLOptions(upsample_mode="nearest"))
    assert literal.card()["upsample_mode"] == "nearest" and card["upsample_mode"] == "subpixel"
    err = rel_l2(literal.decode(lat, tiled=False), diffusers_decode(vae, lat))
    assert err < TOL, f"nearest upsample mode, seed {seed}: rel L2 {err:.2e}"


def test_bad_checkpoint_names_every_problem(tmp_path, backend):
    torch, _ = _refs()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    vae = make_vae(SMALL, 0)
    sd = {k: v.detach().contiguous() for k, v in vae.state_dict().items()}
    del sd["decoder.conv_in.bias"]                                    # missing
    sd["decoder.extra_layer.weight"] = torch.zeros(3)                 # unexpected
    sd["decoder.conv_out.weight"] = torch.zeros(3, 9, 5, 5)           # mis-shaped
    del sd["encoder.conv_in.weight"]                                  # partial encoder: missing too
    vae.save_config(tmp_path)
    safetensors_torch.save_file(sd, str(tmp_path / "diffusion_pytorch_model.safetensors"))
    with pytest.raises(WeightsError) as info:
        load_model("vae", "sd-vae", backend, weights=str(tmp_path))
    msg = str(info.value)
    for name in ("decoder.conv_in.bias", "decoder.extra_layer.weight", "decoder.conv_out.weight",
                 "encoder.conv_in.weight"):
        assert name in msg, msg
    assert "(3, 9, 5, 5)" in msg and "(3, 9, 3, 3)" in msg


def test_config_json_must_be_autoencoder_kl(tmp_path, backend):
    vae = make_vae(SMALL, 1)
    vae.save_pretrained(tmp_path)
    cfg_file = tmp_path / "config.json"
    cfg = json.loads(cfg_file.read_text())
    cfg["_class_name"] = "AutoencoderKLWan"
    cfg_file.write_text(json.dumps(cfg))
    with pytest.raises(WeightsError, match="AutoencoderKLWan"):
        load_model("vae", "sd-vae", backend, weights=str(tmp_path))


@pytest.mark.parametrize("preset", ["tiny-vae", "tiny-flux-vae"])
def test_tiny_presets_random_init(backend, preset):
    model = load_model("demo", preset, backend)
    card = model.card()
    assert card["weights"] == "random init" and card["preset"] == preset and card["kind"] == "image-decoder"
    assert card["backend"] == "numpy" and card["dtype"] == "float32"
    assert card["config"]["latent_channels"] == model.latent_channels == PRESETS[preset].config["latent_channels"]
    assert model.spatial_factor == 8
    lat = np.random.default_rng().standard_normal((1, model.latent_channels, 32, 32)).astype(np.float32)
    img = model.decode(lat)
    assert img.shape == (1, 256, 256, 3) and img.dtype == np.float32
    assert np.isfinite(img).all() and 0 <= img.min() and img.max() <= 1 and img.std() > 1e-3
    # the seed makes random init reproducible across loads
    again = load_model("demo", preset, backend).decode(lat)
    np.testing.assert_array_equal(img, again)
    assert model.encode(img).shape == lat.shape


def test_real_presets_are_described():
    for name, sf, lc in (("sd-vae", 0.18215, 4), ("sdxl-vae", 0.13025, 4), ("flux-vae", 0.3611, 16)):
        info = PRESETS[name]
        assert info.kind == "image-decoder"
        assert info.config["scaling_factor"] == sf and info.config["latent_channels"] == lc
    assert PRESETS["flux-vae"].config["shift_factor"] == 0.1159
    assert PRESETS["flux-vae"].config["use_quant_conv"] is False


def test_bad_inputs_are_refused(backend):
    model = load_model("demo", "tiny-vae", backend)
    with pytest.raises(ValueError, match="latents"):
        model.decode(np.zeros((1, 16, 8, 8), np.float32))
    with pytest.raises(ValueError, match="images"):
        model.encode(np.zeros((1, 3, 16, 16), np.float32))
    with pytest.raises(ModelConfigError, match="unknown AutoencoderKL overrides"):
        load_model("demo", "tiny-vae", backend, options=ModelOptions(config={"not_a_field": 1}))
    with pytest.raises(TypeError):  # a setting the options do not have is a typo, not ignored
        AutoencoderKLOptions(tile_latent=8)
    with pytest.raises(ModelConfigError, match="another family's options"):
        from models.wan_vae import WanVAEOptions
        load_model("demo", "tiny-vae", backend, options=WanVAEOptions(tile_sample_stride=48))
    with pytest.raises(ModelConfigError, match="unknown preset 'no-such-vae'; known: .*'tiny-vae'"):
        load_model("demo", "no-such-vae", backend)


def test_golden_tiny_vae_without_torch(backend):
    """Committed fixtures (tests/make_golden.py): tiny-vae decoder weights, latents and diffusers'
    decoded image. Checks the whole load + decode path with no reference library installed."""
    weights = os.path.join(GOLDEN, "tiny_vae_decoder.safetensors")
    latents = np.load(os.path.join(GOLDEN, "tiny_vae_latents.npy"))
    expected = np.load(os.path.join(GOLDEN, "tiny_vae_diffusers_image.npy"))
    model = load_model("golden", "tiny-vae", backend, weights=weights)
    assert not model.has_encoder
    ours = model.decode(latents, tiled=False)
    assert ((expected > 0) & (expected < 1)).mean() > 0.5
    err = rel_l2(ours, expected)
    assert err < TOL, f"golden tiny-vae: rel L2 {err:.2e}"


def _to_ldm_names(sd: dict, n_blocks: int) -> dict:
    """diffusers AutoencoderKL names -> the original LDM / CompVis names of single-file SD VAEs
    (test-side inverse; checked against diffusers' own converter before use)."""
    import re
    out = {}
    for k, v in sd.items():
        part, rest = k.split(".", 1) if k.startswith(("encoder.", "decoder.")) else ("", k)
        r = rest.replace("conv_shortcut", "nin_shortcut")
        r = re.sub(r"^down_blocks\.(\d+)\.resnets\.", r"down.\1.block.", r)
        r = re.sub(r"^down_blocks\.(\d+)\.downsamplers\.0\.", r"down.\1.downsample.", r)
        r = re.sub(r"^up_blocks\.(\d+)\.resnets\.",
                   lambda m: f"up.{n_blocks - 1 - int(m[1])}.block.", r)
        r = re.sub(r"^up_blocks\.(\d+)\.upsamplers\.0\.",
                   lambda m: f"up.{n_blocks - 1 - int(m[1])}.upsample.", r)
        r = re.sub(r"^mid_block\.resnets\.(\d)\.", lambda m: f"mid.block_{int(m[1]) + 1}.", r)
        if r.startswith("mid_block.attentions.0."):
            name = r[len("mid_block.attentions.0."):]
            for new, old in (("group_norm.", "norm."), ("to_q.", "q."), ("to_k.", "k."), ("to_v.", "v."),
                             ("to_out.0.", "proj_out.")):
                if name.startswith(new):
                    name = old + name[len(new):]
            r = "mid.attn_1." + name
            if v.ndim == 2:
                v = v[:, :, None, None]  # LDM's attention projections are 1x1 convs
        r = r.replace("conv_norm_out.", "norm_out.")
        out[f"{part}.{r}" if part else r] = v.contiguous()
    return out


def test_ldm_single_file_checkpoint(tmp_path, backend):
    """An original-LDM single-file VAE (as in vae-ft-mse-840000-ema-pruned.safetensors), here
    inside a whole-SD-style checkpoint under first_stage_model., loads with a preset + overrides."""
    torch, _ = _refs()
    safetensors_torch = pytest.importorskip("safetensors.torch")
    convert = pytest.importorskip("diffusers.loaders.single_file_utils").convert_ldm_vae_checkpoint
    seed = fresh_seed()
    vae = make_vae(SD_LIKE, seed)
    sd = {k: v.detach() for k, v in vae.state_dict().items()}
    ldm = {f"first_stage_model.{k}": v for k, v in _to_ldm_names(sd, 4).items()}
    ldm["model.diffusion_model.input_blocks.0.0.weight"] = torch.zeros(2, 2)  # a UNet part to ignore
    # the fixture itself is right by diffusers' converter
    back = convert(ldm, dict(vae.config))
    assert set(back) == set(sd)
    assert all(torch.equal(back[k].reshape(sd[k].shape), sd[k]) for k in sd)
    path = tmp_path / "sd_vae_ldm.safetensors"
    safetensors_torch.save_file(ldm, str(path))
    arch = {k: SD_LIKE[k] for k in ("block_out_channels", "layers_per_block", "norm_num_groups", "sample_size")}
    model = load_model("vae", "sd-vae", backend, weights=str(path), options=ModelOptions(config=arch))
    assert model.has_encoder
    rng = np.random.default_rng(seed)
    lat = rng.standard_normal((1, 4, 9, 13)).astype(np.float32)
    err = rel_l2(model.decode(lat, tiled=False), diffusers_decode(vae, lat))
    assert err < TOL, f"LDM decode seed {seed}: rel L2 {err:.2e}"
    img = rng.uniform(0, 1, (1, 40, 56, 3)).astype(np.float32)
    err = rel_l2(model.encode(img), diffusers_encode(vae, img))
    assert err < TOL, f"LDM encode seed {seed}: rel L2 {err:.2e}"


def test_registry_tolerates_a_missing_family(monkeypatch):
    """A family module that is absent (or fails to import) is left out and named, the rest load."""
    from models import registry
    monkeypatch.setattr(registry, "FAMILIES", (*registry.FAMILIES, "no_such_family"))
    presets = registry._Presets()
    assert "tiny-vae" in presets and presets["tiny-vae"].family == "autoencoder_kl"
    assert presets["tiny-vae"].tiny and not presets["sd-vae"].tiny
    assert presets.unavailable == {"no_such_family": "not installed"}
    # the real registry merges the other families' presets beside ours
    assert {"sd-vae", "sdxl-vae", "flux-vae", "tiny-vae", "tiny-flux-vae"} <= set(PRESETS)
    for name in PRESETS:
        assert PRESETS[name].kind in ("image-decoder", "video-decoder", "image-encoder")


def _backend_or_skip(name: str):
    if name == "mlx":
        pytest.importorskip("mlx.core")
    try:
        return get_backend(name)
    except Exception as exc:  # mlx installed but unusable here
        pytest.skip(f"{name} backend unavailable: {exc}")


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
@pytest.mark.parametrize("tiled", [False, True])
def test_uint8_decode_is_to_uint8_of_the_float_decode(backend_name, tiled):
    """decode(uint8=True) == to_uint8(decode()) bit for bit, untiled (converted by the backend
    before the copy: to_host_async(uint8=True)) and tiled (blended in float32, converted on the
    host). Latents scaled up so the unclamped output leaves [0, 1] on both sides."""
    from pixel_cases import host_to_uint8

    be = _backend_or_skip(backend_name)
    model = load_model("demo", "tiny-vae", be, options=AutoencoderKLOptions(tile_latent_size=8))
    lat = (np.random.default_rng(fresh_seed()).standard_normal((2, model.latent_channels, 13, 19)) * 3).astype(np.float32)
    raw = model.decode(lat, tiled=tiled, clamp=False)
    assert raw.min() < 0 and raw.max() > 1, "nothing to clip; the test would be vacuous"
    calls = []
    inner = be.to_host_async
    be.to_host_async = lambda x, clip=None, *, uint8=False: calls.append(uint8) or inner(x, clip, uint8=uint8)
    try:
        ours = model.decode(lat, tiled=tiled, uint8=True)
    finally:
        del be.to_host_async
    assert ours.dtype == np.uint8 and ours.shape == (2, 13 * 8, 19 * 8, 3)
    np.testing.assert_array_equal(ours, host_to_uint8(model.decode(lat, tiled=tiled)))
    np.testing.assert_array_equal(ours, host_to_uint8(raw))
    assert len(np.unique(ours)) > 200
    # untiled: one device conversion; tiled: float tiles, converted after blending
    assert (len(calls) > 1 and not any(calls)) if tiled else calls == [True], calls
    if tiled:  # the tiles really blend: untiled differs
        assert (ours != model.decode(lat, tiled=False, uint8=True)).mean() > 0.01
