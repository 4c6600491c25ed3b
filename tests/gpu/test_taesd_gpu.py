"""The TAESD family (diffusers AutoencoderTiny) on the CUDA backend vs diffusers run by PyTorch on
the CPU in float32, identical random weights through the public models.load_model path: relative
L2 < 1e-4 in float32 (TF32 is off by default), < 1e-2 in float16; untiled and in AutoencoderTiny's
tiles; the decode runs twice with fresh inputs, eagerly and then as a replayed CUDA graph.
Skipped without a CUDA GPU + CuPy + cuDNN."""
from __future__ import annotations

import os

import numpy as np
import pytest

from gpu_support import cuda_or_skip, report_parity as report
from torch_reference import rel_l2, torch

# the CPU reference and its random weights (every parameter moved, output scaled to mid-range)
from test_models_taesd import make_tiny as make_reference, reference_decode  # noqa: E402

pytestmark = pytest.mark.gpu
TOL = {"float32": 1e-4, "float16": 1e-2}

# the published width (64) and block counts, scaled latents so the de-normalisation is compared
TAESD = dict(latent_channels=4, scaling_factor=0.7, shift_factor=0.15)
TAEF1 = dict(latent_channels=16, scaling_factor=1.3, shift_factor=-0.2)


@pytest.fixture(scope="module", autouse=True)
def cuda_backend_present():
    cuda_or_skip()


@pytest.mark.parametrize("preset,cfg,dtype,lat", [
    ("taesd", TAESD, "float32", (2, 4, 17, 23)),
    ("taesd", TAESD, "float16", (1, 4, 32, 40)),
    ("taef1", TAEF1, "float32", (1, 16, 21, 13)),
    ("taef1", TAEF1, "float16", (2, 16, 24, 24)),
])
def test_taesd_decode(tmp_path, preset, cfg, dtype, lat):
    from convkernels import get_backend
    from models import load_model

    s = int.from_bytes(os.urandom(4), "little")
    vae = make_reference(cfg, s)
    vae.save_pretrained(tmp_path)
    model = load_model("taesd", preset, get_backend("cuda", dtype=dtype), weights=str(tmp_path))
    rng = np.random.default_rng(s)
    for call in ("eager", "graph"):
        latents = rng.standard_normal(lat).astype(np.float32)
        ours = model.decode(latents, tiled=False)
        ref = reference_decode(vae, latents)
        assert 0.02 < float(ref.std()), "reference decode is flat: the check would prove nothing"
        err = rel_l2(ours, ref)
        report(f"{preset} {dtype} latents {lat} {call}: rel L2 {err:.2e}")
        assert err < TOL[dtype], f"seed {s}, {call}: {err:.3e}"
    stats = model._decode_device.stats()  # the second call replayed the first one's capture
    assert stats["ungraphable"] == {} and stats["captures"] == 1 and stats["replays"] == 1, stats


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_taesd_tiled_decode_and_encode(tmp_path, dtype):
    from convkernels import get_backend
    from models import load_model
    from models.taesd import TAESDOptions

    s = int.from_bytes(os.urandom(4), "little")
    vae = make_reference(TAESD, s)
    vae.save_pretrained(tmp_path)
    model = load_model("taesd", "taesd", get_backend("cuda", dtype=dtype), weights=str(tmp_path),
                       options=TAESDOptions(tile_latent_size=16))
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 128, 16
    rng = np.random.default_rng(s)
    latents = rng.standard_normal((1, 4, 37, 29)).astype(np.float32)
    err = rel_l2(model.decode(latents, tiled=True), reference_decode(vae, latents))
    report(f"taesd {dtype} tiled decode (1, 4, 37, 29): rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
    images = rng.uniform(0, 1, (2, 64, 48, 3)).astype(np.float32)
    with torch.no_grad():
        want = vae.encode(torch.from_numpy(images).permute(0, 3, 1, 2) * 2 - 1).latents
    want = ((want - TAESD["shift_factor"]) * TAESD["scaling_factor"]).numpy()
    err = rel_l2(model.encode(images, tiled=False), want)
    report(f"taesd {dtype} encode (2, 64, 48): rel L2 {err:.2e}")
    assert err < TOL[dtype], f"seed {s}: {err:.3e}"
