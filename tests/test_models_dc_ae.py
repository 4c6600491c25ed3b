"""SANA's DC-AE (diffusers AutoencoderDC + the SANA pipeline's latent scaling) on the NumPy backend
and on MLX's CPU device vs diffusers itself, same random weights in every parameter, through the
public load_model path: decode (diffusers' linear and quadratic attention forms), encode, both
resampler kinds, diffusers' tiled decode, decoder-only and full checkpoints with strict loading,
config refusals."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from convkernels import get_backend
from models import PRESETS, ModelConfigError, WeightsError, load_model
from models.dc_ae import DCAEOptions

torch = pytest.importorskip("torch")
diffusers = pytest.importorskip("diffusers")
safetensors_torch = pytest.importorskip("safetensors.torch")
from torch_reference import assert_informative, fresh_seed, rel_l2  # noqa: E402

TOL = 1e-4

# 4 levels (spatial factor 8): ResBlocks on the two finest, EfficientViT blocks on the others, two
# multi-scale kernels on the widest; SANA's stride-2 conv downsamplers and interpolating upsamplers
SMALL = dict(in_channels=3, latent_channels=8, attention_head_dim=8,
             encoder_block_types=["ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock"],
             decoder_block_types=["ResBlock", "ResBlock", "EfficientViTBlock", "EfficientViTBlock"],
             encoder_block_out_channels=[8, 16, 16, 32], decoder_block_out_channels=[8, 16, 16, 32],
             encoder_layers_per_block=[1, 1, 1, 2], decoder_layers_per_block=[1, 1, 1, 2],
             encoder_qkv_multiscales=[[], [], [5], [3, 5]], decoder_qkv_multiscales=[[], [], [5], [3, 5]],
             upsample_block_type="interpolate", downsample_block_type="Conv", decoder_norm_types="rms_norm",
             decoder_act_fns="silu", scaling_factor=0.41407)
# the other resamplers (conv + pixel (un)shuffle), per-level activations, no in/out shortcuts
SHUFFLE = dict(SMALL, upsample_block_type="pixel_shuffle", downsample_block_type="pixel_unshuffle",
               decoder_act_fns=["relu", "silu", "silu", "gelu"], decoder_in_shortcut=False,
               encoder_out_shortcut=False, scaling_factor=0.3)
TINY = dict(PRESETS["tiny-dc-ae"].config)


def make_vae(cfg: dict, seed: int):
    """An AutoencoderDC with every parameter moved off its init (norms off identity, biases
    nonzero), so a layer loaded wrong or skipped shows."""
    torch.manual_seed(seed)
    vae = diffusers.AutoencoderDC(**cfg).eval()
    with torch.no_grad():
        for name, p in vae.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if name.endswith("weight") else 0.1 * torch.randn_like(p))
            else:
                p.copy_(p * (1.0 + 0.1 * torch.randn_like(p)) + 0.02 * torch.randn_like(p))
    return vae


def pipeline_decode(vae, x: np.ndarray, *, clamp: bool = True, descale: bool = True) -> np.ndarray:
    """SanaPipeline's last step: latents / scaling_factor, vae.decode, postprocess -> NHWC.
    descale=False: the vacuity guard's broken twin."""
    with torch.no_grad():
        z = torch.from_numpy(x)
        out = vae.decode(z / vae.config.scaling_factor if descale else z).sample
    out = (out / 2 + 0.5).clamp(0, 1) if clamp else out / 2 + 0.5
    return out.permute(0, 2, 3, 1).numpy()


def pipeline_encode(vae, images_nhwc: np.ndarray, *, scale: bool = True) -> np.ndarray:
    """The encoder's latent times scaling_factor, as the SANA pipelines hand latents on."""
    x = torch.from_numpy(images_nhwc).permute(0, 3, 1, 2) * 2 - 1
    with torch.no_grad():
        lat = vae.encode(x).latent
    return (lat * vae.config.scaling_factor if scale else lat).numpy()


def backend_named(name: str):
    if name == "mlx":
        pytest.importorskip("mlx.core")
    return get_backend(name)


def _saved(tmp_path_factory, cfg: dict, name: str):
    seed = fresh_seed()
    vae = make_vae(cfg, seed)
    folder = tmp_path_factory.mktemp(name)
    vae.save_pretrained(folder)
    return vae, str(folder), seed


