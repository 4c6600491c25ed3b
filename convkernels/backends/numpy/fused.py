"""Fused ops of the NumPy backend on the compiled kernels (convkernels/_cpu): a linear whose bias,
activation and residual are applied to each tile of the product while it is still in registers
(gemm.c, weights packed once; where the CPU has no compiled tiles, one pass over each block of
NumPy's matmul output while it is in cache), and the depthwise conv + LayerNorm of ConvNeXt's
block in one pass. Each returns
None where it does not apply (no compiler, another dtype, a layout the kernel does not take);
the backend then runs the unfused ops."""
from __future__ import annotations

import math

import numpy as np

from ... import _cpu

#: activation codes of the compiled epilogue and group_norm
ACT_CODES = {None: 0, "silu": 1, "gelu": 2}
#: gemm output rows per block (bytes), each followed by its epilogue while still in cache. Smaller
#: blocks lost on ConvNeXt-T (2-core Xeon, 2026-11-28: 256 KiB 126-135 ms, 1 MiB 98 ms, one block
#: 89-99 ms per encode): OpenBLAS wakes its threads per call and runs short gemms less well
#: than the epilogue saves, so one block per call up to this size
ROW_BLOCK_BYTES = 64 << 20
#: mlp runs in row blocks where the hidden activations would take this much or more: ConvNeXt-T's
#: stage-1 MLP at batch 8 (25,088 x 384 floats, 38.5 MB) wrote them far past the cores' 2 MiB L2s and
#: past glibc's 32 MiB mmap ceiling (faulted in on every call): its two products took 0.66-0.77 of their time
#: run in blocks; at 19 MB (stage 2) 0.94, and below that the calls' overhead lost (2-core Xeon,
#: 2026-11-29, benchmarks/HISTORY.md "ConvNeXt-T's products on two CPU cores")
MLP_BLOCKS_MIN_BYTES = 24 << 20
#: hidden activations per block (2,730 rows of 384): blocks of 384 rows lost to the calls' overhead
MLP_BLOCK_BYTES = 4 << 20
#: kernel widths the fused depthwise + LayerNorm has specialised rows for
DW_LN_WIDTHS = (3, 5, 7)


def _f32(a) -> bool:
    return isinstance(a, np.ndarray) and a.dtype == np.float32 and a.flags.c_contiguous


def _vector(p, c: int) -> bool:
    return p is None or (_f32(p) and p.shape == (c,))


def panel_width() -> int:
    """Columns of gemm.c's packed panels on this CPU; 0 where it has no compiled tiles."""
    return int(_cpu._kernels.gemm_panel_width()) if _cpu.AVAILABLE else 0


def aligned_empty(shape) -> np.ndarray:
    """A float32 array starting on a 64-byte cache line. NumPy starts large arrays 16 bytes past
    one, and a 64-byte vector load that straddles two lines costs two: the tiles ran 7-10 % slower
    on such panels (2-core Xeon, 2026-11-29)."""
    size = math.prod(shape) if isinstance(shape, tuple) else shape
    buf = np.empty(size + 16, np.float32)
    start = (-buf.ctypes.data % 64) >> 2
    return buf[start:start + size].reshape(shape)


