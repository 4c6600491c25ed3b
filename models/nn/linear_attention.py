"""ReLU linear attention (EfficientViT's LiteMLA, diffusers' SanaMultiscaleLinearAttention core),
shard-aware: on a row shard its two global sums are one all-reduce.

Per head, with q and k passed through ReLU and tokens t over the whole image:
    out[t] = (q[t] @ sum_t' k[t']^T v[t']) / (q[t] @ sum_t' k[t'] + eps)
diffusers computes this as `v padded with a row of ones, times k^T, times q` and divides by the
last row. Those sums, a (d, d + 1) matrix per head, are all of the image a token needs: on a row
shard (row_shard.py) each shard sums its own tokens and an all-reduce adds the shards' sums, so every
shard's queries see the whole image's keys and values at the cost of a few KiB per layer, never the
other shards' tokens.

The sums are taken as means (k scaled by 1 / the whole image's token count, eps likewise): the
quotient is the same. On a half-precision backend the layer computes in float32, as diffusers
upcasts it: in float16, eps / tokens flushes to zero and a query whose ReLU is all zero divides
0 by 0 (NaN; the H200's float16 encode of DC-AE, 2026-11-29).

diffusers runs its "quadratic" form when an image has no more tokens than the head dimension:
softmax-free scores k^T q normalised over keys, then v times them. That is the same quotient
(sum over keys and head channels in the other order), so this layer computes it one way for
every size, and a shard never needs to know which form the whole image would take.

A backend may offer both passes as ops (relu_linear_attention_sums / _apply, convkernels/protocol.py)
that read the projections in place; the slices below are the route of every other backend.
"""
from __future__ import annotations

from . import row_shard


def relu_linear_attention(backend, qkv, head_dim: int, eps: float = 1e-15):
    """qkv (N, H, W, G * 3 * head_dim) channels-last: G groups of [q | k | v] (head_dim channels
    each, diffusers' reshape of its concatenated projections) -> (N, H, W, G * head_dim), channel
    g * head_dim + i. qkv may be a list of such arrays, diffusers' concatenation on channels in
    its parts: a backend whose passes read them where they lie never makes it. On a row shard,
    this shard's rows of the whole image's result."""
    parts = list(qkv) if isinstance(qkv, (list, tuple)) else [qkv]
    n, h, w = parts[0].shape[:3]
    c = sum(int(p.shape[-1]) for p in parts)
    d = int(head_dim)
    if c % (3 * d):
        raise ValueError(f"relu_linear_attention: {c} channels are not groups of 3 x {d}")
    groups, tokens = c // (3 * d), h * w
    shard = row_shard.current()
    whole = tokens if shard is None else sum(shard.token_counts(h, w))
    b = backend
    sums = b.relu_linear_attention_sums(qkv, d, 1.0 / whole)
    if sums is not None:  # the backend's two passes read q, k and v in place (the CUDA backend's kernels)
        if shard is not None:
            sums = all_sum(b, shard.comm, sums)
        out = b.relu_linear_attention_apply(qkv, sums, d, eps / whole)
        if out is not None:
            return out
    qkv = parts[0] if len(parts) == 1 else b.concat(parts, axis=-1)
    stored = b.dtype_of(qkv)
    qkv = b.astype(qkv, "float32")
    x = b.transpose(b.reshape(qkv, (n, tokens, groups, 3 * d)), (0, 2, 1, 3))  # (N, G, T, 3d)
    q = b.relu(b.slice(x, -1, 0, d))
    k = b.mul(b.relu(b.slice(x, -1, d, 2 * d)), 1.0 / whole)
    v = b.slice(x, -1, 2 * d, 3 * d)
    ones = b.add(b.mul(b.slice(v, -1, 0, 1), 0.0), 1.0)  # the padded row of ones, made on the device
    sums = b.matmul(b.transpose(k, (0, 1, 3, 2)), b.concat([v, ones], axis=-1))  # (N, G, d, d + 1)
    if shard is not None:
        sums = all_sum(b, shard.comm, sums)
    out = b.matmul(q, sums)  # (N, G, T, d + 1)
    y = b.divide(b.slice(out, -1, 0, d), b.add(b.slice(out, -1, d, d + 1), eps / whole))
    return b.astype(b.reshape(b.transpose(y, (0, 2, 1, 3)), (n, h, w, groups * d)), stored)


def all_sum(backend, comm, a):
    """Every shard's `a` added, on every shard: one all-reduce. bfloat16, which the NCCL
    communicator does not reduce, is all-gathered and added in rank order (the same sum on every
    shard); its lengths are known (every shard's sums have one shape), so no host round trip."""
    if backend.dtype_of(a) != "bfloat16":
        return comm.allreduce_sum(a)
    parts = comm.allgather(a, [int(a.shape[1])] * comm.size)
    total = parts[0]
    for part in parts[1:]:
        total = backend.add(total, part)
    return total