@pytest.fixture(scope="module")
def small_vae(tmp_path_factory):
    return _saved(tmp_path_factory, SMALL, "dc_ae_small")


@pytest.fixture(scope="module")
def shuffle_vae(tmp_path_factory):
    return _saved(tmp_path_factory, SHUFFLE, "dc_ae_shuffle")


def _check_decode(vae, folder, seed, backend_name, cases):
    model = load_model("d", "dc-ae-f32c32", backend_named(backend_name), weights=folder)
    assert model.kind == "image-decoder" and model.has_encoder
    assert (model.latent_channels, model.spatial_factor) == (8, 8)
    rng = np.random.default_rng(seed)
    for n, h, w in cases:
        x = rng.standard_normal((n, model.latent_channels, h, w)).astype(np.float32)
        ours, ref = model.decode(x, tiled=False), pipeline_decode(vae, x)
        assert ours.shape == (n, 8 * h, 8 * w, 3) and ours.dtype == np.float32
        assert_informative(ref, f"seed {seed}")
        err = rel_l2(ours, ref)
        print(f"{backend_name} decode {(n, h, w)}: rel L2 {err:.2e}")
        assert err < TOL, f"{backend_name} {(n, h, w)} seed {seed}: rel L2 {err:.2e}"
        raw_err = rel_l2(model.decode(x, tiled=False, clamp=False), pipeline_decode(vae, x, clamp=False))
        assert raw_err < TOL, f"{backend_name} unclamped {(n, h, w)} seed {seed}: rel L2 {raw_err:.2e}"
        broken = rel_l2(ours, pipeline_decode(vae, x, descale=False))
        assert broken > 100 * TOL, f"dropping the de-scaling changes nothing (rel L2 {broken:.2e})"
    return model


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_decode_matches_the_pipeline(small_vae, backend_name):
    # (1, 2, 3): the widest level has 6 tokens, fewer than head_dim 8, so diffusers takes its
    # quadratic form there; the others its linear form
    _check_decode(*small_vae, backend_name, [(2, 5, 3), (1, 3, 7), (1, 2, 3)])


