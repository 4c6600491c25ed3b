"""NumPy convolution algorithms (channels-last, N-d) beyond unfold / col2im (those are
convkernels/unfold.py, shared with the other backends, run here on NUMPY): pointwise and
shift gemms, depthwise as shifted multiply-adds or the compiled kernel, Winograd F(2x2) and
F(4x4) in 2-d and 3-d, and the sub-pixel transposed conv."""
from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Callable

import numpy as np
from numpy.lib.stride_tricks import as_strided

from ...spec import ConvKey, prod
from ...unfold import NumpyLike, windows

#: numpy as the array namespace of convkernels/unfold.py
NUMPY = NumpyLike(np)


#: accumulator tile of conv_shift_gemm (bytes): about one core's L2
SHIFT_TILE_BYTES = 2 << 20
#: transformed-input tile of the compiled Winograd path (bytes): below glibc's 32 MiB mmap
#: threshold, so the buffers are reused heap memory rather than fresh pages each call
WINOGRAD_TILE_BYTES = 16 << 20
#: the 3-D Winograd path keeps every frame of one row of tiles side by side; a call whose single
#: row exceeds this (a long clip in one conv3d) takes the per-tap paths instead
WINOGRAD_3D_ROW_MAX_BYTES = 64 << 20
#: unfold tile of conv_transpose_subpixel (bytes): the gemm's result tile, copied into place,
#: stays cache-resident
SUBPIXEL_TILE_BYTES = 8 << 20

def pad_spatial(x: np.ndarray, pads) -> np.ndarray:
    if not any(lo or hi for lo, hi in pads):
        return x
    return np.pad(x, ((0, 0), *pads, (0, 0)))


