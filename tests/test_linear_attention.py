"""ReLU linear attention (models/nn/linear_attention.py) against diffusers' own
SanaMultiscaleLinearAttention forms (its linear one, and the quadratic one it takes for images with
no more tokens than the head dimension), on NumPy and MLX's CPU device; on 2 and 3 emulated row
shards (threads joined by ThreadShards) it equals the whole image's result, its sums all-reduced.
A grouped (depthwise) 'same' conv on a row shard takes its halo like any other."""
from __future__ import annotations

import numpy as np
import pytest

from convkernels import get_backend
from convkernels.collectives.shard_comm import run_sharded, split, split_rows
from models.nn.layers import Conv2d
from models.nn.linear_attention import relu_linear_attention
from models.nn.row_shard import RowShard

torch = pytest.importorskip("torch")
diffusers_attention = pytest.importorskip("diffusers.models.attention_processor")
from torch_reference import rel_l2  # noqa: E402

HEAD = 8


def reference(qkv: np.ndarray, quadratic: bool) -> np.ndarray:
    """diffusers' processor from its concatenated q | k | v channels (NHWC here) to its output."""
    attn = diffusers_attention.SanaMultiscaleLinearAttention(3 * HEAD, HEAD, attention_head_dim=HEAD,
                                                            norm_type="rms_norm")
    n, h, w, c = qkv.shape
    x = torch.from_numpy(qkv).permute(0, 3, 1, 2).reshape(n, -1, 3 * HEAD, h * w)
    q, k, v = x.chunk(3, dim=2)
    q, k = torch.relu(q), torch.relu(k)
    with torch.no_grad():
        out = attn.apply_quadratic_attention(q, k, v) if quadratic else attn.apply_linear_attention(q, k, v)
    return out.reshape(n, -1, h, w).permute(0, 2, 3, 1).numpy()


@pytest.mark.parametrize("backend_name", ["numpy", "mlx"])
def test_matches_diffusers_linear_and_quadratic_forms(backend_name):
    if backend_name == "mlx":
        pytest.importorskip("mlx.core")
    backend = get_backend(backend_name)
    rng = np.random.default_rng(0)
    for shape in [(2, 5, 7, 6 * HEAD), (1, 2, 3, 3 * HEAD)]:  # 35 tokens; 6 tokens (fewer than HEAD)
        qkv = rng.standard_normal(shape).astype(np.float32)
        ours = np.asarray(backend.to_host(relu_linear_attention(backend, backend.asarray(qkv), HEAD)))
        assert ours.shape == (*shape[:3], shape[3] // 3)
        for quadratic in (False, True):
            err = rel_l2(ours, reference(qkv, quadratic))
            print(f"{backend_name} {shape} {'quadratic' if quadratic else 'linear'}: rel L2 {err:.2e}")
            assert err < 1e-5, f"{shape} quadratic={quadratic}: rel L2 {err:.2e}"


def test_projections_in_parts_are_their_concatenation():
    """A list of projections (DC-AE's base and multiscale ones) is read as their concatenation on
    channels: the groups of the first, then the second's (a backend without the passes joins them)"""
    backend = get_backend("numpy")
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal((1, 5, 7, g * 3 * HEAD)).astype(np.float32) for g in (2, 1))
    ours = relu_linear_attention(backend, [a, b], HEAD)
    np.testing.assert_array_equal(ours, relu_linear_attention(backend, np.concatenate([a, b], -1), HEAD))
    assert rel_l2(ours, reference(np.concatenate([a, b], -1), False)) < 1e-5
    swapped = relu_linear_attention(backend, [b, a], HEAD)  # the order is the groups' order
    assert not np.allclose(swapped, ours)


def _sharded(fn, x: np.ndarray, shards: int) -> np.ndarray:
    """fn on each shard's rows of x (N,H,W,C) with its RowShard current, the rows joined."""
    bounds = split_rows(x.shape[1], shards)
    parts = split(x, bounds, axis=1)

    def shard(comm, rank):
        with RowShard(comm, x.shape[1], parts[rank].shape[1]).running():
            return fn(parts[rank])

    return np.concatenate(run_sharded(shards, shard), axis=1)


@pytest.mark.parametrize("shards", [2, 3])
def test_on_row_shards_the_sums_are_all_reduced(shards):
    backend = get_backend("numpy")
    qkv = np.random.default_rng(shards).standard_normal((2, 7, 5, 6 * HEAD)).astype(np.float32)
    whole = relu_linear_attention(backend, qkv, HEAD)
    ours = _sharded(lambda band: relu_linear_attention(backend, band, HEAD), qkv, shards)
    err = rel_l2(ours, whole)
    print(f"{shards} shards: rel L2 {err:.2e}")
    assert err < 1e-6, f"{shards} shards: rel L2 {err:.2e}"


def test_bfloat16_sums_are_gathered_and_added_in_rank_order(monkeypatch):
    """NCCL reduces no bfloat16 here: such sums travel by all-gather, added in rank order."""
    backend = get_backend("numpy")
    qkv = np.random.default_rng(7).standard_normal((1, 7, 5, 3 * HEAD)).astype(np.float32)
    whole = relu_linear_attention(backend, qkv, HEAD)
    monkeypatch.setattr(backend, "dtype_of", lambda x: "bfloat16")
    reduced = []

    class NoReduce:
        def __init__(self, comm):
            self.comm, self.rank, self.size = comm, comm.rank, comm.size

        def allreduce_sum(self, a):
            reduced.append(a)
            raise AssertionError("bfloat16 sums must not be all-reduced")

        def allgather(self, a, lengths=None):
            return self.comm.allgather(a, lengths)

    bounds = split_rows(7, 3)
    parts = split(qkv, bounds, axis=1)

    def shard(comm, rank):
        with RowShard(NoReduce(comm), 7, parts[rank].shape[1]).running():
            return relu_linear_attention(backend, parts[rank], HEAD)

    out = np.concatenate(run_sharded(3, shard), axis=1)
    assert not reduced and rel_l2(out, whole) < 1e-6


@pytest.mark.parametrize("shards", [2, 3, 5])
def test_a_depthwise_conv_on_row_shards_takes_its_halo(shards):
    """5 shards of 8 rows hold 2, 2, 2, 1, 1: the 5x5 conv's halo of 2 reaches past a neighbour."""
    backend = get_backend("numpy")
    rng = np.random.default_rng(shards)
    conv = Conv2d(12, 12, 5, padding=2, groups=12)
    conv.load_checked({"weight": rng.standard_normal((12, 1, 5, 5)).astype(np.float32),
                       "bias": rng.standard_normal(12).astype(np.float32)}, backend, "probe")
    x = rng.standard_normal((1, 8, 6, 12)).astype(np.float32)
    whole = conv(x)
    ref = torch.nn.functional.conv2d(torch.from_numpy(x).permute(0, 3, 1, 2),
                                     torch.from_numpy(np.ascontiguousarray(conv.weight.transpose(0, 3, 1, 2))),
                                     torch.from_numpy(conv.bias), padding=2, groups=12).permute(0, 2, 3, 1).numpy()
    assert rel_l2(whole, ref) < 1e-6
    assert rel_l2(_sharded(conv, x, shards), whole) < 1e-6
