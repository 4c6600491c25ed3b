"""The image VAE's decode split by rows over N emulated shards (threads of the NumPy
backend joined by ThreadShards, NCCL's collective semantics) equals the unsharded decode, ours
and diffusers' with the same weights, over odd row splits; with any one of the three exchanges
(conv halo, GroupNorm statistics, attention's keys and values) kept shard-local instead, it
visibly does not."""
from __future__ import annotations

import numpy as np
import pytest
from reference_checks import assert_informative
from test_models_vae import diffusers_decode, diffusers_decode_raw, fresh_seed, make_vae, rel_l2

from convkernels import get_backend
from models import load_model
from models.autoencoder_kl import PRESETS
from models.sharding import decode_emulated

_TINY = {k: v for k, v in PRESETS["tiny-vae"].items() if k not in ("down_block_types", "up_block_types")}
CONFIGS = {
    # the tiny-vae preset itself (post_quant_conv, mid-block attention, 4 levels)
    "tiny-vae": ("tiny-vae", _TINY),
    # odd widths and groups of 3, FLUX's form: no post_quant_conv, a shift factor, attention
    "odd-flux-like": ("sd-vae", dict(block_out_channels=(6, 9, 15), layers_per_block=1, norm_num_groups=3,
                                     latent_channels=5, sample_size=32, scaling_factor=0.3611, shift_factor=0.1159,
                                     use_quant_conv=False, use_post_quant_conv=False)),
    # no mid-block attention
    "no-attention": ("sd-vae", dict(block_out_channels=(8, 12), layers_per_block=1, norm_num_groups=4,
                                    latent_channels=3, sample_size=32, scaling_factor=0.5,
                                    mid_block_add_attention=False)),
}
LATENT_SHAPE = (2, 13, 9)  # batch 2, 13 latent rows (odd: 4 shards get 4, 3, 3, 3), odd width
UNSHARDED_TOL, DIFFUSERS_TOL, BROKEN_MIN = 1e-5, 1e-4, 1e-3


class _OneLocal:
    """A shard's communicator with one collective kept shard-local: the vacuity guards."""

    def __init__(self, comm, local: str):
        self.comm, self.local, self.rank, self.size = comm, local, comm.rank, comm.size

    def exchange_rows(self, top, bottom):  # halo -> zero rows at every shard edge
        if self.local != "halo":
            return self.comm.exchange_rows(top, bottom)
        # zero rows where a neighbour's would be: a layer pads the image's own edges by rank, so a
        # missing halo (None) would be a shape error, not the wrong numbers this guard wants
        return (bottom * 0 if self.rank > 0 else None,  # any backend's array: NumPy's or the device's
                top * 0 if self.rank < self.size - 1 else None)

    def allreduce_sum(self, a):  # GroupNorm statistics of the shard's own rows
        return a if self.local == "norm" else self.comm.allreduce_sum(a)

    def allgather(self, a, lengths=None):  # attention over the shard's own tokens
        return [a] if self.local == "attention" else self.comm.allgather(a, lengths)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    """(name, model, latents, our unsharded decode, diffusers' raw decode, diffusers' clamped)."""
    pytest.importorskip("torch")
    pytest.importorskip("diffusers")
    name = request.param
    preset, cfg = CONFIGS[name]
    seed = fresh_seed()
    vae = make_vae(cfg, seed)
    folder = tmp_path_factory.mktemp(name)
    vae.save_pretrained(folder)
    model = load_model("vae", preset, get_backend("numpy"), weights=str(folder))
    n, h, w = LATENT_SHAPE
    lat = np.random.default_rng(seed).standard_normal((n, cfg["latent_channels"], h, w)).astype(np.float32)
    ours = model.decode(lat, tiled=False, clamp=False)
    return name, seed, model, lat, ours, diffusers_decode_raw(vae, lat), diffusers_decode(vae, lat)


def test_the_configs_cover_attention_and_its_absence(case):
    name, _, model, *_ = case
    assert (model.decoder.mid_block.attention is None) == (name == "no-attention")
    assert (model.post_quant_conv is None) == (name == "odd-flux-like")


@pytest.mark.parametrize("shards", [2, 3, 4])
def test_the_sharded_decode_equals_the_unsharded_one_and_diffusers(case, shards):
    name, seed, model, lat, ours, ref_raw, ref = case
    out = decode_emulated(model, lat, shards, clamp=False)
    assert out.dtype == np.float32 and out.shape == ours.shape
    err = rel_l2(out, ours)
    err_ref = rel_l2(2 * out - 1, ref_raw)
    print(f"{name} {shards} shards seed {seed}: vs ours {err:.2e}, vs diffusers {err_ref:.2e}")
    assert err < UNSHARDED_TOL, f"{name} {shards} shards seed {seed}: rel L2 {err:.2e} vs unsharded"
    assert err_ref < DIFFUSERS_TOL, f"{name} {shards} shards seed {seed}: rel L2 {err_ref:.2e} vs diffusers"
    # clamped, as model.decode hands images out, against diffusers' (x / 2 + 0.5).clamp(0, 1)
    clamped = decode_emulated(model, lat, shards)
    assert clamped.min() >= 0.0 and clamped.max() <= 1.0
    assert_informative(ref, f"{name} {shards} shards seed {seed}")
    assert rel_l2(clamped, ref) < DIFFUSERS_TOL


@pytest.mark.parametrize("local", ["halo", "norm", "attention"])
def test_each_exchange_matters(case, local):
    name, seed, model, lat, ours, *_ = case
    if local == "attention" and model.decoder.mid_block.attention is None:
        pytest.skip("no mid-block attention in this config")
    out = decode_emulated(model, lat, 3, clamp=False, comm_wrapper=lambda comm, rank: _OneLocal(comm, local))
    err = rel_l2(out, ours)
    print(f"{name}, {local} kept shard-local, seed {seed}: rel L2 {err:.2e}")
    assert err > BROKEN_MIN, f"{name}: keeping the {local} exchange local changed nothing ({err:.2e})"


def test_one_shard_is_the_unsharded_decode(case):
    _, _, model, lat, ours, *_ = case
    assert rel_l2(decode_emulated(model, lat, 1, clamp=False), ours) < UNSHARDED_TOL


def test_an_encoder_is_refused_by_name():
    """A family that declares no row-split decode (an encoder) is refused, naming what is offered."""
    model = load_model("c", "tiny-convnext", get_backend("numpy"))
    with pytest.raises(ValueError, match="ConvNeXt") as e:
        decode_emulated(model, np.zeros((1, 3, 4, 4), np.float32), 2)
    assert "Wan 2.2" in str(e.value) and "FLUX.2" in str(e.value) and "TAESD" in str(e.value)


def test_a_conv_that_cannot_run_on_a_band_refuses():
    """A stride-2 conv (an encoder's downsampler) needs rows no halo gives: on a row shard it
    raises rather than compute a wrong band."""
    from convkernels.collectives.shard_comm import run_sharded
    from models.nn.layers import Conv2d
    from models.nn.row_shard import RowShard

    conv = Conv2d(3, 3, 3, stride=2, padding=1)
    conv.load_checked({"weight": np.ones((3, 3, 3, 3), np.float32), "bias": np.zeros(3, np.float32)},
                      get_backend("numpy"), "probe")
    x = np.ones((1, 4, 5, 3), np.float32)

    def shard(comm, rank):
        with RowShard(comm, 8, 4).running():
            conv(x)

    with pytest.raises(ValueError, match="cannot run on a row shard"):
        run_sharded(2, shard)
    assert conv(x).shape == (1, 2, 3, 3)  # unsharded it runs
