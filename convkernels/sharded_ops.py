"""The two layers that need another shard's data when an image or video is split by rows over
devices, computed exactly: a conv, which needs its neighbours' edge rows (the halo),
and GroupNorm, whose statistics cover the whole image. Everything else in a VAE decoder (RMS
norm over channels, activations, pointwise convs) is row-local and runs on a shard as it is.

They take the shard's rows (channels-last: images N,H,W,C with rows on axis 1, videos N,T,H,W,C
with rows on axis 2), its communicator (collectives.shard_comm.ShardComm) and its backend, whose ops
(slice, concat, conv) they are written in, once for every backend; and return what the
unsharded layer returns for those rows. A video's causal conv (row_halo_parts, then
haloed_conv3d) needs only rows from its neighbours, never frames: its time padding, and the cache
of earlier frames a chunked decode keeps, are the shard's own. Where a shard holds the image's own top or bottom, the conv's zero
padding stands for the missing rows (row_halo_parts): no shard copies zero rows in.

GroupNorm is exact through one all-reduce of its statistics: each shard's float64 sums of x and
x*x per group (backend.group_norm_sums, the first of CUDA's two GroupNorm kernels), summed over
the shards, normalise every shard as the whole image's would (backend.group_norm_apply, the
second). xDiT's DistVAE all-reduces twice (the sums, then squared deviations about the global
mean) to avoid the one-pass formula's cancellation; float64 accumulation makes that unnecessary
here, and it is what the unsharded CUDA kernel does.
"""
from __future__ import annotations

import numpy as np

from .collectives.shard_comm import ShardComm


def halo_rows(backend, comm: ShardComm, x, halo: int, axis: int = 1):
    """((above, below), (top, bottom)): `halo` rows (on `axis`) of each neighbour, None where the
    shard holds the image's own top or bottom, and how many zero rows are missing on each side
    there (`halo`, else 0). For a consumer that takes the rows apart from the shard's own (a norm
    that writes them where the joined rows would lie: backend.rms_norm's `rows`)."""
    if x.shape[axis] < halo:
        raise ValueError(f"a shard of {x.shape[axis]} rows cannot give a halo of {halo}")
    n = x.shape[axis]
    above, below = comm.exchange_rows(backend.slice(x, axis, 0, halo), backend.slice(x, axis, n - halo, n))
    return (above, below), (0 if above is not None else halo, 0 if below is not None else halo)


def row_halo_parts(backend, comm: ShardComm, x, halo: int, axis: int = 1):
    """(rows, (top, bottom)): this shard's rows (on `axis`) with `halo` rows of each neighbour
    around them, and how many zero rows are still missing on each side (`halo` where the shard
    holds the image's own top or bottom, 0 elsewhere). A conv of `rows` that pads (top, bottom)
    zero rows gives exactly this shard's rows of the whole image's 'same' conv; the zeros are
    left to the conv's padding, so no copy of the rows is made to add them."""
    (above, below), missing = halo_rows(backend, comm, x, halo, axis)
    if above is None and below is None:
        return x, missing
    return backend.concat([r for r in (above, x, below) if r is not None], axis=axis), missing


def wide_row_halo_parts(backend, comm: ShardComm, x, halo: int, counts, axis: int = 1):
    """row_halo_parts for a halo taller than some shard's band (a 5x5 conv at the latents' scale on
    bands of one row): `counts` is every shard's row count at x's scale, rank order. Each shard
    all-gathers its first and last min(rows, halo) rows; the rows above a band are the last rows
    of the shards above it, nearest first, as far as `halo` reaches (below likewise). Where fewer
    than `halo` rows lie beyond the band the image ends there: the conv's zero padding stands in."""
    counts = [int(c) for c in counts]
    k = [min(c, halo) for c in counts]
    n, me = x.shape[axis], comm.rank
    edges = backend.concat([backend.slice(x, axis, 0, k[me]), backend.slice(x, axis, n - k[me], n)], axis=axis)
    every = comm.allgather(edges, [2 * c for c in k])
    above, need = [], halo
    for r in range(me - 1, -1, -1):
        if not need:
            break
        take = min(need, k[r])  # the last `take` of its last k[r] rows
        above.insert(0, backend.slice(every[r], axis, 2 * k[r] - take, 2 * k[r]))
        need -= take
    below, need_below = [], halo
    for r in range(me + 1, comm.size):
        if not need_below:
            break
        take = min(need_below, k[r])  # the first `take` of its first k[r] rows
        below.append(backend.slice(every[r], axis, 0, take))
        need_below -= take
    return backend.concat(above + [x] + below, axis=axis), (need, need_below)


