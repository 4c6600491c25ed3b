"""The two layers that need another shard's data when an image or video is split by rows over
devices (issue #32), computed exactly: a conv, which needs its neighbours' edge rows (the halo),
and GroupNorm, whose statistics cover the whole image. Everything else in a VAE decoder (RMS
norm over channels, activations, pointwise convs) is row-local and runs on a shard as it is.

Both take the shard's rows (channels-last N,H,W,C, rows on axis 1), its communicator
(shard_comm.ShardComm) and the array namespace `xp` the backend's arrays live in (numpy, cupy),
and return what the unsharded layer returns for those rows.

GroupNorm is exact through two all-reduces, as xDiT's DistVAE does: the per-group sums (and
element counts) give the global mean; the sums of squared deviations about that mean give the
variance. Summing squares about a shard's own mean instead would be the one-pass formula whose
cancellation loses precision in half precision; the second all-reduce costs one small message.
"""
from __future__ import annotations

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


def exact_group_norm(xp, comm: ShardComm, x, num_groups: int, weight=None, bias=None, eps: float = 1e-6,
                     activation: str | None = None):
    """GroupNorm over the whole image (every shard's rows), on this shard's rows, statistics in
    float64; the result in x's dtype. activation: None or "silu" (the VAEs' norm + SiLU)."""
    n, c = x.shape[0], x.shape[-1]
    if c % num_groups:
        raise ValueError(f"{c} channels do not split into {num_groups} groups")
    groups = x.reshape(n, -1, num_groups, c // num_groups).astype(xp.float64)
    count = comm.allreduce_sum(xp.asarray(float(groups.shape[1] * groups.shape[3])))
    mean = comm.allreduce_sum(groups.sum(axis=(1, 3))) / count                      # (n, groups)
    centred = groups - mean[:, None, :, None]
    var = comm.allreduce_sum((centred * centred).sum(axis=(1, 3))) / count
    y = (centred / xp.sqrt(var + eps)[:, None, :, None]).reshape(x.shape)
    if weight is not None:
        y = y * weight.astype(xp.float64)
    if bias is not None:
        y = y + bias.astype(xp.float64)
    if activation == "silu":
        y = y / (1.0 + xp.exp(-y))
    elif activation is not None:
        raise ValueError(f"exact_group_norm: activation {activation!r} is not offered (None or 'silu')")
    return y.astype(x.dtype)
