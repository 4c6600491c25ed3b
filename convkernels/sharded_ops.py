"""The two layers that need another shard's data when an image or video is split by rows over
devices (issue #32), computed exactly: a conv, which needs its neighbours' edge rows (the halo),
and GroupNorm, whose statistics cover the whole image. Everything else in a VAE decoder (RMS
norm over channels, activations, pointwise convs) is row-local and runs on a shard as it is.

Both take the shard's rows (channels-last N,H,W,C, rows on axis 1), its communicator
(shard_comm.ShardComm) and the array namespace `xp` the backend's arrays live in (numpy, cupy),
and return what the unsharded layer returns for those rows.

GroupNorm is exact through one all-reduce of its statistics: each shard's float64 sums of x and
x*x per group (backend.group_norm_sums, the first of CUDA's two GroupNorm kernels), summed over
the shards, normalise every shard as the whole image's would (backend.group_norm_apply, the
second). xDiT's DistVAE all-reduces twice (the sums, then squared deviations about the global
mean) to avoid the one-pass formula's cancellation; float64 accumulation makes that unnecessary
here, and it is what the unsharded CUDA kernel does.
"""
from __future__ import annotations

import numpy as np

from .shard_comm import ShardComm


def halo_conv2d(backend, xp, comm: ShardComm, x, w, bias=None, *, residual=None, activation: str | None = None):
    """A stride-1 "same" 2-D conv (kernel kh x kw, padding (kh-1)/2, (kw-1)/2, as the VAEs' 3x3
    convs) of the whole image, on this shard's rows. Each shard sends its first and last
    (kh-1)/2 rows to its neighbours; the image's own top and bottom get the conv's zero padding.
    residual: this shard's rows of a tensor added in the conv's epilogue (a resnet's skip)."""
    kh, kw = int(w.shape[1]), int(w.shape[2])
    if kh % 2 == 0 or kw % 2 == 0:
        raise ValueError(f"halo_conv2d takes odd kernels (a 'same' conv), got {kh}x{kw}")
    halo = (kh - 1) // 2
    if halo == 0:
        return backend.conv2d(x, w, bias, padding=((0, 0), ((kw - 1) // 2,) * 2), residual=residual,
                              activation=activation)
    if x.shape[1] < halo:
        raise ValueError(f"a shard of {x.shape[1]} rows cannot give a halo of {halo}")
    above, below = comm.exchange_rows(x[:, :halo], x[:, -halo:])
    edge = (x.shape[0], halo, *x.shape[2:])
    rows = [above if above is not None else xp.zeros(edge, x.dtype), x,
            below if below is not None else xp.zeros(edge, x.dtype)]
    padded = xp.ascontiguousarray(xp.concatenate(rows, axis=1))
    return backend.conv2d(padded, w, bias, padding=((0, 0), ((kw - 1) // 2,) * 2), residual=residual,
                          activation=activation)


def exact_group_norm(backend, comm: ShardComm, x, num_groups: int, weight=None, bias=None, eps: float = 1e-6,
                     activation: str | None = None, rows: tuple[int, int] | None = None):
    """GroupNorm over the whole image (every shard's rows), on this shard's rows: the backend's
    group_norm_sums of the shard, summed over shards by one all-reduce, then group_norm_apply
    with the whole image's element count per group. rows = (the image's, this shard's) rows at
    any one scale gives that count by proportion; None all-reduces it (a host round trip)."""
    n, c = x.shape[0], x.shape[-1]
    if c % num_groups:
        raise ValueError(f"{c} channels do not split into {num_groups} groups")
    sums = comm.allreduce_sum(backend.group_norm_sums(x, num_groups))
    own = x.size // (n * num_groups)
    if rows is not None:
        total, mine = rows
        if (own * total) % mine:
            raise ValueError(f"rows {rows} do not scale this shard's {own} elements per group to a whole count")
        count = float(own * total // mine)
    else:
        count = float(comm.allreduce_sum(np.array([own], np.float64))[0])
    return backend.group_norm_apply(x, sums, count, num_groups, weight, bias, eps, activation)
