"""The Qwen-Image 2.1 VAE on the CUDA backend vs diffusers' AutoencoderKLQwenImage21 + the Qwen-Image 2.1
pipeline's de-normalisation (and its _encode_vae_image), run by PyTorch in float32 (on the CPU; the full
preset's decode on the GPU, TF32 off), identical random weights in every parameter and non-trivial
latents_mean/std, through the public models.load_model path: relative L2 < 1e-4 in float32, < 1e-2 in
float16 / bfloat16; all four RGBA channels (decode_rgba, what the service serves) and decode's RGB; N,C,h,w
and the pipeline's N,C,1,h,w, untiled and in the Wan VAE's tiles; encode untiled. Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_support import OnDevice, cuda_backend as backend, cuda_or_skip, report_parity as report
from torch_reference import rel_l2, torch

pytestmark = pytest.mark.gpu
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2}

# the CPU references: the same helpers as the CPU parity tests (tests/test_models_qwen_image21_vae.py)
q21_ref = pytest.importorskip("test_models_qwen_image21_vae")

FULL = dict(q21_ref.PRESETS["qwen-image2.1-vae"])


@pytest.fixture(scope="module", autouse=True)
def cuda_backend_available():
    cuda_or_skip()


@pytest.mark.parametrize("preset,cfg,dtype,lat", [
    ("tiny-qwen-image2.1-vae", q21_ref.SMALL, "float32", (2, 8, 5, 7)),
    ("tiny-qwen-image2.1-vae", q21_ref.SMALL, "float16", (1, 8, 1, 9, 11)),
    ("qwen-image2.1-vae", FULL, "float32", (1, 64, 6, 5)),
    ("qwen-image2.1-vae", FULL, "bfloat16", (1, 64, 1, 8, 10)),
])
def test_qwen_image21_vae_decode(tmp_path, preset, cfg, dtype, lat):
    from models import load_model

    s = q21_ref.fresh_seed()
    vae, folder, config = q21_ref.make_reference(tmp_path, cfg, s)
    model = load_model("q21", preset, backend(dtype), weights=folder)
    latents = np.random.default_rng(s).standard_normal(lat).astype(np.float32)
    ours = model.decode_rgba(latents, tiled=False)
    full = preset == "qwen-image2.1-vae"
    ref = q21_ref.reference_decode(OnDevice(vae, torch.float32) if full else vae, config, latents)
    assert 0.02 < float(ref.std()), "reference decode is flat: the check would prove nothing"
    err = rel_l2(ours, ref)
    report(f"{preset} {dtype} latents {lat}: rel L2 {err:.2e} (RGBA)")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
    assert rel_l2(model.decode(latents, tiled=False), ref[..., :3]) < TOL[dtype], f"seed {s}: RGB"
    # the second call records the one-frame forward as a CUDA graph, the third replays it
    replayed = [model.decode_rgba(latents, tiled=False) for _ in range(2)][-1]
    assert rel_l2(replayed, ref) < TOL[dtype], f"seed {s}: the recorded forward's replay"
    bare = rel_l2(ours, q21_ref.reference_decode(vae, config, latents, denormalise=False))
    assert bare > max(3 * err, 100 * TOL["float32"]), f"seed {s}: without de-normalisation {bare:.3e}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_qwen_image21_vae_tiled_decode(tmp_path, dtype):
    from models.qwen_image21_vae import QwenImage21VAEOptions, build

    s = q21_ref.fresh_seed()
    vae, folder, config = q21_ref.make_reference(tmp_path, q21_ref.SMALL, s)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                      tile_sample_stride_height=48, tile_sample_stride_width=48)
    model = build("q21", "tiny-qwen-image2.1-vae", backend(dtype), folder,
                  QwenImage21VAEOptions(tile_sample_min_size=64, tile_sample_stride=48))
    latents = np.random.default_rng(s).standard_normal((2, 8, 13, 11)).astype(np.float32)
    err = rel_l2(model.decode_rgba(latents, tiled=True), q21_ref.reference_decode(vae, config, latents))
    report(f"tiny-qwen-image2.1-vae {dtype} tiled: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"


@pytest.mark.parametrize("preset,cfg,dtype,images", [
    ("tiny-qwen-image2.1-vae", q21_ref.SMALL, "float32", (2, 48, 80, 4)),
    ("qwen-image2.1-vae", FULL, "float16", (1, 64, 48, 4)),
])
def test_qwen_image21_vae_encode(tmp_path, preset, cfg, dtype, images):
    from models import load_model

    s = q21_ref.fresh_seed()
    vae, folder, config = q21_ref.make_reference(tmp_path, cfg, s)
    model = load_model("q21", preset, backend(dtype), weights=folder)
    x = np.random.default_rng(s).random(images, dtype=np.float32)
    err = rel_l2(model.encode(x), q21_ref.reference_encode(vae, config, x))
    report(f"{preset} {dtype} encode {images}: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