def _rows_per_tile(bytes_per_row: int, limit: int, total: int) -> int:
    return max(1, min(total, limit // max(1, bytes_per_row)))


def conv_pointwise(x: np.ndarray, w: np.ndarray, key: ConvKey, matmul=np.matmul) -> np.ndarray:
    """1x1, stride 1, unpadded, ungrouped: the input already is the patch matrix. `matmul(a, wt)`:
    the product another way (the compiled tiles)."""
    c = x.shape[-1]
    out = matmul(np.ascontiguousarray(x).reshape(-1, c), w.reshape(w.shape[0], c).T)
    return out.reshape(key.out_shape)


def conv_depthwise_shift(x: np.ndarray, w: np.ndarray, key: ConvKey) -> np.ndarray:
    """Depthwise conv as prod(kernel) shifted multiply-adds over strided views."""
    spec = key.spec
    xp = pad_spatial(x, spec.padding)
    out_shape = key.out_shape
    out_sp = out_shape[1:-1]
    acc = np.zeros(out_shape, dtype=x.dtype)
    tmp = np.empty(out_shape, dtype=x.dtype)
    wk = w.reshape(w.shape[0], -1).T  # (taps, C)
    for t, offs in enumerate(itertools.product(*(range(k) for k in key.kernel))):
        sl = tuple(slice(o * d, o * d + (n - 1) * s + 1, s)
                   for o, d, n, s in zip(offs, spec.dilation, out_sp, spec.stride))
        np.multiply(xp[(slice(None), *sl)], wk[t], out=tmp)
        acc += tmp
    return acc


def conv_depthwise_direct(x: np.ndarray, w: np.ndarray, key: ConvKey, bias: np.ndarray | None) -> np.ndarray:
    """2-D depthwise conv through the compiled kernel: padding handled by tap ranges (no padded
    copy of the input), bias folded into the accumulator init."""
    from ..._cpu import _kernels

    spec = key.spec
    x = np.ascontiguousarray(x, dtype=np.float32)
    c = x.shape[-1]
    taps = np.ascontiguousarray(w.reshape(c, -1).T, dtype=np.float32)  # (kh*kw, C)
    b = np.ascontiguousarray(bias, dtype=np.float32) if bias is not None else np.zeros(1, np.float32)
    out = np.empty(key.out_shape, dtype=np.float32)
    (kh, kw), (sh, sw), (dh, dw) = key.kernel, spec.stride, spec.dilation
    (ph, _), (pw, _) = spec.padding
    _kernels.depthwise2d(x, taps, b, out, bias is not None, x.shape[0], x.shape[1], x.shape[2], c,
                         kh, kw, sh, sw, dh, dw, ph, pw, out.shape[1], out.shape[2])
    return out


def conv_shift_gemm(x: np.ndarray, w: np.ndarray, key: ConvKey, limit_bytes: int) -> np.ndarray:
    """Stride-1 dense conv with no unfold buffer: on the padded input flattened over its spatial
    axes, each kernel tap is a constant offset, so tap t contributes x_flat[off_t : off_t + L] @ W_t
    (a contiguous view, no copy). Rows past the valid width are computed and dropped. Tiled over
    output rows of the first axis so the per-tap product stays under `limit_bytes`."""
    spec = key.spec
    pads = list(spec.padding)
    lo0, hi0 = pads[0]
    pads[0] = (lo0, hi0 + 1)  # one spare row: the last tap's slice runs past the final valid row
    xp = pad_spatial(x, pads)
    n, c = x.shape[0], x.shape[-1]
    sp = xp.shape[1:-1]
    inner = prod(sp[1:])  # flat length of one row of the first axis
    strides_flat = [prod(sp[a + 1:]) for a in range(len(sp))]
    out_shape = key.out_shape
    out_sp = out_shape[1:-1]
    o = key.out_channels
    taps = list(itertools.product(*(range(k) for k in key.kernel)))
    offsets = [sum(t * d * s for t, d, s in zip(tap, spec.dilation, strides_flat)) for tap in taps]
    wt = [np.ascontiguousarray(w[(slice(None), *tap, slice(None))].T) for tap in taps]  # (C, O) each
    xf = xp.reshape(n, -1, c)
    # the accumulator tile stays cache-sized: each tap's product is added to it, and a tile that
    # spills to DRAM pays the accumulation traffic 9 times (3x3 128ch 256x256 on 2 EPYC cores:
    # 130-136 ms with 1-2 MiB tiles, 166+ ms with 64 MiB ones)
    rows = _rows_per_tile(inner * o * x.dtype.itemsize, min(limit_bytes, SHIFT_TILE_BYTES), out_sp[0])
    out = np.empty(out_shape, dtype=x.dtype)
    acc = np.empty((rows * inner, o), dtype=x.dtype)
    tmp = np.empty_like(acc)
    valid = tuple(slice(0, v) for v in out_sp[1:])
    for b in range(n):
        for r0 in range(0, out_sp[0], rows):
            r1 = min(r0 + rows, out_sp[0])
            m = (r1 - r0) * inner
            a, t = acc[:m], tmp[:m]
            base = r0 * inner
            for i, (off, wm) in enumerate(zip(offsets, wt)):
                src = xf[b, base + off:base + off + m]
                if i == 0:
                    np.matmul(src, wm, out=a)
                else:
                    np.matmul(src, wm, out=t)
                    a += t
            out[b, r0:r1] = a.reshape(r1 - r0, *sp[1:], o)[(slice(None), *valid)]
    return out


#: the output phases (a, b) of an `is_subpixel_upsample` conv (spec.py says which taps each reads)
SUBPIXEL_PHASES = tuple(itertools.product((0, 1), (0, 1)))


def subpixel_weights(w: np.ndarray) -> np.ndarray:
    """(O, 4, 4, C) -> (4 phases, 4 taps * C, O): phase (a, b)'s 2x2 kernel, rows ordered
    (ty, tx, c) as a 2x2 window of the input unfolds."""
    o, c = w.shape[0], w.shape[-1]
    mats = [w[:, [3 - a, 1 - a]][:, :, [3 - b, 1 - b]].reshape(o, 4 * c).T for a, b in SUBPIXEL_PHASES]
    return np.ascontiguousarray(np.stack(mats))


def conv_transpose_subpixel(x: np.ndarray, w: np.ndarray, key: ConvKey, limit_bytes: int,
                            wp: np.ndarray | None = None) -> np.ndarray:
    """An `is_subpixel_upsample` transposed conv as its four 2x2 phase convs over one padded copy
    of the input, each phase written straight into its interleaved positions of the output (rows 2i + a,
    columns 2j + b): no zero-stuffing, no col2im scatter-adds, no concatenation. Per phase and
    tile of rows: unfold the 2x2 windows, one gemm with a 4C-deep reduction, copy the cache-sized
    result into place. `wp`: subpixel_weights(w) when the caller caches them."""
    n, h, wd, c = x.shape
    o = key.out_channels
    if wp is None:
        wp = subpixel_weights(w)
    xp = np.pad(x, ((0, 0), (1, 1), (1, 1), (0, 0)))
    out = np.empty((n, h, 2, wd, 2, o), dtype=x.dtype)
    rows = _rows_per_tile(wd * 4 * c * x.dtype.itemsize, min(limit_bytes, SUBPIXEL_TILE_BYTES), h)
    cols = np.empty((rows * wd, 4 * c), dtype=x.dtype)
    res = np.empty((rows * wd, o), dtype=x.dtype)
    for p, (a, b) in enumerate(SUBPIXEL_PHASES):
        win = windows(NUMPY, xp[:, a:a + h + 1, b:b + wd + 1], (h, wd), (2, 2), (1, 1), (1, 1))
        for i in range(n):
            for r0 in range(0, h, rows):
                r1 = min(r0 + rows, h)
                m = (r1 - r0) * wd
                cols[:m].reshape(r1 - r0, wd, 2, 2, c)[...] = win[i, r0:r1]
                np.matmul(cols[:m], wp[p], out=res[:m])
                out[i, r0:r1, a, :, b] = res[:m].reshape(r1 - r0, wd, o)
    return out.reshape(key.out_shape)


def winograd_weights(w: np.ndarray) -> np.ndarray:
    return _winograd_weights(w)


def _winograd_weights(w: np.ndarray) -> np.ndarray:
    """U = G g G^T for every (out, in) pair: (O,3,3,C) -> (16, C, O), ready for batched gemm."""
    g0, g1, g2 = w[:, 0], w[:, 1], w[:, 2]  # rows of the 3x3 kernel: (O, 3, C)
    rows = np.stack([g0, 0.5 * (g0 + g1 + g2), 0.5 * (g0 - g1 + g2), g2], axis=1)  # (O, 4, 3, C)
    c0, c1, c2 = rows[:, :, 0], rows[:, :, 1], rows[:, :, 2]
    u = np.stack([c0, 0.5 * (c0 + c1 + c2), 0.5 * (c0 - c1 + c2), c2], axis=2)  # (O, 4, 4, C)
    return np.ascontiguousarray(u.reshape(w.shape[0], 16, w.shape[-1]).transpose(1, 2, 0))


#: F(4x4, 3x3) matrices (points 0, +-1, +-2): V = B^T d B, U = G g G^T, Y = A^T M A
_G4 = np.array([[1 / 4, 0, 0], [-1 / 6, -1 / 6, -1 / 6], [-1 / 6, 1 / 6, -1 / 6],
                [1 / 24, 1 / 12, 1 / 6], [1 / 24, -1 / 12, 1 / 6], [0, 0, 1]], np.float64)


def winograd4_weights(w: np.ndarray) -> np.ndarray:
    """U = G g G^T for F(4x4, 3x3), in float64 then rounded once: (O,3,3,C) -> (36, C, O).
    As two (6x3) matmuls over the flattened weights rather than one einsum: the einsum's
    transposed temporaries took 0.2-0.5 s per 512->512 conv, paid by every first call."""
    o, c = w.shape[0], w.shape[-1]
    # transposed while still float32 (the smallest copy), then widened
    g = np.ascontiguousarray(w.transpose(2, 1, 3, 0)).astype(np.float64).reshape(3, 3 * c * o)  # (h, k c o)
    t = (_G4 @ g).reshape(6, 3, c * o)  # (b, k, c o): G applied along the kernel's columns
    u = _G4 @ t.transpose(1, 0, 2).reshape(3, 6 * c * o)  # (a, b c o): and along its rows
    return u.astype(np.float32).reshape(36, c, o)


@dataclass(frozen=True)
class WinogradTile:
    """One Winograd F(m x m, 3x3) variant of the compiled paths: its output tile side, its number
    of transformed planes ((m + 2)^2), its weight transform and its C tile transforms."""

    m: int
    planes: int
    weights: Callable[[np.ndarray], np.ndarray]  # (O, 3, 3, C) -> (planes, C, O)
    input_kernel: str
    output_kernel: str
    g: np.ndarray = field(compare=False)  # G, (m + 2, 3) float64: U = G g G^T, the C extension's form of `weights`

    def tiles(self, size: int) -> int:
        return (size + self.m - 1) // self.m


#: F(2x2, 3x3): 4 multiplies per output, rounding like a direct conv (fp32 rel L2 ~3e-7)
F2X3 = WinogradTile(2, 16, _winograd_weights, "winograd_input", "winograd_output",
                    np.array([[1, 0, 0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0, 0, 1]], np.float64))
#: F(4x4, 3x3): 2.25 multiplies per output and 44% less transformed data per output, at ~7x
#: F(2x2)'s rounding error (fp32 rel L2 1e-6..3e-6 up to 512 channels)
F4X3 = WinogradTile(4, 36, winograd4_weights, "winograd4_input", "winograd4_output", _G4)


def conv_winograd_compiled(x: np.ndarray, w: np.ndarray, key: ConvKey, limit_bytes: int,
                           u: np.ndarray | None = None, tile: WinogradTile = F2X3, planes_matmul=None) -> np.ndarray:
    """3x3 stride-1 conv2d by Winograd with the tile transforms in the C extension and the
    `tile.planes` gemms in BLAS. `u`: the transformed weights (planes, C, O) when the caller
    caches them; `planes_matmul(v, out)`: out[i] = v[i] @ u[i] another way (compiled tiles)."""
    from ..._cpu import _kernels

    x = np.ascontiguousarray(x, dtype=np.float32)
    n, h, wd, c = x.shape
    ho, wo, o = key.out_shape[1], key.out_shape[2], key.out_channels
    th, tw, q = tile.tiles(ho), tile.tiles(wo), tile.planes
    (pt, _), (pl, _) = key.spec.padding
    if u is None and planes_matmul is None:
        u = tile.weights(w.astype(np.float32, copy=False))
    transform_in, transform_out = getattr(_kernels, tile.input_kernel), getattr(_kernels, tile.output_kernel)
    zeros = np.zeros(c, np.float32)
    out = np.empty((n, ho, wo, o), dtype=np.float32)
    # 16 MiB transform tiles: at 3x3 512ch 64x64 on 2 cores, 78 ms steady in a loop; 64 MiB tiles
    # (fresh mmap'd pages every call) ranged 77-113 ms
    rows = _rows_per_tile(q * tw * max(c, o) * 4, min(limit_bytes, WINOGRAD_TILE_BYTES), th)
    v = np.empty(q * rows * tw * c, np.float32)
    m = np.empty(q * rows * tw * o, np.float32)
    for b in range(n):
        for r0 in range(0, th, rows):
            r1 = min(r0 + rows, th)
            p = (r1 - r0) * tw
            vb = v[:q * p * c].reshape(q, p, c)
            transform_in(x[b], vb, zeros, h, wd, c, tw, pt, pl, r0, r1)
            mb = m[:q * p * o].reshape(q, p, o)
            if planes_matmul is None:
                np.matmul(vb, u, out=mb)
            else:
                planes_matmul(vb, mb)
            transform_out(mb, out[b], ho, wo, o, tw, r0, r1)
    return out


def winograd_weights_3d(w: np.ndarray, tile: WinogradTile = F2X3) -> np.ndarray:
    """(O, KT, 3, 3, C) -> (planes, KT*C, O): each time tap's U stacked along the reduction axis,
    in the order conv_winograd_3d lays out its KT consecutive input frames."""
    u = np.stack([tile.weights(w[:, t]) for t in range(w.shape[1])], axis=1)  # (planes, KT, C, O)
    return np.ascontiguousarray(u.reshape(tile.planes, -1, w.shape[0]), dtype=np.float32)


def winograd_3d_row_bytes(key: ConvKey, tile: WinogradTile = F2X3) -> int:
    """Bytes of the transformed input of one row of output tiles, all (padded) frames."""
    (tlo, thi) = key.spec.padding[0]
    frames = key.x_shape[1] + tlo + thi
    return tile.planes * tile.tiles(key.out_shape[3]) * frames * key.in_channels * 4


def conv_winograd_3d(x: np.ndarray, w: np.ndarray, key: ConvKey, limit_bytes: int,
                     u: np.ndarray | None = None, tile: WinogradTile = F2X3, planes_matmul=None) -> np.ndarray:
    """(KT, 3, 3) stride-1 conv3d: Winograd in space, direct in time. Each input frame is
    transformed once (not once per time tap), into V laid out (planes, tiles, frames, C) so the KT
    frames an output frame reads are one (tiles, KT*C) matrix per plane: a single batched gemm
    with a KT-times deeper reduction than per-tap gemms, no accumulation passes. Zero time padding
    is zero V. Tiled over rows of output tiles so V stays under `limit_bytes`. `planes_matmul(vb,
    out, (first, count))`: the per-plane products another way (compiled tiles, reading vb in place)."""
    from ..._cpu import _kernels

    x = np.ascontiguousarray(x, dtype=np.float32)
    n, t_in, h, wd, c = x.shape
    kt = key.kernel[0]
    t_out, ho, wo, o = key.out_shape[1:]
    (tlo, thi), (pt, _), (pl, _) = key.spec.padding
    frames = t_in + tlo + thi
    th, tw, q = tile.tiles(ho), tile.tiles(wo), tile.planes
    if u is None and planes_matmul is None:
        u = winograd_weights_3d(w, tile)
    transform_in, transform_out = getattr(_kernels, tile.input_kernel), getattr(_kernels, tile.output_kernel)
    zeros = np.zeros(c, np.float32)
    out = np.empty((n, t_out, ho, wo, o), dtype=np.float32)
    rows = _rows_per_tile(q * tw * frames * c * 4, min(limit_bytes, WINOGRAD_TILE_BYTES), th)
    v = np.empty(q * rows * tw * frames * c, np.float32)
    m = np.empty(q * rows * tw * o, np.float32)
    for b in range(n):
        for r0 in range(0, th, rows):
            r1 = min(r0 + rows, th)
            p = (r1 - r0) * tw
            vb = v[:q * p * frames * c].reshape(q, p, frames, c)
            if tlo:
                vb[:, :, :tlo] = 0
            if thi:
                vb[:, :, frames - thi:] = 0
            flat = v[:q * p * frames * c]
            for t in range(t_in):
                transform_in(x[b, t], flat[(tlo + t) * c:], zeros, h, wd, c, tw, pt, pl, r0, r1,
                             frames * c, p * frames * c)
            mb = m[:q * p * o].reshape(q, p, o)
            for t in range(t_out):
                if planes_matmul is None:
                    np.matmul(vb[:, :, t:t + kt].reshape(q, p, kt * c), u, out=mb)
                else:
                    planes_matmul(vb, mb, (t, kt))
                transform_out(mb, out[b, t], ho, wo, o, tw, r0, r1)
    return out


def conv_winograd_f2x3(x: np.ndarray, w: np.ndarray, key: ConvKey, limit_bytes: int) -> np.ndarray:
    """3x3 stride-1 conv by Winograd F(2x2, 3x3): 2.25x fewer multiplies than direct, spent in 16
    batched gemms; the transforms are a few adds over the tiles. Tiled over rows of output tiles
    so the transformed buffers stay under `limit_bytes`."""
    n, c = x.shape[0], x.shape[-1]
    out_shape = key.out_shape
    ho, wo, o = out_shape[1], out_shape[2], key.out_channels
    th, tw = (ho + 1) // 2, (wo + 1) // 2
    (plo, phi), (qlo, qhi) = key.spec.padding
    # pad so the tile grid (2 outputs per tile, 4 inputs) fits exactly
    xp = np.pad(x, ((0, 0), (plo, 2 * th + 2 - x.shape[1] - plo), (qlo, 2 * tw + 2 - x.shape[2] - qlo), (0, 0)))
    u = _winograd_weights(w.astype(x.dtype, copy=False))
    out = np.empty((n, 2 * th, 2 * tw, o), dtype=x.dtype)
    st = xp.strides
    tiles = as_strided(xp, (n, th, tw, 4, 4, c), (st[0], 2 * st[1], 2 * st[2], st[1], st[2], st[3]), writeable=False)
    rows = _rows_per_tile(16 * tw * max(c, o) * x.dtype.itemsize, limit_bytes, th)
    for b in range(n):
        for r0 in range(0, th, rows):
            r1 = min(r0 + rows, th)
            d = tiles[b, r0:r1]  # (tr, tw, 4, 4, C)
            p = (r1 - r0) * tw
            # B^T d: along the tile's row axis
            t = np.empty((4, r1 - r0, tw, 4, c), dtype=x.dtype)
            np.subtract(d[:, :, 0], d[:, :, 2], out=t[0])
            np.add(d[:, :, 1], d[:, :, 2], out=t[1])
            np.subtract(d[:, :, 2], d[:, :, 1], out=t[2])
            np.subtract(d[:, :, 1], d[:, :, 3], out=t[3])
            # (B^T d) B: along the column axis, written as 16 (P, C) matrices
            v = np.empty((4, 4, r1 - r0, tw, c), dtype=x.dtype)
            np.subtract(t[:, :, :, 0], t[:, :, :, 2], out=v[:, 0])
            np.add(t[:, :, :, 1], t[:, :, :, 2], out=v[:, 1])
            np.subtract(t[:, :, :, 2], t[:, :, :, 1], out=v[:, 2])
            np.subtract(t[:, :, :, 1], t[:, :, :, 3], out=v[:, 3])
            m = np.matmul(v.reshape(16, p, c), u).reshape(4, 4, p, o)
            # A^T m A
            y_rows = np.empty((2, 4, p, o), dtype=x.dtype)
            np.add(m[0], m[1], out=y_rows[0])
            y_rows[0] += m[2]
            np.subtract(m[1], m[2], out=y_rows[1])
            y_rows[1] -= m[3]
            y = np.empty((2, 2, p, o), dtype=x.dtype)
            np.add(y_rows[:, 0], y_rows[:, 1], out=y[:, 0])
            y[:, 0] += y_rows[:, 2]
            np.subtract(y_rows[:, 1], y_rows[:, 2], out=y[:, 1])
            y[:, 1] -= y_rows[:, 3]
            out[b, 2 * r0:2 * r1] = y.reshape(2, 2, r1 - r0, tw, o).transpose(2, 0, 3, 1, 4).reshape(
                2 * (r1 - r0), 2 * tw, o)
    return out[:, :ho, :wo]
