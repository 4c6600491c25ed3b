"""The Wan 2.1 video VAE's decode split by rows over N emulated shards (threads of the
NumPy backend joined by ThreadShards, NCCL's collective semantics) equals the unsharded untiled
decode, ours and diffusers' AutoencoderKLWan with the same weights, over odd row splits and three
latent frames (so the later frame groups run with a full causal cache). With the conv halo or
the attention's keys and values kept shard-local, or with the cached frames stripped of their
halo rows, it visibly does not."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from test_models_wan import WAN_ODD, WAN_SMALL, make_reference, one_torch_thread, reference_decode  # noqa: F401
from torch_reference import assert_informative, fresh_seed, rel_l2

from convkernels import get_backend
from convkernels.collectives.shard_comm import run_sharded, split, split_rows
from models.sharding import ChunkPlan, decode_emulated, frame_groups_band
from models.wan_vae.model import joined_groups
from models.wan_vae import build
from models.wan_vae.layers import CausalConv3d
from test_sharded_decode_emulated import _OneLocal  # one collective kept shard-local (the guards)

CONFIGS = {"wan-small": WAN_SMALL, "wan-odd-channels": WAN_ODD}
# batch 2, 3 latent frames (9 frames: groups of 1, 4, 4), 5 latent rows (odd: 3 shards get 2, 2, 1;
# 5 shards one each), odd width
LATENT_SHAPE = (2, 3, 5, 3)
UNSHARDED_TOL, DIFFUSERS_TOL, BROKEN_MIN = 1e-5, 1e-4, 1e-3


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def case(request, tmp_path_factory):
    """(name, seed, model, latents, our unsharded decode, diffusers' decode, decode(latents) by the
    same diffusers model)."""
    name = request.param
    seed = fresh_seed()
    vae, folder, config = make_reference(tmp_path_factory.mktemp(name), CONFIGS[name], seed)
    model = build("wan-sharded", "tiny-wan-vae", get_backend("numpy"), str(folder))
    n, t, h, w = LATENT_SHAPE
    lat = np.random.default_rng(seed).standard_normal((n, config["z_dim"], t, h, w)).astype(np.float32)
    ref = reference_decode(vae, config, lat)
    assert_informative(ref, f"seed {seed}")
    return name, seed, model, lat, model.decode(lat, tiled=False), ref, lambda z: reference_decode(vae, config, z)


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_the_sharded_decode_equals_the_unsharded_one_and_diffusers(case, shards):
    name, seed, model, lat, ours, ref, _ = case
    out = decode_emulated(model, lat, shards)
    assert out.dtype == np.float32 and out.shape == ours.shape == (2, 9, 40, 24, 3)
    err, err_ref = rel_l2(out, ours), rel_l2(out, ref)
    assert err < UNSHARDED_TOL, f"{name} {shards} shards seed {seed}: rel L2 {err:.2e} vs unsharded"
    assert err_ref < DIFFUSERS_TOL, f"{name} {shards} shards seed {seed}: rel L2 {err_ref:.2e} vs diffusers"


def test_frame_groups_are_the_unsharded_ones_first_one_frame_then_four(case):
    name, seed, model, lat, *_ = case
    parts = split(lat, split_rows(lat.shape[3], 3), axis=3)
    per_shard = run_sharded(3, lambda comm, r: list(frame_groups_band(model, comm, parts[r], lat.shape[3])))
    groups = [np.concatenate(g, axis=2) for g in zip(*per_shard)]
    unsharded = list(model.decode_frames(lat, tiled=False))
    assert [g.shape[1] for g in groups] == [g.shape[1] for g in unsharded] == [1, 4, 4]
    for k, (g, u) in enumerate(zip(groups, unsharded)):
        assert rel_l2(g, u) < UNSHARDED_TOL, f"{name} seed {seed}: frame group {k}"


def test_unclamped_frames_clip_to_the_clamped_ones(case, monkeypatch):
    """clamp=False hands out conv_out's values as they are. The decode is seldom saturated at
    random init, so conv_out's bias is lifted by 0.75 (in image space: x / 2 + 0.5 is folded in)
    for this test, moving most pixels past 1."""
    name, seed, model, lat, *_ = case
    conv_out = model.tree.decoder.conv_out
    monkeypatch.setattr(conv_out, "bias", conv_out.bias + np.float32(0.75))
    raw = decode_emulated(model, lat, 2, clamp=False)
    clamped = model.decode(lat, tiled=False)
    assert np.mean(raw > 1) > 0.25, f"{name} seed {seed}: too few pixels past 1 for the check to mean anything"
    assert rel_l2(np.clip(raw, 0, 1), clamped) < UNSHARDED_TOL


@pytest.mark.parametrize("local", ["halo", "attention"])
def test_each_exchange_matters(case, local):
    name, seed, model, lat, ours, *_ = case
    out = decode_emulated(model, lat, 3, comm_wrapper=lambda comm, rank: _OneLocal(comm, local))
    err = rel_l2(out, ours)
    assert err > BROKEN_MIN, f"{name} seed {seed}: keeping the {local} exchange local changed nothing ({err:.2e})"


def test_the_cached_frames_must_keep_their_halo_rows(case, monkeypatch):
    """Each 3x3 causal conv caches its haloed input frames; with their halo rows (the rows that
    came from a neighbour) zeroed, a cache of the shard's own rows only, the later frame groups go
    wrong on 3 shards, while the first group, which has no cached frames, stays right."""
    name, seed, model, lat, ours, *_ = case
    with_cache = CausalConv3d.with_cache
    shard = threading.local()  # each emulated shard runs on its own thread

    def own_rows_only(conv, x, state, norm=None):
        out = with_cache(conv, x, state, norm)
        halo_rows = ([0] if shard.rank > 0 else []) + ([-1] if shard.rank < shard.size - 1 else [])
        if conv.kernel[1] > 1 and halo_rows:
            cached = state.slots[state.pos - 1].copy()
            cached[:, :, halo_rows] = 0
            state.slots[state.pos - 1] = cached
        return out

    def note_rank(comm, rank):
        shard.rank, shard.size = rank, comm.size
        return comm

    monkeypatch.setattr(CausalConv3d, "with_cache", own_rows_only)
    out = decode_emulated(model, lat, 3, comm_wrapper=note_rank)
    first = rel_l2(out[:, :1], ours[:, :1])
    err = rel_l2(out, ours)
    assert first < UNSHARDED_TOL, f"{name} seed {seed}: the first group has no cached frames to spoil"
    assert err > BROKEN_MIN, f"{name} seed {seed}: cached frames without their halo changed nothing ({err:.2e})"


def test_one_shard_is_the_unsharded_decode(case):
    _, _, model, lat, ours, *_ = case
    assert rel_l2(decode_emulated(model, lat, 1), ours) < UNSHARDED_TOL


class _ReplayedStep:
    """A stand-in for a backend's recorded graph (what CUDA's GraphedForward is to the sharded
    decode): it says it records, and runs the step it was given, counting the calls, so the
    step's own contract (cache slots in, the next slots out) is checked on the CPU."""

    def __init__(self, fn, calls):
        self.fn, self.calls = fn, calls

    def records(self, *xs):
        return True

    def __call__(self, *xs):
        self.calls.append(xs[0].shape)
        return self.fn(*xs)


