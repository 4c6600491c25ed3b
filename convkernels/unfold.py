"""Convolution as one matrix product per group: unfold (im2col) for forward convs, fold (col2im)
for transposed ones, each built in tiles under a byte limit. The readable reference of both, and
the one implementation: the numpy backend (im2col_gemm, tiled_unfold), the mlx backend
(tiled_unfold) and the cuda backend (gemm_fallback, tiled_unfold) run this code, each on its own
array namespace `xp` (functions that take the namespace, in the spirit of array-api-compat).

Layouts are channels-last (spec.py): x (N, *spatial, C), w (O, *kernel, C/groups).

Forward. After padding, output position p reads input position p * stride + t * dilation
through kernel tap t. The patch matrix of group g has one row per output position and one column
per (tap, channel of g): taps in row-major order, channels fastest, which is the order of w's
(*kernel, C/groups) axes, so w's rows for g flattened are the weight matrix W_g (O/g, taps*C/g)
and out_g = patches_g @ W_g^T. The patches are read through one strided view of the padded input
(`windows`): nothing is copied until a tile of one group's patch matrix is laid out for its product.

Transposed (no zero-stuffed input). cols_g = x_g @ W'_g gives each input position's contribution
through every tap, (taps, O/g) per position; fold adds tap t's slab at output positions
i * stride + t * dilation of a buffer covering the full (unpadded) output, then the padding is
cropped away. Taps are added in order, so the sums are the same whichever backend runs it.

Tiling (`plan_tiles`). A patch matrix is prod(kernel) times the input's size (9x for a 3x3
conv). Where the whole batch's buffer exceeds `limit_bytes`, positions are taken one batch item
at a time, in boxes along the outermost spatial axis whose single line (with every axis inside
it) still fits; axes outside it are walked one index at a time. A conv laid out as H=1 (MLX PR
3084's conv_transpose1d) thus tiles along W. Each tile is one product: the bound holds for the
patch (col) buffer of one group.

The array namespace has numpy's pad, empty, zeros and ascontiguousarray, plus
as_strided(x, shape, strides) and strides(x) in elements (not bytes), matmul_weights(wt), the
transposed weight matrix in the layout the product takes, and evaluate(x), which runs what a
lazy library has queued (each tile before the next is built, so the bound holds).
`NumpyLike(numpy)` and `NumpyLike(cupy)` are two; backends.mlx.paths.MLX_ARRAYS is mlx.core's.
"""
from __future__ import annotations

import itertools
import operator
from typing import Any, Callable, Iterator

from .spec import ConvSpec, prod

Array = Any