def _odd_space_kernel(w, name: str) -> None:
    space = tuple(int(k) for k in w.shape[-3:-1])
    if any(k % 2 == 0 for k in space):
        raise ValueError(f"{name} takes odd spatial kernels (a 'same' conv), got {space}")


def halo_conv2d(backend, comm: ShardComm, x, w, bias=None, *, residual=None, activation: str | None = None,
                groups: int = 1, counts=None):
    """A stride-1 "same" 2-D conv (kernel kh x kw, padding (kh-1)/2, (kw-1)/2, as the VAEs' 3x3
    convs) of the whole image, on this shard's rows. Each shard sends its first and last
    (kh-1)/2 rows to its neighbours; the image's own top and bottom get the conv's zero padding.
    residual: this shard's rows of a tensor added in the conv's epilogue (a resnet's skip).
    groups: a grouped conv's (a depthwise one's halo is the same rows of every channel).
    counts: every shard's rows at x's scale where some band may be shorter than the halo
    (wide_row_halo_parts then gathers rows from beyond the neighbours)."""
    _odd_space_kernel(w, "halo_conv2d")
    kh, kw = int(w.shape[1]), int(w.shape[2])
    rows_pad, halo = (0, 0), (kh - 1) // 2
    if halo and counts is not None and min(counts) < halo:
        x, rows_pad = wide_row_halo_parts(backend, comm, x, halo, counts, axis=1)
    elif halo:
        x, rows_pad = row_halo_parts(backend, comm, x, halo, axis=1)
    return backend.conv2d(x, w, bias, padding=(rows_pad, ((kw - 1) // 2,) * 2), groups=groups, residual=residual,
                          activation=activation)


def halo_upsample_conv2d(backend, comm: ShardComm, x, w, bias=None, *, residual_for=None):
    """backend.upsample_conv2d (nearest 2x, then a 'same' 3x3 conv, weight O,3,3,C) of the whole
    image, on this shard's rows (N,H,W,C, rows on axis 1): output rows [2a, 2b) of input rows
    [a, b). One input row from each neighbour is enough (an output row reads the upsampled rows
    next to it, which are input rows at most one away); the op runs on the haloed rows at the
    input's resolution and the output rows that came from the halo rows are dropped (a view for
    batch 1). At the image's own top and bottom the op's zero padding is the image's.
    residual_for(above, below), if given, makes what the op's epilogue adds: a row for every row
    the op computes, which is two more before the shard's output rows where a halo row came from
    above, two more after where one came from below (those rows are dropped, so the residual's
    rows there may hold anything)."""
    rows, (top, bottom) = row_halo_parts(backend, comm, x, 1, axis=1)
    residual = residual_for(not top, not bottom) if residual_for is not None else None
    start = 0 if top else 2  # the upper halo row, where there is one, gave two output rows
    out = backend.upsample_conv2d(rows, w, bias, residual=residual)
    return backend.slice(out, 1, start, start + 2 * x.shape[1])


def haloed_conv3d(backend, x, w, bias=None, *, time_pad: int = 0, rows_pad: tuple[int, int] = (0, 0), residual=None,
                  activation: str | None = None):
    """A stride-1 3-D conv of a video's rows (N,T,H,W,C, rows on axis 2; weight O,kT,kH,kW,I) on
    input that already carries its row halo (row_halo_parts on axis 2): `time_pad` zero frames in front (a causal conv's), none behind, width padded 'same', rows
    by `rows_pad` (the zero rows row_halo_parts left missing). A lone frame padded with kT - 1
    zero frames meets only the kernel's last tap, so only that tap is run (what CausalConv3d does
    on a decode's first frame)."""
    kt, kw = int(w.shape[1]), int(w.shape[3])
    if x.shape[1] == 1 and kt > 1 and time_pad == kt - 1:
        w, time_pad = backend.concat([backend.slice(w, 1, kt - 1, kt)], axis=1), 0
    return backend.conv3d(x, w, bias, padding=((time_pad, 0), tuple(rows_pad), ((kw - 1) // 2,) * 2),
                          residual=residual, activation=activation)


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
