"""The Qwen-Image VAE decoder on the CUDA backend vs diffusers' AutoencoderKLQwenImage + the Qwen-Image
pipeline's de-normalisation (and the edit pipeline's encode), run by PyTorch in float32 (on the CPU; the full
preset's decode on the GPU, TF32 off), identical random weights (every
parameter drawn afresh) and non-trivial latents_mean/std, through the public models.load_model path:
relative L2 < 1e-4 in float32 (TF32 is off by default), < 1e-2 in float16 / bfloat16; N,16,h,w and the
pipeline's N,16,1,h,w, untiled and in the Wan VAE's tiles; encode untiled. Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations


import numpy as np
import pytest
from gpu_support import OnDevice, cuda_backend as backend, cuda_or_skip, report_parity as report
from torch_reference import rel_l2, torch

pytestmark = pytest.mark.gpu
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2}

# the CPU references: the same helpers as the CPU parity tests (tests/test_models_qwen_image_vae.py)
qwen_ref = pytest.importorskip("test_models_qwen_image_vae")

FULL = dict(qwen_ref.PRESETS["qwen-image-vae"])


@pytest.fixture(scope="module", autouse=True)
def cuda_backend_available():
    cuda_or_skip()


@pytest.mark.parametrize("preset,cfg,dtype,lat", [
    ("tiny-qwen-image-vae", qwen_ref.QWEN_SMALL, "float32", (2, 16, 5, 7)),
    ("tiny-qwen-image-vae", qwen_ref.QWEN_SMALL, "float16", (1, 16, 1, 9, 11)),
    ("qwen-image-vae", FULL, "float32", (1, 16, 6, 5)),
    ("qwen-image-vae", FULL, "bfloat16", (1, 16, 1, 12, 16)),
])
def test_qwen_image_vae_decode(tmp_path, preset, cfg, dtype, lat):
    from models import load_model

    s = qwen_ref.fresh_seed()
    vae, folder, config = qwen_ref.make_reference(tmp_path, cfg, s)
    model = load_model("qi", preset, backend(dtype), weights=str(folder))
    latents = np.random.default_rng(s).standard_normal(lat).astype(np.float32)
    ours = model.decode(latents, tiled=False)
    # the full preset's float32 reference runs on the GPU (TF32 off), as the suite's time asks
    ref = qwen_ref.reference_decode(OnDevice(vae, torch.float32) if preset == "qwen-image-vae" else vae, config, latents)
    assert 0.02 < float(ref.std()), "reference decode is flat: the check would prove nothing"
    err = rel_l2(ours, ref)
    report(f"{preset} {dtype} latents {lat}: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
    # the second call records the one-frame forward as a CUDA graph, the third replays it
    replayed = [model.decode(latents, tiled=False) for _ in range(2)][-1]
    assert rel_l2(replayed, ref) < TOL[dtype], f"seed {s}: the recorded forward's replay"
    # vacuity guard: the reference without the pipeline's de-normalisation is clearly further away
    bare = rel_l2(ours, qwen_ref.reference_decode(vae, config, latents, denormalise=False))
    assert bare > max(3 * err, 100 * TOL["float32"]), f"seed {s}: without de-normalisation {bare:.3e}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_qwen_image_vae_tiled_decode(tmp_path, dtype):
    from models.qwen_image_vae import QwenImageVAEOptions, build

    s = qwen_ref.fresh_seed()
    vae, folder, config = qwen_ref.make_reference(tmp_path, qwen_ref.QWEN_SMALL, s)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                      tile_sample_stride_height=48, tile_sample_stride_width=48)
    model = build("qi", "tiny-qwen-image-vae", backend(dtype), str(folder),
                  QwenImageVAEOptions(tile_sample_min_size=64, tile_sample_stride=48))
    latents = np.random.default_rng(s).standard_normal((2, 16, 13, 11)).astype(np.float32)
    ours = model.decode(latents, tiled=True)
    ref = qwen_ref.reference_decode(vae, config, latents)
    err = rel_l2(ours, ref)
    report(f"tiny-qwen-image-vae {dtype} tiled: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"


@pytest.mark.parametrize("preset,cfg,dtype,images", [
    ("tiny-qwen-image-vae", qwen_ref.QWEN_SMALL, "float32", (2, 40, 56, 3)),
    ("qwen-image-vae", FULL, "float16", (1, 48, 40, 3)),
])
def test_qwen_image_vae_encode(tmp_path, preset, cfg, dtype, images):
    from models import load_model

    s = qwen_ref.fresh_seed()
    vae, folder, config = qwen_ref.make_reference(tmp_path, cfg, s)
    model = load_model("qi", preset, backend(dtype), weights=str(folder))
    x = np.random.default_rng(s).random(images, dtype=np.float32)
    err = rel_l2(model.encode(x), qwen_ref.reference_encode(vae, config, x))
    report(f"{preset} {dtype} encode {images}: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
