"""gemm_fallback: convolution as explicit im2col / col2im + a BLAS matmul, written against an
array module `xp` (CuPy on the GPU, where the matmul is cuBLAS; NumPy in the CPU tests of
this very code). Used for keys cuDNN has no plan for (the cached FALLBACK answer) and when
the backend is created with force_fallback=True.

Computes in float32 whatever the storage dtype (the caller casts in and out): it is the
correctness path, so it trades speed for accuracy. The unfold buffer is built in row tiles
of (batch, first spatial axis) that stay under `limit_bytes`; `tiled` in the result says
whether the limit bound (the metrics then name the path `tiled_unfold`). `matmul` is the
product to use (default `@`); the CUDA backend passes its cuBLAS C-API matmul, which a CUDA
graph can capture (CuPy's cuBLAS calls cannot be).
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Callable

from ..spec import ConvSpec, prod


def unfold_bytes(x_shape, w_shape, out_shape, spec: ConvSpec, itemsize: int = 4) -> int:
    """Bytes of the untiled unfold (forward: patches) or col (transposed: x @ W) buffer."""
    taps = prod(w_shape[1:-1])
    if spec.transpose:
        return prod(x_shape[:-1]) * taps * w_shape[0] * itemsize
    return prod(out_shape[:-1]) * taps * x_shape[-1] * itemsize


def _row_tiles(n: int, rows: int, bytes_per_row: int, total_bytes: int, limit: int):
    """[(batch slice, row start, row stop)]: one tile if everything fits, else per batch item
    in chunks of rows that fit (at least one row, even if that row alone is over the limit)."""
    if total_bytes <= limit:
        return [(slice(0, n), 0, rows)], False
    step = max(1, min(rows, limit // max(1, bytes_per_row)))
    return [(slice(b, b + 1), r, min(r + step, rows)) for b in range(n) for r in range(0, rows, step)], True


def conv_forward(xp: Any, x, w, spec: ConvSpec, out_shape, limit_bytes: int,
                 matmul: Callable = operator.matmul):
    """x (N,*sp,C) f32, w (O,*k,C/g) f32 -> (out (N,*osp,O) f32, tiled)."""
    nd = spec.nd
    g = spec.groups
    o_ch, cg = w.shape[0], w.shape[-1]
    og = o_ch // g
    kernel = tuple(w.shape[1:-1])
    taps = list(itertools.product(*(range(k) for k in kernel)))
    n_t = len(taps)
    pads = tuple(spec.padding)
    if any(lo or hi for lo, hi in pads):
        x = xp.pad(x, ((0, 0), *pads, (0, 0)))
    out_sp = tuple(out_shape[1:-1])
    n, c = x.shape[0], x.shape[-1]
    out = xp.empty(tuple(out_shape), dtype=xp.float32)
    wmats = [xp.ascontiguousarray(w[i * og:(i + 1) * og].reshape(og, n_t * cg).T) for i in range(g)]
    row_px = prod(out_sp[1:])
    tiles, tiled = _row_tiles(n, out_sp[0], row_px * n_t * c * 4,
                              n * prod(out_sp) * n_t * c * 4, limit_bytes)
    for bsel, r0, r1 in tiles:
        nb = bsel.stop - bsel.start
        rows = r1 - r0
        cols = xp.empty((nb, rows, *out_sp[1:], n_t, c), dtype=xp.float32)
        for t, offs in enumerate(taps):
            sl = []
            for i in range(nd):
                start = offs[i] * spec.dilation[i] + (r0 * spec.stride[0] if i == 0 else 0)
                cnt = rows if i == 0 else out_sp[i]
                sl.append(slice(start, start + (cnt - 1) * spec.stride[i] + 1, spec.stride[i]))
            cols[(Ellipsis, t, slice(None))] = x[(bsel, *sl, slice(None))]
        m = nb * rows * row_px
        dst = out[bsel, r0:r1]
        if g == 1:
            dst[...] = matmul(cols.reshape(m, n_t * c), wmats[0]).reshape(dst.shape)
        else:
            for i in range(g):
                cols_g = xp.ascontiguousarray(cols[..., i * cg:(i + 1) * cg]).reshape(m, n_t * cg)
                dst[..., i * og:(i + 1) * og] = matmul(cols_g, wmats[i]).reshape(*dst.shape[:-1], og)
    return out, tiled


def conv_transpose(xp: Any, x, w, spec: ConvSpec, out_shape, limit_bytes: int,
                   matmul: Callable = operator.matmul):
    """Transposed conv without zero-stuffing: cols = x @ W_g per group (input rows in tiles),
    then each kernel tap's slab is added at the strided output positions; crop the padding.
    x (N,*sp,Cin) f32, w (O,*k,Cin/g) f32 -> (out (N,*osp,O) f32, tiled)."""
    nd = spec.nd
    g = spec.groups
    o_ch, cg = w.shape[0], w.shape[-1]
    og = o_ch // g
    kernel = tuple(w.shape[1:-1])
    taps = list(itertools.product(*(range(k) for k in kernel)))
    n_t = len(taps)
    in_sp = tuple(x.shape[1:-1])
    n = x.shape[0]
    out_sp = tuple(out_shape[1:-1])
    lo = [p[0] for p in spec.padding]
    full = [(s_in - 1) * s + d * (k - 1) + 1 for s_in, s, d, k in zip(in_sp, spec.stride, spec.dilation, kernel)]
    buf_sp = [max(f, l + o) for f, l, o in zip(full, lo, out_sp)]
    buf = xp.zeros((n, *buf_sp, o_ch), dtype=xp.float32)
    wmats = [xp.ascontiguousarray(w[i * og:(i + 1) * og].reshape(og, n_t, cg).transpose(2, 1, 0))
             .reshape(cg, n_t * og) for i in range(g)]
    row_px = prod(in_sp[1:])
    tiles, tiled = _row_tiles(n, in_sp[0], row_px * n_t * og * 4,
                              n * prod(in_sp) * n_t * og * 4, limit_bytes)
    for bsel, r0, r1 in tiles:
        xs = x[bsel, r0:r1]
        m = prod(xs.shape[:-1])
        for i in range(g):
            xg = xp.ascontiguousarray(xs[..., i * cg:(i + 1) * cg]).reshape(m, cg)
            cols = matmul(xg, wmats[i]).reshape(*xs.shape[:-1], n_t, og)
            for t, offs in enumerate(taps):
                sl = []
                for a in range(nd):
                    start = offs[a] * spec.dilation[a] + (r0 * spec.stride[0] if a == 0 else 0)
                    cnt = xs.shape[1 + a]
                    sl.append(slice(start, start + (cnt - 1) * spec.stride[a] + 1, spec.stride[a]))
                buf[(bsel, *sl, slice(i * og, (i + 1) * og))] += cols[..., t, :]
    crop = tuple(slice(l, l + o) for l, o in zip(lo, out_sp))
    return xp.ascontiguousarray(buf[(slice(None), *crop)]), tiled
