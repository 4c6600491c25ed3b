"""The Wan 2.2 VAE decoder on the CUDA backend vs diffusers' AutoencoderKLWan(is_residual=True,
patch_size=2) + the Wan 2.2 pipeline's de-normalisation, run by PyTorch in float32 (the tiny configs on the
CPU, the full preset's decode on the GPU with TF32 off), identical
random weights (every parameter drawn afresh) and non-trivial latents_mean/std, through the public
models.load_model path: relative L2 < 1e-4 in float32 (TF32 is off by default), < 1e-2 in float16 /
bfloat16; untiled and in the Wan VAE's tiles; T = 3 latent frames (the steady, graphed chunk included).
Encode (the TI2V pipeline's normalised latents) untiled, over 1 + 4 + 4 frames. Skipped without a CUDA
GPU + CuPy + cuDNN."""
from __future__ import annotations


import numpy as np
import pytest
from gpu_support import OnDevice, cuda_backend as backend, cuda_or_skip, report_parity as report
from torch_reference import rel_l2, torch

pytestmark = pytest.mark.gpu
TOL = {"float32": 1e-4, "float16": 1e-2, "bfloat16": 1e-2}

# the CPU references: the same helpers as the CPU parity tests (tests/test_models_wan22_vae.py)
wan22_ref = pytest.importorskip("test_models_wan22_vae")
wan22_enc_ref = pytest.importorskip("test_models_wan22_vae_encoder")

FULL = dict(wan22_ref.PRESETS["wan2.2-vae"])


@pytest.fixture(scope="module", autouse=True)
def cuda_backend_available():
    cuda_or_skip()


@pytest.mark.parametrize("preset,cfg,dtype,lat,phases", [
    ("tiny-wan2.2-vae", wan22_ref.WAN22_SMALL, "float32", (2, 12, 3, 5, 7), False),
    ("tiny-wan2.2-vae", wan22_ref.WAN22_ODD, "float16", (1, 7, 3, 3, 5), False),
    ("wan2.2-vae", FULL, "float32", (1, 48, 3, 3, 4), False),
    ("wan2.2-vae", FULL, "bfloat16", (1, 48, 3, 4, 6), False),
    # the upsamplers (their DupUp3D shortcut as the residual) in the phase form (cuda/upsample.py);
    # the tiny configs: two more full-size decodes beside the others ran the suite's 8 workers out
    # of GPU memory
    ("tiny-wan2.2-vae", wan22_ref.WAN22_SMALL, "float32", (2, 12, 3, 5, 7), True),
    ("tiny-wan2.2-vae", wan22_ref.WAN22_ODD, "float16", (1, 7, 3, 3, 5), True),
])
def test_wan22_vae_decode(tmp_path, preset, cfg, dtype, lat, phases):
    from models import load_model

    s = wan22_ref.fresh_seed()
    vae, folder, config = wan22_ref.make_reference(tmp_path, cfg, s)
    model = load_model("w22", preset, backend(dtype, upsample_form="phases" if phases else "transposed"), weights=str(folder))
    latents = np.random.default_rng(s).standard_normal(lat).astype(np.float32)
    ours = model.decode(latents, tiled=False)
    # the full preset's float32 reference runs on the GPU (TF32 off): on the CPU it was the suite's tail
    vae = OnDevice(vae, torch.float32) if preset == "wan2.2-vae" else vae
    ref = wan22_ref.reference_decode(vae, config, latents)
    assert 0.02 < float(ref.std()), "reference decode is flat: the check would prove nothing"
    err = rel_l2(ours, ref)
    report(f"{preset} {dtype} latents {lat}{' upsample phases' if phases else ''}: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
    # vacuity guard: the reference without the pipeline's de-normalisation is clearly further away
    bare = rel_l2(ours, wan22_ref.reference_decode(vae, config, latents, denormalise=False))
    assert bare > max(3 * err, 100 * TOL["float32"]), f"seed {s}: without de-normalisation {bare:.3e}"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_wan22_vae_tiled_decode(tmp_path, dtype):
    from models.wan22_vae import build
    from models.wan_vae import WanVAEOptions

    s = wan22_ref.fresh_seed()
    vae, folder, config = wan22_ref.make_reference(tmp_path, wan22_ref.WAN22_SMALL, s)
    vae.enable_tiling(tile_sample_min_height=64, tile_sample_min_width=64,
                      tile_sample_stride_height=48, tile_sample_stride_width=48)
    model = build("w22", "tiny-wan2.2-vae", backend(dtype), str(folder),
                  WanVAEOptions(tile_sample_min_size=64, tile_sample_stride=48))
    latents = np.random.default_rng(s).standard_normal((1, 12, 3, 7, 5)).astype(np.float32)
    ours = model.decode(latents, tiled=True)
    ref = wan22_ref.reference_decode(vae, config, latents)
    err = rel_l2(ours, ref)
    report(f"tiny-wan2.2-vae {dtype} tiled: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"


@pytest.mark.parametrize("preset,cfg,dtype,video", [
    ("tiny-wan2.2-vae", wan22_ref.WAN22_SMALL, "float32", (2, 9, 32, 48, 3)),
    ("tiny-wan2.2-vae", wan22_enc_ref.WAN22_ODD_ENCODER, "float16", (1, 9, 48, 16, 3)),
    ("wan2.2-vae", FULL, "float32", (1, 5, 32, 48, 3)),
])
def test_wan22_vae_encode(tmp_path, preset, cfg, dtype, video):
    from models import load_model

    s = wan22_ref.fresh_seed()
    vae, folder, config = wan22_ref.make_reference(tmp_path, cfg, s)
    model = load_model("w22", preset, backend(dtype), weights=str(folder))
    x = np.random.default_rng(s).random(video, dtype=np.float32)
    ours = model.encode(x)
    err = rel_l2(ours, wan22_enc_ref.reference_encode(vae, config, x))
    report(f"{preset} {dtype} encode {video}: rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
    bare = rel_l2(ours, wan22_enc_ref.reference_encode(vae, config, x, normalise=False))
    assert bare > max(3 * err, 100 * TOL["float32"]), f"seed {s}: without the normalisation {bare:.3e}"