@pytest.mark.parametrize("plan, graphed_runs", [
    (ChunkPlan(1, True), [1, 1, 1]),  # T=5: chunks 0 | 1 | 2 | 3 | 4, the third on steady
    (ChunkPlan(2, True), [2]),        # 0 | 1-2 | 3-4: the third steady
    (ChunkPlan(3, True), []),         # 0 | 1-3 | 4: the third is shorter, eager
    (ChunkPlan(2, False), []),
])
def test_steady_chunks_go_through_the_recorded_step_where_the_plan_says(case, monkeypatch, plan, graphed_runs):
    """The sharded decode hands its steady chunks (the third on) of plan.frames latent frames to
    the backend's recorded step where the plan says so, on every shard; a shorter last chunk runs
    eagerly; either way the shards meet and equal the unsharded decode."""
    name, seed, model, *_ = case
    lat = np.random.default_rng(seed + 1).standard_normal((1, model.latent_channels, 5, 9, 3)).astype(np.float32)
    ours = model.decode(lat, tiled=False)
    calls = []
    backend = type(model.backend)
    monkeypatch.setattr(backend, "calls_to_warm", property(lambda self: 2))
    monkeypatch.setattr(backend, "graphed", lambda self, fn: _ReplayedStep(fn, calls))
    model.sharded_steps.clear()
    try:
        out = _decode_with(model, lat, 2, plan)
    finally:
        model.sharded_steps.clear()
    assert rel_l2(out, ours) < UNSHARDED_TOL, f"{name} seed {seed}: {plan}"
    assert sorted(shape[1] for shape in calls) == sorted(graphed_runs * 2), calls  # both shards, t each
    assert sorted({shape[2] for shape in calls}) == ([4, 5] if graphed_runs else []), calls


def _decode_with(model, lat, shards, plan):
    """decode_emulated with every shard stepping its frames by `plan`."""
    parts = split(lat, split_rows(lat.shape[3], shards), axis=3)
    return np.concatenate(run_sharded(shards, lambda comm, r: joined_groups(
        frame_groups_band(model, comm, parts[r], lat.shape[3], plan=plan), model.output_frames(lat.shape[2]))),
        axis=2)


@pytest.mark.parametrize("frames", [1, 2, 3, 4])
def test_any_run_of_frames_equals_the_unsharded_decode_and_diffusers(case, frames):
    """Runs of latent frames after the first (ChunkPlan.frames) give the unsharded decode's frames:
    5 latent frames, so runs of 2 and 3 leave a shorter last one, 4 is the rest in one."""
    name, seed, model, *_, diffusers_decode = case
    lat = np.random.default_rng(seed + 2).standard_normal((1, model.latent_channels, 5, 5, 3)).astype(np.float32)
    out = _decode_with(model, lat, 3, ChunkPlan(frames, False))
    ours = model.decode(lat, tiled=False)
    ref = diffusers_decode(lat)
    assert rel_l2(out, ours) < UNSHARDED_TOL, f"{name} seed {seed}: runs of {frames}"
    assert rel_l2(out, ref) < DIFFUSERS_TOL, f"{name} seed {seed}: runs of {frames} vs diffusers"
