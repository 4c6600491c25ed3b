"""Every decoder family's row-split decode on the CUDA backend, on one GPU: the shards emulated by
threads (ThreadShards, NCCL's collective semantics) over one CudaBackend, each running the
model's own forward with its row shard current (models/nn/row_shard.py). The CUDA paths of the
shard-aware layers (halo convs, the causal convs' haloed cache, exact GroupNorm from the
device's float64 sums, the attentions' gathered keys and values, the haloed upsamplers and
Wan 2.2's shortcut) are then checked without a second GPU: equal to the unsharded CUDA decode and
to diffusers with the same fresh random weights, and visibly not with the halo kept local.
(Two real GPUs joined by NCCL: test_sharded_decode_gpus.py.) Skipped without CUDA."""
from __future__ import annotations

import numpy as np
import pytest
import test_models_vae as vae_ref
import test_models_wan as wan_ref
from gpu_support import cuda_or_skip, report_parity
from test_sharded_decode_emulated import _OneLocal
from test_sharded_families_emulated import FAMILIES
from torch_reference import assert_informative, fresh_seed, rel_l2

pytestmark = pytest.mark.gpu
#: float32, TF32 off (the backend's default): sum order only
UNSHARDED_TOL, DIFFUSERS_TOL, BROKEN_MIN = 1e-5, 1e-4, 1e-3


@pytest.fixture(scope="module", autouse=True)
def cuda_backend_present():
    cuda_or_skip()


def _sd(tmp, seed):
    from models.autoencoder_kl import PRESETS

    cfg = {k: v for k, v in PRESETS["tiny-vae"].items() if k not in ("down_block_types", "up_block_types")}
    vae = vae_ref.make_vae(cfg, seed)
    vae.save_pretrained(tmp)
    lat = np.random.default_rng(seed).standard_normal((2, cfg["latent_channels"], 13, 9)).astype(np.float32)
    return "tiny-vae", lat, lambda z: vae_ref.diffusers_decode(vae, z), str(tmp)


def _wan(tmp, seed):
    vae, folder, config = wan_ref.make_reference(tmp, wan_ref.WAN_SMALL, seed)
    lat = np.random.default_rng(seed).standard_normal((1, config["z_dim"], 3, 5, 3)).astype(np.float32)
    return "tiny-wan-vae", lat, lambda z: wan_ref.reference_decode(vae, config, z), str(folder)


CASES = {**FAMILIES, "sd": _sd, "wan2.1": _wan}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    from convkernels import get_backend
    from models import load_model

    name, seed = request.param, fresh_seed()
    tmp = tmp_path_factory.mktemp(name)
    preset, lat, reference, *folder = CASES[name](tmp, seed)
    # float32 asked for: the CUDA backend's default is float16, whose sum-order differences
    # (up to 4e-4 relative between band and whole shapes, 2026-11-28) these bounds are not for
    model = load_model(name, preset, get_backend("cuda", dtype="float32"), weights=folder[0] if folder else str(tmp))
    ref = reference(lat)
    assert_informative(ref, f"{name} seed {seed}")
    return name, seed, model, lat, model.decode(lat, tiled=False), ref


@pytest.mark.parametrize("shards", [2, 3])
def test_cuda_shards_equal_the_unsharded_cuda_decode_and_diffusers(case, shards):
    from models.sharding import decode_emulated

    name, seed, model, lat, ours, ref = case
    out = decode_emulated(model, lat, shards)
    err, err_ref = rel_l2(out, ours), rel_l2(out, ref)
    report_parity(f"row shards on CUDA (emulated) {name} x{shards}: vs unsharded {err:.2e}, vs diffusers {err_ref:.2e}")
    assert out.shape == ours.shape
    assert err < UNSHARDED_TOL, f"{name} {shards} shards seed {seed}: rel L2 {err:.2e} vs unsharded"
    assert err_ref < DIFFUSERS_TOL, f"{name} {shards} shards seed {seed}: rel L2 {err_ref:.2e} vs diffusers"


def test_the_halo_matters_on_cuda(case):
    from models.sharding import decode_emulated

    name, seed, model, lat, ours, _ = case
    out = decode_emulated(model, lat, 3, comm_wrapper=lambda comm, rank: _OneLocal(comm, "halo"))
    assert rel_l2(out, ours) > BROKEN_MIN, f"{name} seed {seed}: a local halo changed nothing"