class NumpyLike:
    """numpy or cupy as the array namespace of this module: their own functions, strides in
    elements of the array's own layout, and nothing to evaluate (both compute eagerly).
    contiguous_weights: give the product a contiguous copy of each transposed weight matrix
    (the cuda backend's cuBLAS gemms run on it as on every other operand); NumPy's BLAS reads
    the transposed view itself, by its transpose flag."""

    def __init__(self, module, contiguous_weights: bool = False):
        self.module = module
        self.pad, self.empty, self.zeros = module.pad, module.empty, module.zeros
        self.ascontiguousarray = module.ascontiguousarray
        self.contiguous_weights = contiguous_weights

    def matmul_weights(self, wt):
        """A transposed weight matrix (a view) as the product takes it."""
        return self.module.ascontiguousarray(wt) if self.contiguous_weights else wt

    def as_strided(self, x, shape, strides):
        return self.module.lib.stride_tricks.as_strided(x, shape, tuple(s * x.itemsize for s in strides))

    @staticmethod
    def strides(x) -> tuple[int, ...]:
        return tuple(s // x.itemsize for s in x.strides)

    @staticmethod
    def evaluate(x) -> None:
        return


# ---- sizes and tiles -------------------------------------------------------------------------------

def unfold_bytes(x_shape, w_shape, out_shape, spec: ConvSpec, itemsize: int = 4) -> int:
    """Bytes of one group's untiled patch matrix (forward) or col matrix (transposed)."""
    taps = prod(w_shape[1:-1])
    if spec.transpose:
        return prod(x_shape[:-1]) * taps * (w_shape[0] // spec.groups) * itemsize
    return prod(out_shape[:-1]) * taps * w_shape[-1] * itemsize


def unfold_tiles(positions: tuple[int, ...], position_bytes: int, limit_bytes: int) -> Iterator[tuple]:
    """Boxes of one batch item's positions whose buffers fit `limit_bytes`: (axis, outer index,
    start, stop), the box being [start, stop) along `axis`, the single index `outer` on the axes
    before it and everything on the axes after it. At least one position a box, even when that
    alone is over the limit."""
    inner = 1
    axis = len(positions) - 1
    for a in range(len(positions) - 1, -1, -1):
        if prod(positions[a + 1:]) * position_bytes > limit_bytes:
            break
        axis, inner = a, prod(positions[a + 1:])
    step = max(1, min(positions[axis], limit_bytes // max(1, inner * position_bytes)))
    for outer in itertools.product(*(range(v) for v in positions[:axis])):
        for r0 in range(0, positions[axis], step):
            yield axis, outer, r0, min(r0 + step, positions[axis])


def plan_tiles(n: int, positions: tuple[int, ...], position_bytes: int, limit_bytes: int):
    """([(batch slice, box)], tiled): the whole batch as one tile when its buffer fits, else
    unfold_tiles of each batch item. A box is ((start, stop) per spatial axis)."""
    if n * prod(positions) * position_bytes <= limit_bytes:
        return [(slice(0, n), tuple((0, p) for p in positions))], False
    tiles = []
    for b in range(n):
        for axis, outer, r0, r1 in unfold_tiles(positions, position_bytes, limit_bytes):
            box = (*((o, o + 1) for o in outer), (r0, r1), *((0, p) for p in positions[axis + 1:]))
            tiles.append((slice(b, b + 1), box))
    return tiles, True


def _index(batch: slice, box) -> tuple:
    return (batch, *(slice(a, b) for a, b in box))


# ---- forward: unfold --------------------------------------------------------------------------------

def windows(xp, xpad, out_positions, kernel, stride, dilation):
    """View (N, *out_positions, *kernel, C) of a padded input: element [n, p, t, c] is
    xpad[n, p * stride + t * dilation, c]. A view: nothing is copied."""
    st = xp.strides(xpad)
    nd = len(kernel)
    shape = (xpad.shape[0], *out_positions, *kernel, xpad.shape[-1])
    strides = (st[0], *(st[1 + i] * stride[i] for i in range(nd)), *(st[1 + i] * dilation[i] for i in range(nd)),
               st[-1])
    return xp.as_strided(xpad, shape, strides)


def conv_unfold_gemm(xp, x, w, spec: ConvSpec, out_shape, limit_bytes: int,
                     matmul: Callable = operator.matmul) -> tuple[Array, bool]:
    """Forward conv: x (N,*sp,C), w (O,*k,C/g) -> (out (N,*out_sp,O) in x's dtype, tiled).
    `matmul` is the product to use (the cuda backend passes its capturable cuBLAS one)."""
    g = spec.groups
    og, cg = w.shape[0] // g, w.shape[-1]
    kernel = tuple(w.shape[1:-1])
    kc = prod(kernel) * cg
    if any(lo or hi for lo, hi in spec.padding):
        x = xp.pad(x, ((0, 0), *spec.padding, (0, 0)))
    out_sp = tuple(out_shape[1:-1])
    win = windows(xp, x, out_sp, kernel, spec.stride, spec.dilation)
    wmats = [xp.matmul_weights(w[i * og:(i + 1) * og].reshape(og, kc).T) for i in range(g)]
    tiles, tiled = plan_tiles(x.shape[0], out_sp, kc * x.itemsize, limit_bytes)
    if not tiled and g == 1:  # one product, its result already laid out as the output
        return matmul(win.reshape(-1, kc), wmats[0]).reshape(tuple(out_shape)), False
    out = xp.empty(tuple(out_shape), dtype=x.dtype)
    for batch, box in tiles:
        idx = _index(batch, box)
        patches = win[idx]  # (tile batch, *box, *kernel, C), still a view
        lead = patches.shape[:1 + len(out_sp)]
        m = prod(lead)
        for i in range(g):
            cols = patches[..., i * cg:(i + 1) * cg].reshape(m, kc)  # the tile's patch matrix: a copy
            out[(*idx, slice(i * og, (i + 1) * og))] = matmul(cols, wmats[i]).reshape(*lead, og)
        xp.evaluate(out)
    return out, tiled


# ---- transposed: fold ---------------------------------------------------------------------------------

def conv_transpose_col2im(xp, x, w, spec: ConvSpec, out_shape, limit_bytes: int,
                          matmul: Callable = operator.matmul) -> tuple[Array, bool]:
    """Transposed conv: x (N,*sp,Cin), w (O,*k,Cin/g) -> (out (N,*out_sp,O) in x's dtype, tiled)."""
    g = spec.groups
    o_ch, cg = w.shape[0], w.shape[-1]
    og = o_ch // g
    kernel = tuple(w.shape[1:-1])
    taps = list(itertools.product(*(range(k) for k in kernel)))
    in_sp = tuple(x.shape[1:-1])
    out_sp = tuple(out_shape[1:-1])
    lo = [p[0] for p in spec.padding]
    full = [(s_in - 1) * s + d * (k - 1) + 1 for s_in, s, d, k in zip(in_sp, spec.stride, spec.dilation, kernel)]
    buf_sp = [max(f, lo_ + o) for f, lo_, o in zip(full, lo, out_sp)]
    buf = xp.zeros((x.shape[0], *buf_sp, o_ch), dtype=x.dtype)
    # W'_g (C/g, taps * O/g): column (t, o) holds w[g*og + o, tap t, c]
    wmats = [xp.ascontiguousarray(w[i * og:(i + 1) * og].reshape(og, len(taps), cg).transpose(2, 1, 0))
             .reshape(cg, len(taps) * og) for i in range(g)]
    tiles, tiled = plan_tiles(x.shape[0], in_sp, len(taps) * og * x.itemsize, limit_bytes)
    for batch, box in tiles:
        xs = x[_index(batch, box)]
        counts = xs.shape[1:-1]
        m = prod(xs.shape[:-1])
        for i in range(g):
            xg = xp.ascontiguousarray(xs[..., i * cg:(i + 1) * cg]).reshape(m, cg)
            cols = matmul(xg, wmats[i]).reshape(*xs.shape[:-1], len(taps), og)
            for t, offs in enumerate(taps):
                starts = [a0 * s + o * d for (a0, _), o, s, d in zip(box, offs, spec.stride, spec.dilation)]
                sl = tuple(slice(st, st + (cnt - 1) * s + 1, s) for st, cnt, s in zip(starts, counts, spec.stride))
                buf[(batch, *sl, slice(i * og, (i + 1) * og))] += cols[..., t, :]
        xp.evaluate(buf)
    crop = tuple(slice(lo_, lo_ + o) for lo_, o in zip(lo, out_sp))
    return xp.ascontiguousarray(buf[(slice(None), *crop)]), tiled