def pack_panels(weight: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """A linear's (O, I) weight as gemm.c's panels (the backend caches it per weight buffer)."""
    nr = panel_width()
    n, k = weight.shape
    out = aligned_empty(-(-n // nr) * k * nr) if out is None else out
    _cpu._kernels.pack_weight(np.ascontiguousarray(weight, np.float32), out, n, k, nr)
    return out


def linear(x2: np.ndarray, weight: np.ndarray, bias, residual, activation: str | None, packed=None, out=None):
    """act(x2 @ weight.T + bias) + residual for x2 (rows, I), residual (..., O) holding rows x O
    or None; None where the compiled kernels do not apply. `packed`: a callable giving the
    weight's panels (pack_panels, cached), used where this CPU has compiled tiles. `out`: a
    C-contiguous float32 (rows, O) to write (the compiled tiles only), else a new array."""
    if not _cpu.AVAILABLE or activation not in ACT_CODES or not _f32(x2) or weight.dtype != np.float32:
        return None
    rows, o = x2.shape[0], weight.shape[0]
    if residual is not None:  # the output's own shape only (a broadcast residual takes the unfused add)
        if not _f32(residual) or residual.size != rows * o or residual.shape[-1] != o:
            return None
        residual = residual.reshape(rows, o)
    if not _vector(bias, o):
        return None
    if weight.ndim != 2 or x2.shape[1] != weight.shape[1]:
        return None
    none = np.zeros(1, np.float32)
    nr = panel_width() if packed is not None else 0
    if out is not None and not (nr and rows):
        return None  # `out` is for the compiled tiles; the caller runs its other way
    if nr and rows:
        out = aligned_empty((rows, o)) if out is None else out
        _cpu._kernels.gemm(x2, packed(weight), none if bias is None else bias, none if residual is None else residual,
                           out, rows, x2.shape[1], o, nr, bias is not None, residual is not None, ACT_CODES[activation])
        return out
    if bias is None and residual is None and activation is None:
        return x2 @ weight.T
    out = np.empty((rows, o), np.float32)
    wt = weight.T
    step = max(1, ROW_BLOCK_BYTES // (4 * o))
    kernels, act = _cpu._kernels, ACT_CODES[activation]
    for r0 in range(0, rows, step):
        blk = out[r0:r0 + step]
        np.matmul(x2[r0:r0 + step], wt, out=blk)
        kernels.epilogue(blk, none if bias is None else bias, none if residual is None else residual[r0:r0 + step],
                         blk, bias is not None, residual is not None, blk.shape[0], o, act)
    return out


def mlp_applies(rows: int, hidden: int) -> bool:
    """Whether mlp's row blocks pay: only where the hidden activations would not stay in cache."""
    return bool(panel_width()) and rows * hidden * 4 >= MLP_BLOCKS_MIN_BYTES


def mlp(x2: np.ndarray, w1: np.ndarray, b1, w2: np.ndarray, b2, activation: str | None, residual: np.ndarray,
        packed, product=None) -> np.ndarray | None:
    """linear(act(linear(x2, w1, b1)), w2, b2) + residual, over blocks of rows whose hidden
    activations stay in cache; None where the compiled tiles do not apply. Each row's sums run
    in the same order as in the two whole products: the result is the same to the bit. product:
    `linear`'s twin that runs each product (bf16.linear, on the panels `packed` gives), else linear."""
    product = product or linear
    rows, hidden = x2.shape[0], w1.shape[0]
    if not mlp_applies(rows, hidden) or w2.ndim != 2 or w2.shape[1] != hidden or residual.size != rows * w2.shape[0]:
        return None
    block = max(1, MLP_BLOCK_BYTES // (4 * hidden))
    scratch = aligned_empty((min(block, rows), hidden))
    out = aligned_empty((rows, w2.shape[0]))
    res = residual.reshape(rows, w2.shape[0])
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        h = product(x2[r0:r1], w1, b1, None, activation, packed, out=scratch[:r1 - r0])
        if h is None or product(h, w2, b2, res[r0:r1], None, packed, out=out[r0:r1]) is None:
            return None
    return out


def pack_planes(u: np.ndarray) -> np.ndarray:
    """Winograd's transformed weights (planes, C, O) as gemm.c's panels, one row per plane (each
    row a whole number of cache lines: a panel's size is a multiple of 16 floats)"""
    q, c, o = u.shape
    nr = panel_width()
    out = aligned_empty((q, -(-o // nr) * c * nr))
    for plane, row in zip(u, out):
        pack_panels(np.ascontiguousarray(plane.T), row)
    return out


def winograd_panels(w: np.ndarray, g: np.ndarray) -> np.ndarray:
    """Winograd's transformed weights U = G w G^T of a (O, 3, 3, C) or (O, KT, 3, 3, C) weight, as
    pack_planes(U) lays them out, in one compiled pass (U is never formed whole: the NumPy transform
    and packing were most of a first call)"""
    o, c = w.shape[0], w.shape[-1]
    kt = w.shape[1] if w.ndim == 5 else 1
    p, nr = g.shape[0], panel_width()
    out = aligned_empty((p * p, -(-o // nr) * kt * c * nr))
    w5 = w.reshape(o, kt, 3, 3, c)
    # (KT, 3, 3, C, O): a panel's columns are then contiguous runs for the C pass (5 ms at 512 x 512)
    wt = np.ascontiguousarray(np.moveaxis(w5, 0, -1), np.float32)
    _cpu._kernels.winograd_pack(wt, np.ascontiguousarray(g, np.float64), out, o, kt, c, p, nr)
    return out


def planes_matmul(v: np.ndarray, packed_u: np.ndarray, out: np.ndarray, frames: tuple[int, int] | None = None) -> None:
    """out[i] = v[i] @ u[i] for Winograd's planes (v (planes, P, C), out (planes, P, O)), on gemm.c's
    tiles, all planes in one call: one fork and join for the 16 or 36 products, not one each (SD-VAE
    256: 3392 calls of ~0.5 ms each, whose joins kept a second core from paying). `frames` (first,
    count): v is (planes, P, F, C) and each row reads `count` frames from `first` (the 3-D
    Winograd's time taps), in place: the rows are F * C floats apart."""
    q, p = v.shape[:2]
    o, nr, none = out.shape[2], panel_width(), np.zeros(1, np.float32)
    if not (v.flags.c_contiguous and out.flags.c_contiguous):
        raise ValueError("planes_matmul: v and out must be contiguous")
    if frames is None:
        c = v.shape[2]
        _cpu._kernels.gemm(v, packed_u, none, none, out, p, c, o, nr, False, False, 0, 0, c, q, p * c,
                           packed_u.shape[1])
        return
    (first, count), (f, c) = frames, v.shape[2:]
    _cpu._kernels.gemm(v, packed_u, none, none, out, p, count * c, o, nr, False, False, 0, first * c, f * c, q,
                       p * f * c, packed_u.shape[1])


def matmul(a: np.ndarray, wt: np.ndarray, packed) -> np.ndarray:
    """a @ wt, wt a weight's transposed view (an unfolded conv's product: ConvNeXt's stem and
    downsamplers), on gemm.c's tiles where they apply, else NumPy's matmul"""
    out = linear(a, wt.T, None, None, None, packed) if a.ndim == 2 else None
    return a @ wt if out is None else out


def epilogue_in_place(out: np.ndarray, bias, residual, activation: str | None) -> bool:
    """out = act(out + bias) + residual in one compiled pass (a conv's epilogue: SD-VAE's decode
    spent 0.3 s of 3.4 in NumPy's separate passes); False where it does not apply."""
    if not _cpu.AVAILABLE or activation not in ACT_CODES or not _f32(out) or not out.flags.writeable or out.size == 0:
        return False
    c = out.shape[-1]
    if not _vector(bias, c) or (residual is not None and (not _f32(residual) or residual.shape != out.shape)):
        return False
    none = np.zeros(1, np.float32)
    _cpu._kernels.epilogue(out, none if bias is None else bias, none if residual is None else residual, out,
                           bias is not None, residual is not None, out.size // c, c, ACT_CODES[activation])
    return True


def depthwise_taps(w: np.ndarray) -> np.ndarray:
    """(C, kh, kw, 1) depthwise weights as the kernels' (kh * kw, C) taps"""
    return np.ascontiguousarray(w.reshape(w.shape[0], -1).T, dtype=np.float32)


def depthwise_layer_norm_applies(x, w, bias, norm_w, norm_b) -> bool:
    if not _cpu.AVAILABLE or not _f32(x) or x.ndim != 4 or not isinstance(w, np.ndarray) or w.ndim != 4:
        return False
    c = x.shape[-1]
    kh, kw = w.shape[1], w.shape[2]
    return (w.dtype == np.float32 and tuple(w.shape) == (c, kh, kw, 1) and kh % 2 == 1 and kw in DW_LN_WIDTHS
            and all(_vector(p, c) for p in (bias, norm_w, norm_b)))


def depthwise_layer_norm(x: np.ndarray, taps: np.ndarray, kernel: tuple[int, int], bias, norm_w, norm_b,
                         eps: float) -> np.ndarray:
    """LayerNorm(depthwise 'same' conv(x) + bias), checked by depthwise_layer_norm_applies"""
    n, h, w, c = x.shape
    out = np.empty_like(x)
    none = np.zeros(1, np.float32)
    _cpu._kernels.depthwise_layer_norm(
        x, taps, none if bias is None else bias, none if norm_w is None else norm_w,
        none if norm_b is None else norm_b, out, bias is not None, norm_w is not None, norm_b is not None,
        n, h, w, c, kernel[0], kernel[1], eps)
    return out



def depthwise_ln_mlp_applies(x: np.ndarray, blocks, activation: str | None) -> bool:
    """Whether depthwise_ln_mlp takes these blocks, each (w, bias, norm_w, norm_b, w1, b1, w2, b2):
    every block's conv + norm as depthwise_layer_norm_applies, compiled tiles, float32 weights and
    both biases, one shape and one set of parameters present for all blocks (one call runs them
    all), and sizes whose hidden activations stay in cache (larger ones take mlp's blocks of rows)."""
    if not blocks or not panel_width() or activation not in ACT_CODES:
        return False
    c, first = x.shape[-1], blocks[0]
    rows, hidden = x.size // c, getattr(first[4], "shape", (0,))[0]
    if mlp_applies(rows, hidden):
        return False
    kernel, present = first[0].shape, tuple(p is None for p in first[1:4])
    for w, bias, norm_w, norm_b, w1, b1, w2, b2 in blocks:
        if not (depthwise_layer_norm_applies(x, w, bias, norm_w, norm_b) and w.shape == kernel
                and (bias is None, norm_w is None, norm_b is None) == present
                and all(_f32(a) for a in (w1, w2, b1, b2)) and w1.shape == (hidden, c) and w2.shape == (c, hidden)
                and b1.shape == (hidden,) and b2.shape == (c,)):
            return False
    return True


def depthwise_ln_mlp(x: np.ndarray, blocks, eps: float, activation: str | None, taps_of, packed,
                     bf16: bool = False) -> np.ndarray:
    """ConvNeXt's block bodies one after another, x = x + linear(act(linear(LayerNorm(dw conv(x)),
    w1, b1)), w2, b2) for each block, in one compiled call (gemm.c depthwise_ln_mlp): the result of
    depthwise_layer_norm and two `linear`s a block to the bit, without the Python between them
    (checked by depthwise_ln_mlp_applies). taps_of and packed give a weight's transformed form; bf16:
    packed gives bfloat16 panels (bf16.pack_panels), and the products are gemm_bf16's."""
    n, h, w, c = x.shape
    kh, kw = blocks[0][0].shape[1:3]
    rows, hidden = n * h * w, blocks[0][4].shape[0]
    out = aligned_empty((n, h, w, c))
    spare = aligned_empty((n, h, w, c)) if len(blocks) > 1 else out[:0]
    t, hid = aligned_empty((rows, c)), aligned_empty((rows, hidden))
    none = np.zeros(1, np.float32)
    prepared = [(taps_of(dw), none if bias is None else bias, none if norm_w is None else norm_w,
                 none if norm_b is None else norm_b, packed(w1), b1, packed(w2), b2)
                for dw, bias, norm_w, norm_b, w1, b1, w2, b2 in blocks]
    _, bias, norm_w, norm_b = blocks[0][:4]
    _cpu._kernels.depthwise_ln_mlp(
        x, out, spare, t, hid, prepared, bias is not None, norm_w is not None, norm_b is not None,
        n, h, w, c, kh, kw, hidden, eps, ACT_CODES[activation], panel_width(), bf16)
    return out
