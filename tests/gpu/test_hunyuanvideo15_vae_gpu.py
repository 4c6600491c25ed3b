"""The HunyuanVideo 1.5 VAE decoder on the CUDA backend vs diffusers' AutoencoderKLHunyuanVideo15 + the
pipeline's latent scaling, run by PyTorch on the CPU in float32 one sample at a time, identical random
weights, through the public models.load_model path: relative L2 < 1e-4 in float32, < 1e-2 in float16,
for the whole decode and its streamed frame groups, and for the encoder (the image-to-video pipeline's
posterior mode * scaling_factor, tests/test_models_hunyuanvideo15_vae_encoder.py's reference) (the chunked decode runs eagerly: the attention's
keys and values grow with the clip, so no step repeats its shapes). Skipped without a CUDA GPU + CuPy
+ cuDNN."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_support import cuda_backend as backend, cuda_or_skip, report_parity as report
from torch_reference import rel_l2

pytestmark = pytest.mark.gpu
TOL = {"float32": 1e-4, "float16": 1e-2}

# the CPU references: the same helpers as the CPU parity tests (tests/test_models_hunyuanvideo15_vae.py)
hv_ref = pytest.importorskip("test_models_hunyuanvideo15_vae")
enc_ref = pytest.importorskip("test_models_hunyuanvideo15_vae_encoder")

FULL = dict(hv_ref.PRESETS["hunyuanvideo1.5-vae"].config)


@pytest.fixture(scope="module", autouse=True)
def cuda_backend_available():
    cuda_or_skip()


@pytest.mark.parametrize("preset,cfg,dtype,grid", [
    ("tiny-hunyuanvideo1.5-vae", hv_ref.TINY, "float32", (2, 8, 3, 5, 7)),
    ("tiny-hunyuanvideo1.5-vae", hv_ref.TINY, "float16", (1, 8, 4, 9, 4)),
    ("hunyuanvideo1.5-vae", FULL, "float16", (1, 32, 2, 3, 5)),
])
def test_hunyuanvideo15_vae_decode(tmp_path, preset, cfg, dtype, grid):
    from models import load_model

    s = hv_ref.fresh_seed()
    vae = hv_ref.make_vae(cfg, s)
    vae.save_pretrained(tmp_path)
    model = load_model("hv", preset, backend(dtype), weights=str(tmp_path))
    x = np.random.default_rng(s).standard_normal(grid).astype(np.float32)
    ref = hv_ref.pipeline_decode(vae, x)
    assert 0.02 < float(ref.std()), "reference decode is flat: the check would prove nothing"
    err = rel_l2(model.decode(x, tiled=False), ref)
    report(f"{preset} {dtype} grid {grid}: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
    groups = list(model.decode_frames(x, tiled=False))
    assert [g.shape[1] for g in groups] == [1] + [4] * (grid[2] - 1)
    err = rel_l2(np.concatenate(groups, axis=1), ref)
    report(f"{preset} {dtype} grid {grid} streamed: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}, streamed: {err:.3e}"


@pytest.mark.parametrize("preset,cfg,dtype,shape", [
    ("tiny-hunyuanvideo1.5-vae", hv_ref.TINY, "float32", (2, 5, 24, 40)),
    ("tiny-hunyuanvideo1.5-vae", hv_ref.TINY, "float16", (1, 9, 16, 24)),
    ("hunyuanvideo1.5-vae", FULL, "float16", (1, 5, 48, 80)),
])
def test_hunyuanvideo15_vae_encode(tmp_path, preset, cfg, dtype, shape):
    from models import load_model

    s = hv_ref.fresh_seed()
    vae = hv_ref.make_vae(cfg, s)
    vae.save_pretrained(tmp_path)
    model = load_model("hv", preset, backend(dtype), weights=str(tmp_path))
    video = np.random.default_rng(s).random((*shape, 3), dtype=np.float32)
    ref = enc_ref.pipeline_encode(vae, video)
    err = rel_l2(model.encode(video), ref)
    report(f"{preset} {dtype} encode {shape}: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