def test_pixel_shuffle_resamplers_match_the_pipeline(shuffle_vae):
    _check_decode(*shuffle_vae, "numpy", [(2, 3, 5)])
    vae, folder, seed = shuffle_vae
    model = load_model("d", "dc-ae-f32c32", get_backend("numpy"), weights=folder)
    img = np.random.default_rng(seed).uniform(0, 1, (2, 24, 40, 3)).astype(np.float32)
    err = rel_l2(model.encode(img), pipeline_encode(vae, img))
    print(f"pixel_unshuffle encode: rel L2 {err:.2e}")
    assert err < TOL, f"seed {seed}: rel L2 {err:.2e}"


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_encode_matches_the_pipeline(small_vae, backend_name):
    vae, folder, seed = small_vae
    model = load_model("d", "dc-ae-f32c32", backend_named(backend_name), weights=folder)
    img = np.random.default_rng(seed).uniform(0, 1, (2, 40, 24, 3)).astype(np.float32)
    ours, ref = model.encode(img), pipeline_encode(vae, img)
    assert ours.shape == (2, 8, 5, 3)
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
    tile = 8  # 64-pixel tiles every 56 (7 latents), blended over 8 pixels: diffusers' 512 / 448 at 8x
    model = load_model("d", "dc-ae-f32c32", get_backend("numpy"), weights=folder,
                       options=DCAEOptions(tile_latent_size=tile))
    vae.enable_tiling(tile_sample_min_height=tile * 8, tile_sample_min_width=tile * 8,
                      tile_sample_stride_height=7 * 8, tile_sample_stride_width=7 * 8)
    try:
        x = np.random.default_rng(seed).standard_normal((1, 8, 12, 9)).astype(np.float32)
        ours, ref = model.decode(x, tiled=True), pipeline_decode(vae, x)
    finally:
        vae.use_tiling = False
    err = rel_l2(ours, ref)
    untiled_diff = rel_l2(model.decode(x, tiled=False), ref)
    print(f"tiled decode, {tile}-latent tiles: rel L2 {err:.2e} (untiled vs tiled reference {untiled_diff:.2e})")
    assert ours.shape == ref.shape == (1, 96, 72, 3)
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
    assert config["_class_name"] == "AutoencoderDC"
    sd = vae.state_dict()
    decoder_only = {k: v for k, v in sd.items() if k.startswith("decoder.")}
    model = load_model("d", "dc-ae-f32c32", get_backend("numpy"), weights=_folder(tmp_path, "dec", decoder_only, config))
    assert not model.has_encoder and model.card()["has_encoder"] is False
    x = np.random.default_rng(seed).standard_normal((1, 8, 3, 4)).astype(np.float32)
    assert rel_l2(model.decode(x), pipeline_decode(vae, x)) < TOL, f"seed {seed}"
    with pytest.raises(RuntimeError, match="no encoder"):
        model.encode(np.zeros((1, 16, 16, 3), np.float32))
    name = "decoder.up_blocks.3.1.attn.to_qkv_multiscale.1.proj_in.weight"
    missing = {k: v for k, v in sd.items() if k != name}
    with pytest.raises(WeightsError, match=rf"missing \(1\): {name.replace('.', '[.]')}"):
        load_model("d", "dc-ae-f32c32", get_backend("numpy"), weights=_folder(tmp_path, "miss", missing, config))
    bent = "decoder.up_blocks.2.1.conv_out.conv_depth.weight"
    misshaped = {**sd, bent: torch.zeros(3, 1, 3, 3)}
    with pytest.raises(WeightsError, match=rf"{bent.replace('.', '[.]')}.*\(3, 1, 3, 3\)"):
        load_model("d", "dc-ae-f32c32", get_backend("numpy"), weights=_folder(tmp_path, "bent", misshaped, config))
    extra = {**sd, "decoder.up_blocks.3.1.attn.to_out.bias": torch.zeros(32)}
    with pytest.raises(WeightsError, match=r"unexpected \(1\): decoder\.up_blocks\.3\.1\.attn\.to_out\.bias"):
        load_model("d", "dc-ae-f32c32", get_backend("numpy"), weights=_folder(tmp_path, "extra", extra, config))
    partial_encoder = {k: v for k, v in sd.items() if k != "encoder.conv_in.weight"}
    with pytest.raises(WeightsError, match=r"encoder\.conv_in\.weight"):
        load_model("d", "dc-ae-f32c32", get_backend("numpy"), weights=_folder(tmp_path, "partial", partial_encoder, config))
    with pytest.raises(WeightsError, match="AutoencoderDC"):
        load_model("d", "dc-ae-f32c32", get_backend("numpy"),
                   weights=_folder(tmp_path, "other", sd, {**config, "_class_name": "AutoencoderKL"}))


def test_configs_diffusers_cannot_run_are_refused():
    backend = get_backend("numpy")
    for bad, what in [({"decoder_norm_types": "batch_norm"}, "only rms_norm"),
                      ({"decoder_act_fns": "relu6"}, "activations"),
                      ({"decoder_layers_per_block": [0, 1, 1]}, "layers_per_block 0"),
                      ({"decoder_block_types": ["ResBlock", "Other", "ResBlock"]}, "block type 'Other'"),
                      ({"attention_head_dim": 6}, "attention_head_dim"),
                      ({"encoder_block_out_channels": [8, 16, 40]}, "a downsample 16->40"),
                      ({"latent_channels": 12}, "latent_channels")]:
        with pytest.raises(ModelConfigError, match=what):
            load_model("d", "tiny-dc-ae", backend, options=DCAEOptions(config=bad))


def test_tiny_preset_matches_diffusers_and_is_quick(tmp_path):
    import time
    model = load_model("d", "tiny-dc-ae", get_backend("numpy"))
    assert model.weights_source == "random init" and model.spatial_factor == 4
    x = np.random.default_rng(0).standard_normal((1, 8, 8, 8)).astype(np.float32)
    t0 = time.perf_counter()
    out = model.decode(x)
    assert out.shape == (1, 32, 32, 3) and np.isfinite(out).all()
    assert model.encode(out).shape == (1, 8, 8, 8)
    assert time.perf_counter() - t0 < 5.0
    seed = fresh_seed()
    vae = make_vae(TINY, seed)
    vae.save_pretrained(tmp_path)
    model = load_model("d", "tiny-dc-ae", get_backend("numpy"), weights=str(tmp_path))
    assert rel_l2(model.decode(x), pipeline_decode(vae, x)) < TOL, f"seed {seed}"
