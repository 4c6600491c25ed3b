"""Whole models on the CUDA backend vs their reference implementations with identical random
weights (diffusers AutoencoderKL / AutoencoderKLWan, transformers ConvNextModel, run by PyTorch
on the same GPU in float32 with TF32 off), through the public models.load_model path:
relative L2 < 1e-2 in float16 / bfloat16. The image VAE and ConvNeXt run twice with fresh inputs:
eagerly, then captured and replayed as a CUDA graph (on by default), which must happen.
Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_support import cuda_backend as backend, cuda_or_skip, report_parity as report
from torch_reference import rel_l2, torch

pytestmark = pytest.mark.gpu
TOL = 1e-2


@pytest.fixture(scope="module", autouse=True)
def gpu_reference_in_true_fp32():
    cuda_or_skip()
    if not torch.cuda.is_available():
        pytest.skip("PyTorch has no CUDA here: the references run on the GPU")
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_tf32 = False


def assert_captured(forward, calls: int) -> None:
    """`calls` calls of a graphed forward: the first eager, every later one a replay of one
    capture. A forward that could not be captured fails here (it would only warn when serving)."""
    stats = forward.stats()
    assert stats["ungraphable"] == {}, f"forward not capturable: {stats['ungraphable']}"
    assert stats["captures"] == 1 and stats["replays"] == calls - 1, stats


def seed() -> int:
    return int.from_bytes(os.urandom(4), "little")


def perturb_(model, s: int, norm_words=("norm",)):
    """Every parameter away from its init value (norm scales near 1, biases nonzero), so a
    wrongly mapped or dropped parameter shows."""
    torch.manual_seed(s)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(w in name for w in norm_words) or name.endswith("gamma"):
                p.copy_(1.0 + 0.2 * torch.randn_like(p) if not name.endswith("bias") else 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.05 * torch.randn_like(p))
            else:
                p.mul_(1.0 + 0.1 * torch.randn_like(p))


# ---- image VAE --------------------------------------------------------------------------------
SD = dict(block_out_channels=(128, 256, 512, 512), layers_per_block=2, norm_num_groups=32, latent_channels=4,
          sample_size=512, scaling_factor=0.18215)
TINY = dict(block_out_channels=(16, 32, 32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=4,
            sample_size=256, scaling_factor=0.18215)


@pytest.mark.parametrize("preset,cfg,dtype,lat", [
    ("tiny-vae", TINY, "float16", (2, 4, 24, 20)),
    ("tiny-vae", TINY, "bfloat16", (1, 4, 17, 23)),
    ("sd-vae", SD, "float16", (1, 4, 32, 32)),
    ("sd-vae", SD, "bfloat16", (1, 4, 24, 32)),
])
def test_image_vae_decode(tmp_path, preset, cfg, dtype, lat):
    diffusers = pytest.importorskip("diffusers")
    from models import load_model

    s = seed()
    n = len(cfg["block_out_channels"])
    torch.manual_seed(s)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * n,
                                  up_block_types=("UpDecoderBlock2D",) * n, **cfg).eval()
    perturb_(vae, s)
    vae.save_pretrained(tmp_path)
    model = load_model("vae", preset, backend(dtype), weights=str(tmp_path))
    rng = np.random.default_rng(s)
    vae = vae.cuda()
    for call in ("eager", "graph"):
        latents = rng.standard_normal(lat).astype(np.float32)
        ours = model.decode(latents, tiled=False)
        with torch.no_grad():
            ref = vae.decode(torch.from_numpy(latents).cuda() / cfg["scaling_factor"]).sample
        ref = (ref / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().numpy()
        assert 0.02 < float(ref.std()), "reference decode is flat: the check would prove nothing"
        err = rel_l2(ours, ref)
        report(f"{preset} {dtype} latents {lat} {call}: rel L2 {err:.2e}")
        assert err < TOL, f"seed {s}, {call}: {err:.3e}"
    assert_captured(model._decode_device, 2)


# ---- Wan video VAE ----------------------------------------------------------------------------
WAN_TINY = dict(base_dim=16, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1, temperal_downsample=[False, True, True])


@pytest.mark.parametrize("preset,cfg,dtype,lat", [
    ("tiny-wan-vae", WAN_TINY, "bfloat16", (1, 4, 5, 12, 10)),
    ("tiny-wan-vae", WAN_TINY, "float16", (1, 4, 2, 9, 11)),
    ("tiny-wan-vae", WAN_TINY, "float16", (2, 4, 6, 9, 11)),
    ("wan2.1-vae", {}, "bfloat16", (1, 16, 2, 12, 16)),
])
def test_wan_vae_decode(tmp_path, preset, cfg, dtype, lat):
    diffusers = pytest.importorskip("diffusers")
    from models import load_model

    s = seed()
    torch.manual_seed(s)
    rng = np.random.default_rng(s)
    z = cfg.get("z_dim", 16)
    vae = diffusers.AutoencoderKLWan(**cfg, latents_mean=rng.normal(0, 0.5, z).round(4).tolist(),
                                     latents_std=rng.uniform(0.5, 3.0, z).round(4).tolist()).eval()
    perturb_(vae, s)
    vae.save_pretrained(tmp_path)
    model = load_model("wan", preset, backend(dtype), weights=str(tmp_path))
    latents = rng.standard_normal(lat).astype(np.float32)
    ours = model.decode(latents)
    mean = torch.tensor(vae.config.latents_mean).view(1, -1, 1, 1, 1)
    std = torch.tensor(vae.config.latents_std).view(1, -1, 1, 1, 1)
    vae = vae.cuda()
    with torch.no_grad():
        video = vae.decode((torch.from_numpy(latents) * std + mean).cuda()).sample
    ref = (video / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 4, 1).cpu().numpy()
    assert 0.02 < float(ref.std())
    err = rel_l2(ours, ref)
    report(f"{preset} {dtype} latents {lat}: rel L2 {err:.2e}")
    assert err < TOL, f"seed {s}: {err:.3e}"
    # chunks from the third on repeat their shapes: the third runs eagerly, the fourth is
    # captured, every later one replays (the replayed frames were just checked above)
    steady = model._steady_step.stats()
    assert steady["ungraphable"] == {} and steady["replays"] == max(0, lat[2] - 3), steady


# ---- ConvNeXt ---------------------------------------------------------------------------------
@pytest.mark.parametrize("preset,arch,size,dtype", [
    ("tiny-convnext", {"depths": [1, 1, 2, 1], "hidden_sizes": [16, 32, 48, 64]}, 64, "float16"),
    ("tiny-convnext", {"depths": [1, 1, 2, 1], "hidden_sizes": [16, 32, 48, 64]}, 97, "bfloat16"),
    ("convnext-tiny", {"depths": [3, 3, 9, 3], "hidden_sizes": [96, 192, 384, 768]}, 224, "float16"),
    ("convnext-tiny", {"depths": [3, 3, 9, 3], "hidden_sizes": [96, 192, 384, 768]}, 224, "bfloat16"),
])
def test_convnext_encode(tmp_path, preset, arch, size, dtype):
    transformers = pytest.importorskip("transformers")
    from models import load_model

    s = seed()
    torch.manual_seed(s)
    ref_model = transformers.ConvNextModel(transformers.ConvNextConfig(**arch)).eval()
    g = torch.Generator().manual_seed(s)
    with torch.no_grad():
        for name, p in ref_model.named_parameters():
            if p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) / p[0].numel() ** 0.5)
            elif name.endswith("layer_scale_parameter"):
                p.copy_(0.3 + 0.5 * torch.rand(p.shape, generator=g))
            elif name.endswith("weight"):
                p.copy_(1.0 + 0.2 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(0.1 * torch.randn(p.shape, generator=g))
    ref_model.save_pretrained(tmp_path, safe_serialization=True)
    model = load_model("enc", preset, backend(dtype), weights=str(tmp_path))
    rng = np.random.default_rng(s)
    mean, std = np.asarray(model.mean, np.float32), np.asarray(model.std, np.float32)
    ref_model = ref_model.cuda()
    runs = []
    for call in ("eager", "graph"):
        pixels = rng.random((2, size, size, 3), dtype=np.float32)
        out = model.encode(pixels)
        x = torch.from_numpy(((pixels - mean) / std).transpose(0, 3, 1, 2).copy()).cuda()
        with torch.no_grad():
            runs.append((call, out["embedding"], ref_model(x).pooler_output.cpu().numpy(), x))
    tdt = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    ref_model = ref_model.to(tdt)
    for call, ours, ref, x in runs:
        with torch.no_grad():
            torch_lowp = ref_model(x.to(tdt)).pooler_output.float().cpu().numpy()
        err, floor = rel_l2(ours, ref), rel_l2(torch_lowp, ref)
        report(f"{preset} {dtype} 2x{size}x{size} {call}: rel L2 {err:.2e} (PyTorch in {dtype}: {floor:.2e})")
        # bfloat16 keeps 8 bits: a random-weight ConvNeXt's pooled embedding can land above 1e-2 in
        # PyTorch's own bf16 run too; then ours must stay within 1.5x of PyTorch's bf16 error.
        tol = max(TOL, 1.5 * floor) if dtype == "bfloat16" else TOL
        assert err < tol, f"seed {s}, {call}: {err:.3e} (PyTorch {dtype}: {floor:.3e})"
    assert_captured(model._encode_device, 2)


def test_a_2048_image_that_fits_is_decoded_whole():
    """The SD VAE at 2048x2048 in float16 fits a GPU's work budget untiled once its attention is
    counted as the backend holds it (blocks of attention_score_bytes, not the 65536^2 matrix), so
    the default decode is the untiled one: no tile seams, and the same pixels as tiled=False."""
    from models import load_model
    from models.nn.tiling import plan_decode

    be = backend("float16")
    model = load_model("sd", "sd-vae", be)
    assert be.attention_score_bytes, "the cuda backend bounds its score blocks by size"
    lat = np.random.default_rng(seed()).standard_normal((1, 4, 256, 256)).astype(np.float32)
    assert plan_decode(model, (1, 256, 256, 4), None) is None, "a 2048x2048 decode that fits was tiled"
    auto = model.decode(lat)
    whole = model.decode(lat, tiled=False)
    assert auto.shape == (1, 2048, 2048, 3) and np.isfinite(auto).all()
    assert rel_l2(auto, whole) < 1e-3
