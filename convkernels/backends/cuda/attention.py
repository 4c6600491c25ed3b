"""The CUDA backend's attention: softmax(q k^T * scale) v over (..., L, D), as cuBLAS products and
one softmax kernel per chunk of query rows, so the score matrix stays within SCORE_BYTES; and ReLU
linear attention's two passes (src/linear_attention.cu), which read q, k and v in place.

Per storage dtype:
- float32: float32 throughout (TF32 only where the backend allows it).
- float16: both products in float16 with float32 accumulation, the scores stored in float16.
- bfloat16: both products in bfloat16 with float32 accumulation. The scores stay float32 (cuBLAS
  writes its accumulator), because bfloat16's 8-bit mantissa would round a score near 100 to a
  multiple of 0.5. The softmax reads them in float32 and writes each probability as two bfloat16
  values, its rounding and the rest; the second product takes [hi | lo] times [v; v], one GEMM
  twice as deep, and so sums with 16 bits of each probability. With the probabilities rounded
  once, the attention's error was 1.4x PyTorch's own bfloat16 attention's, which keeps them in
  float32 (2026-11-26, tests/gpu/test_cuda_attention_bf16.py), and a Qwen-Image decode's went past
  the 1.5x that the 2026 families' half-precision criterion allows.
  (Before, bfloat16 attention cast q, k and v to float32 and ran both products as float32 GEMMs,
  several times slower on tensor-core GPUs: the 262k-token mid-block attention of a 4096x4096
  FLUX.2 or Qwen-Image decode.)
"""
from __future__ import annotations

import numpy as np

from ...spec import prod
from .kernels import BLOCK, STORAGE

#: bound on one chunk of attention scores (its probabilities take as much again)
SCORE_BYTES = 256 << 20


def attention(backend, q, k, v, scale: float):
    """backend._attention: q, k, v of one storage dtype (the backend's `dtype_of`)."""
    cp, arrays = backend.cp, backend.arrays
    dt = backend.dtype_of(q)
    q, k, v = (arrays.cast(t, dt) for t in (q, k, v))  # one dtype for cuBLAS (a no-op in the models)
    kern = arrays.kernels(dt)
    kt = cp.swapaxes(k, -1, -2)
    lq, lk = q.shape[-2], k.shape[-2]
    mixed = dt == "bfloat16"
    score_bytes = 4 if mixed else np.dtype(q.dtype).itemsize
    step = max(1, min(lq, SCORE_BYTES // max(1, prod(q.shape[:-2]) * lk * score_bytes)))
    out = cp.empty((*q.shape[:-1], v.shape[-1]), dtype=q.dtype)
    v_twice = cp.concatenate([v, v], axis=-2) if mixed else None  # for the probabilities' two halves
    for s in range(0, lq, step):
        rows = q[..., s:s + step, :]
        if mixed:
            probs = kern.softmax_rows_f32(backend.blas.matmul(rows, kt, out_dtype=np.float32), scale)
            out[..., s:s + step, :] = backend.blas.matmul(probs, v_twice)
        else:
            probs = kern.softmax_rows(arrays.contiguous(backend.blas.matmul(rows, kt)), scale)
            out[..., s:s + step, :] = backend.blas.matmul(probs, v)
    return out


#: linear_attention.cu's bounds: tokens per tile of la_sums, the largest head dimension
LA_TT, LA_MAXD = 32, 64
#: tokens per block of la_apply (its 8 warps take one each in turn; the group's sums are read once)
LA_APPLY_TOKENS = 256


def _linear_attention_parts(backend, qkv, head_dim: int):
    """(first buffer, second buffer, groups in the first, (n, tokens, groups, d)) where the kernels
    take qkv: an (N, H, W, G * 3d) array, or a list of one or two such arrays whose channels are
    concatenated (models/nn/linear_attention.py); else None."""
    parts = list(qkv) if isinstance(qkv, (list, tuple)) else [qkv]
    d = int(head_dim)
    if not 1 <= len(parts) <= 2 or not 0 < d <= LA_MAXD:
        return None
    dtype, lead = backend.dtype_of(parts[0]), parts[0].shape[:-1]
    for p in parts:
        if p.ndim != 4 or p.shape[:-1] != lead or p.shape[-1] % (3 * d) or backend.dtype_of(p) != dtype:
            return None
    if dtype not in STORAGE:
        return None
    n, h, w, _ = parts[0].shape
    first, groups = parts[0].shape[-1] // (3 * d), sum(p.shape[-1] for p in parts) // (3 * d)
    if n * groups > 65535:
        return None
    contiguous = [backend.arrays.contiguous(p) for p in parts]
    return contiguous[0], contiguous[-1], first, (n, h * w, groups, d)


def la_chunks(tokens: int, blocks: int, sm_count: int) -> tuple[int, int]:
    """(tokens a chunk, chunks) of la_sums over `blocks` (n, group) pairs: whole tiles a chunk,
    and enough chunks that the launch has two blocks for every multiprocessor where it can."""
    tiles = -(-tokens // LA_TT)
    chunk = -(-tiles // max(1, min(tiles, -(-2 * sm_count // blocks)))) * LA_TT
    return chunk, -(-tokens // chunk)


def relu_linear_attention_sums(self, qkv, head_dim: int, scale: float):
    """CudaBackend.relu_linear_attention_sums (bound there: self is the backend): la_sums over
    chunks of tokens, enough blocks for every multiprocessor twice, then the chunks added in order
    (float32 (N, G, d, d + 1)); qkv one array or two whose channels it reads as concatenated."""
    found = _linear_attention_parts(self, qkv, head_dim)
    if found is None:
        return None
    qkv1, qkv2, first, (n, tokens, groups, d) = found
    kern = self.arrays.kernels(self.dtype_of(qkv1))
    chunk, chunks = la_chunks(tokens, n * groups, kern.sm_count)
    part = self.cp.empty((n, groups, chunks, d, d + 1), dtype=np.float32)
    kern.fn("la_sums")((chunks, n * groups), (BLOCK,), (qkv1, qkv2, part, np.int64(tokens), np.int32(groups),
                                                       np.int32(first), np.int32(d), np.int64(chunk),
                                                       np.float32(scale)))
    return part.reshape(n, groups, d, d + 1) if chunks == 1 else part.sum(axis=2)


def relu_linear_attention_apply(self, qkv, sums, head_dim: int, eps: float):
    """CudaBackend.relu_linear_attention_apply (bound there): la_apply, qkv's dtype out
    (N, H, W, G * d)."""
    found = _linear_attention_parts(self, qkv, head_dim)
    if found is None:
        return None
    cp = self.cp
    qkv1, qkv2, first, (n, tokens, groups, d) = found
    kern = self.arrays.kernels(self.dtype_of(qkv1))
    y = cp.empty((*qkv1.shape[:3], groups * d), dtype=qkv1.dtype)
    sums = cp.ascontiguousarray(sums, dtype=cp.float32)
    kern.fn("la_apply")((-(-tokens // LA_APPLY_TOKENS), n * groups), (BLOCK,), (
        qkv1, qkv2, sums, y, np.int64(tokens), np.int32(groups), np.int32(first), np.int32(d), np.float32(eps),
        np.int64(LA_APPLY_TOKENS)))
    return y
