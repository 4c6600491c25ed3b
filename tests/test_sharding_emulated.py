"""Spatial sharding's building blocks on emulated shards: N threads of the NumPy
backend joined by convkernels.collectives.shard_comm.ThreadShards, which has NCCL's collective semantics.
A conv with its halo exchanged, and GroupNorm with its statistics all-reduced, computed shard by
shard over odd row splits, must equal torch's conv2d, causal conv3d and group_norm of the whole
image or video."""
from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from convkernels import get_backend
from convkernels.collectives.shard_comm import run_sharded, split, split_rows
from convkernels.sharded_ops import (_odd_space_kernel, exact_group_norm, halo_conv2d, halo_upsample_conv2d,
                                     haloed_conv3d, row_halo_parts)
from torch_reference import rel_l2


def nchw(x):
    return torch.from_numpy(np.ascontiguousarray(x.transpose(0, 3, 1, 2)))


def halo_conv3d(backend, comm, x, w, bias=None, *, time_pad: int = 0, residual=None,
                activation: str | None = None):
    """A stride-1 3-D conv of a whole video (N,T,H,W,C, rows on axis 2; weight O,kT,kH,kW,I) on
    this shard's rows: 'same' in space (halo (kH-1)/2 rows from each neighbour), `time_pad` zero
    frames in front in time (a causal conv; a conv that keeps a cache of earlier frames gives it
    row_halo_parts' frames, halo included, and calls haloed_conv3d itself, as the sharded Wan
    decode does; so this whole-video form is the tests' own)."""
    _odd_space_kernel(w, "halo_conv3d")
    rows_pad = (0, 0)
    if (int(w.shape[2]) - 1) // 2:
        x, rows_pad = row_halo_parts(backend, comm, x, (int(w.shape[2]) - 1) // 2, axis=2)
    return haloed_conv3d(backend, x, w, bias, time_pad=time_pad, rows_pad=rows_pad, residual=residual,
                         activation=activation)


def test_rows_split_evenly_on_aligned_boundaries():
    assert split_rows(23, 3) == [(0, 8), (8, 16), (16, 23)]
    assert split_rows(21, 4, align=2) == [(0, 6), (6, 12), (12, 16), (16, 21)]
    for h, n, a in [(100, 4, 8), (37, 5, 2), (9, 3, 3)]:
        bounds = split_rows(h, n, a)
        assert bounds[0][0] == 0 and bounds[-1][1] == h
        assert all(lo % a == 0 and hi - lo >= a for lo, hi in bounds)
        assert all(b[1] == c[0] for b, c in zip(bounds, bounds[1:]))
    with pytest.raises(ValueError):
        split_rows(5, 3, align=2)


@pytest.mark.parametrize("shards", [2, 3, 4])
@pytest.mark.parametrize("kernel", [1, 3, 5])
def test_a_conv_with_its_halo_exchanged_equals_the_whole_image_conv(shards, kernel):
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 23, 9, 5)).astype(np.float32)  # odd rows, odd channels
    w = rng.standard_normal((7, kernel, kernel, 5)).astype(np.float32)
    b = rng.standard_normal(7).astype(np.float32)
    backend = get_backend("numpy")
    parts = split(x, split_rows(23, shards))
    out = np.concatenate(run_sharded(shards, lambda comm, r: halo_conv2d(backend, comm, parts[r], w, b)), axis=1)
    ref = F.conv2d(nchw(x), torch.from_numpy(w.transpose(0, 3, 1, 2).copy()), torch.from_numpy(b),
                   padding=kernel // 2).numpy().transpose(0, 2, 3, 1)
    assert out.shape == ref.shape
    assert rel_l2(out, ref) < 1e-5
    # a residual (a resnet's skip) added in the epilogue: each shard passes its own output rows
    skip = rng.standard_normal(ref.shape).astype(np.float32)
    skips = split(skip, split_rows(23, shards))
    fused = np.concatenate(run_sharded(shards, lambda comm, r: halo_conv2d(
        backend, comm, parts[r], w, b, residual=skips[r])), axis=1)
    assert rel_l2(fused, ref + skip) < 1e-5
    if kernel > 1:  # the vacuity guard: shards padded with zeros instead of their neighbours' rows
        alone = np.concatenate([backend.conv2d(p, w, b, padding=kernel // 2) for p in parts], axis=1)
        assert rel_l2(alone, ref) > 1e-2


@pytest.mark.parametrize("shards", [1, 2, 3, 5])
def test_upsample_then_conv_with_one_low_resolution_halo_row_equals_the_whole_image_op(shards):
    """halo_upsample_conv2d: nearest 2x then a 'same' 3x3 conv, run as the backend's one op on the
    shard's rows and one row of each neighbour, its halo's output rows dropped, against torch's
    interpolate + conv2d of the whole image; odd rows (5 shards of 11 rows: 3, 2, 2, 2, 2)."""
    rng = np.random.default_rng()
    x = rng.standard_normal((2, 11, 7, 5)).astype(np.float32)
    w = rng.standard_normal((6, 3, 3, 5)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    backend = get_backend("numpy")
    parts = split(x, split_rows(11, shards))
    out = np.concatenate(run_sharded(shards, lambda comm, r: np.asarray(
        halo_upsample_conv2d(backend, comm, parts[r], w, b))), axis=1)
    ref = F.conv2d(F.interpolate(nchw(x), scale_factor=2, mode="nearest"),
                   torch.from_numpy(w.transpose(0, 3, 1, 2).copy()), torch.from_numpy(b),
                   padding=1).numpy().transpose(0, 2, 3, 1)
    assert out.shape == ref.shape == (2, 22, 14, 6)
    assert rel_l2(out, ref) < 1e-5
    if shards > 1:  # the vacuity guard: each shard's op alone, its edges padded with zeros
        alone = np.concatenate([backend.upsample_conv2d(p, w, b) for p in parts], axis=1)
        assert rel_l2(alone, ref) > 1e-2


@pytest.mark.parametrize("shards", [2, 3])
@pytest.mark.parametrize("kernel,frames", [((3, 3, 3), 4), ((3, 3, 3), 1), ((1, 5, 3), 3), ((3, 1, 1), 2)],
                         ids=["3x3x3", "3x3x3-lone-frame", "1x5x3", "time-only"])
def test_a_causal_conv3d_with_its_halo_exchanged_equals_the_whole_video_conv(shards, kernel, frames):
    """Videos N,T,H,W,C with rows on axis 2, kT - 1 zero frames in front (Wan's CausalConv3d);
    a lone frame takes the op's last-tap-only route."""
    rng = np.random.default_rng()
    kt, kh, kw = kernel
    x = rng.standard_normal((2, frames, 11, 7, 5)).astype(np.float32)  # odd rows, width, channels
    w = rng.standard_normal((6, kt, kh, kw, 5)).astype(np.float32)
    b = rng.standard_normal(6).astype(np.float32)
    backend = get_backend("numpy")
    parts = split(x, split_rows(11, shards), axis=2)

    def sharded(comm, r):
        return halo_conv3d(backend, comm, parts[r], w, b, time_pad=kt - 1)

    out = np.concatenate(run_sharded(shards, sharded), axis=2)
    whole = F.pad(torch.from_numpy(np.ascontiguousarray(x.transpose(0, 4, 1, 2, 3))),
                  (kw // 2, kw // 2, kh // 2, kh // 2, kt - 1, 0))
    ref = F.conv3d(whole, torch.from_numpy(w.transpose(0, 4, 1, 2, 3).copy()), torch.from_numpy(b))
    ref = ref.numpy().transpose(0, 2, 3, 4, 1)
    assert out.shape == ref.shape
    assert rel_l2(out, ref) < 1e-5
    if kh > 1:  # the vacuity guard: every shard's edge rows padded with zeros, not its neighbours'
        alone = np.concatenate([backend.conv3d(p, w, b, padding=((kt - 1, 0), (kh // 2,) * 2, (kw // 2,) * 2))
                                for p in parts], axis=2)
        assert rel_l2(alone, ref) > 1e-2


@pytest.mark.parametrize("shards", [2, 3])
def test_group_norm_with_all_reduced_statistics_equals_the_whole_image_norm(shards):
    rng = np.random.default_rng()
    x = (rng.standard_normal((2, 19, 7, 12)) * 3 + rng.standard_normal(12)).astype(np.float32)
    gamma, beta = rng.standard_normal(12).astype(np.float32), rng.standard_normal(12).astype(np.float32)
    parts = split(x, split_rows(19, shards))
    out = np.concatenate(run_sharded(shards, lambda comm, r: exact_group_norm(
        get_backend("numpy"), comm, parts[r], 4, gamma, beta, eps=1e-6, activation="silu")), axis=1)
    ref = F.silu(F.group_norm(nchw(x), 4, torch.from_numpy(gamma), torch.from_numpy(beta), eps=1e-6))
    ref = ref.numpy().transpose(0, 2, 3, 1)
    assert rel_l2(out, ref) < 1e-6
    # the vacuity guard: each shard normalised by its own statistics is visibly different
    local = np.concatenate([F.silu(F.group_norm(nchw(p), 4, torch.from_numpy(gamma), torch.from_numpy(beta),
                                                eps=1e-6)).numpy().transpose(0, 2, 3, 1) for p in parts], axis=1)
    assert rel_l2(local, ref) > 1e-2


def test_a_failing_shard_fails_every_shard_instead_of_hanging():
    started = threading.Barrier(3)

    def shard(comm, rank):
        started.wait()
        if rank == 1:
            raise RuntimeError("shard 1 lost its device")
        return comm.allreduce_sum(np.ones(2))  # the others would wait for rank 1 forever

    with pytest.raises((RuntimeError, threading.BrokenBarrierError)):
        run_sharded(3, shard)


def test_allgather_checks_the_lengths_it_is_told():
    """A caller that passes every shard's length (so a recorded CUDA graph need not ask for them)
    must pass the true ones: the emulation holds it to them, as NCCL cannot."""
    bounds = split_rows(7, 3)  # 3, 2, 2 rows
    parts = split(np.arange(2 * 7 * 3, dtype=np.float32).reshape(2, 7, 3), bounds)
    told = [hi - lo for lo, hi in bounds]
    seen = run_sharded(3, lambda comm, r: comm.allgather(parts[r], told))
    for got in seen:
        np.testing.assert_array_equal(np.concatenate(got, axis=1), np.concatenate(parts, axis=1))
    with pytest.raises(ValueError, match="told lengths"):
        run_sharded(3, lambda comm, r: comm.allgather(parts[r], [2, 3, 2]))
