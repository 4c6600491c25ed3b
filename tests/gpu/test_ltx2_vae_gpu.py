"""The LTX-2 VAE decoder on the CUDA backend vs diffusers' AutoencoderKLLTX2Video + the LTX-2
pipeline's de-normalisation, run by PyTorch on the CPU in float32, identical random weights and latent
statistics, through the public models.load_model path: relative L2 < 1e-4 in float32, < 1e-2 in
float16; the timestep-conditioned decoder too. Decode runs twice with fresh inputs: eagerly, then
captured and replayed as a CUDA graph (on by default), which must happen. Skipped without a CUDA GPU +
CuPy + cuDNN."""
from __future__ import annotations

import numpy as np
import pytest
from gpu_support import cuda_backend as backend, cuda_or_skip, report_parity as report
from torch_reference import rel_l2

pytestmark = pytest.mark.gpu
TOL = {"float32": 1e-4, "float16": 1e-2}

# the CPU references: the same helpers as the CPU parity tests (tests/test_models_ltx2_vae.py)
ltx_ref = pytest.importorskip("test_models_ltx2_vae")

FULL = dict(ltx_ref.PRESETS["ltx2-vae"].config)


@pytest.fixture(scope="module", autouse=True)
def cuda_backend_available():
    cuda_or_skip()


def assert_captured(forward, calls: int) -> None:
    stats = forward.stats()
    assert stats["ungraphable"] == {}, f"forward not capturable: {stats['ungraphable']}"
    assert stats["captures"] == 1 and stats["replays"] == calls - 1, stats


@pytest.mark.parametrize("preset,cfg,dtype,grid,timestep", [
    ("tiny-ltx2-vae", ltx_ref.TINY, "float32", (2, 8, 2, 5, 3), None),
    ("tiny-ltx2-vae", ltx_ref.TINY, "float16", (1, 8, 3, 4, 3), None),
    ("tiny-ltx2-vae", ltx_ref.TIMESTEP, "float32", (1, 8, 2, 3, 3), 0.05),
    ("ltx2-vae", FULL, "float16", (1, 128, 2, 3, 2), None),
])
def test_ltx2_vae_decode(tmp_path, preset, cfg, dtype, grid, timestep):
    from models import load_model
    from models.ltx2_vae import LTX2VAEOptions

    s = ltx_ref.fresh_seed()
    vae = ltx_ref.make_vae(cfg, s)
    vae.save_pretrained(tmp_path)
    model = load_model("ltx", preset, backend(dtype), weights=str(tmp_path),
                       options=LTX2VAEOptions(timestep=timestep or 0.0))
    rng = np.random.default_rng(s)
    for call in ("eager", "graph"):
        x = rng.standard_normal(grid).astype(np.float32)
        ours = model.decode(x, tiled=False)
        ref = ltx_ref.pipeline_decode(vae, x, timestep)
        assert 0.02 < float(ref.std()), "reference decode is flat: the check would prove nothing"
        err = rel_l2(ours, ref)
        report(f"{preset} {dtype} grid {grid} timestep {timestep} {call}: rel L2 {err:.2e}")
        assert err < TOL[dtype], f"seed {s}, {call}: {err:.3e}"
    assert_captured(model._decode_device, 2)
