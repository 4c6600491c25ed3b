"""The CUDA backend's non-conv kernels (CuPy RawModule, compiled once per storage dtype):
conv epilogue (bias, activation, residual), activations, GroupNorm (+activation) in two
passes, channels-last LayerNorm and RMS norm (+activation), row softmax, ReLU linear attention's
two passes, float32 casts, and 8-bit pixels for the host.

The CUDA C is in src/*.cu (package data, read through importlib.resources), joined in the
order of CU_FILES into one source: common.cu first (storage types, activations, reductions,
vector loads), then the kernels. Storage types: float32 is `float`; float16 and bfloat16 are
both `unsigned short` bit patterns converted to float in registers (bfloat16 has no CuPy dtype,
so bf16 arrays live as uint16; this also keeps the kernels free of cuda_fp16.h / cuda_bf16.h
includes, which NVRTC may not find). All arithmetic is float32; GroupNorm statistics are
combined in float64.

Launch sizes that depend on the GPU (grid-stride loops, GroupNorm chunks) are computed from the
device's multiprocessor count, read once per device.
"""
from __future__ import annotations

import threading
from importlib import resources

import numpy as np

ACT_CODES = {None: 0, "silu": 1, "gelu": 2, "gelu_tanh": 3, "relu": 4}
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}
#: each dtype's storage: bfloat16 as its uint16 bit patterns
STORAGE = {"bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}
BLOCK = 256
DW_TW = 4  # output columns per thread of dw2d_vec (the kernel's DW_TW)

CU_FILES = ("common.cu", "elementwise.cu", "norms.cu", "depthwise.cu", "softmax.cu", "shuffle.cu",
            "linear_attention.cu")


def load_source() -> str:
    """The kernels' CUDA C: src/*.cu in CU_FILES order (later files use earlier ones)."""
    folder = resources.files(__package__).joinpath("src")
    return "\n".join(folder.joinpath(name).read_text(encoding="utf-8") for name in CU_FILES)


SOURCE = load_source()

#: blocks per SM a grid-stride launch is capped at: enough resident blocks to hide latency,
#: few enough that each block walks several strides
GRID_BLOCKS_PER_SM = 32
#: blocks per GroupNorm pass to aim for, per SM
GN_BLOCKS_PER_SM = 4


def grid_blocks(n: int, sm_count: int) -> int:
    """Blocks of a grid-stride launch over n elements: one per BLOCK elements, at most
    GRID_BLOCKS_PER_SM per SM."""
    return max(1, min((n + BLOCK - 1) // BLOCK, sm_count * GRID_BLOCKS_PER_SM))


def shuffle_grid(rows: int, row_len: int, sm_count: int) -> tuple[int, int]:
    """(blocks along a row, blocks over the rows) of the copy kernels pixel_shuffle3 and
    phase_interleave: up to one block per row (a grid's y extent stops at 65535; the kernel
    strides past it), then as many per row as keep the grid near GRID_BLOCKS_PER_SM per SM."""
    gy = min(rows, 65535)
    return max(1, min(-(-row_len // BLOCK), sm_count * GRID_BLOCKS_PER_SM // gy)), gy


def gn_chunks(n: int, rows: int, sm_count: int) -> tuple[int, int]:
    """(rows per chunk, chunks per batch item) of the GroupNorm passes: about GN_BLOCKS_PER_SM
    blocks per SM over the batch, never an empty chunk."""
    target = GN_BLOCKS_PER_SM * sm_count
    want = max(1, min(rows, -(-target // n)))
    per_chunk = -(-rows // want)
    return per_chunk, -(-rows // per_chunk)


#: 16-byte vectors of channels one lane of ln_rows_vec holds (the kernel's LN_MAXV)
LN_MAXV = 4


def row_in_registers(channels: int, itemsize: int, ptrs) -> bool:
    """Whether a warp can hold a row of `channels` in registers (ln_rows_vec, dw_ln): whole
    16-byte vectors, at most LN_MAXV of them per lane, every buffer 16-byte aligned (rows then
    are too: C * itemsize % 16 == 0)."""
    vec = 16 // itemsize
    return channels % vec == 0 and channels // vec <= 32 * LN_MAXV and all(p % 16 == 0 for p in ptrs)


def rms_vectorised(channels: int, itemsize: int, ptrs) -> bool:
    """Whether rms_rows_vec takes an RMS norm: whole 16-byte vectors per row, a row on at most
    one block's threads, every buffer 16-byte aligned."""
    vec = 16 // itemsize
    return channels % vec == 0 and channels // vec <= BLOCK and all(p % 16 == 0 for p in ptrs)


#: ln_rows_vec (a row in one warp's registers) won at few rows and lost at many on the H100
#: (benchmarks/gpu/convnext_fusion_ab.py, 2026-11-24, ConvNeXt-T: b1 0.617 vs 0.722 ms with it,
#: b32 2.31 vs 2.22 ms, b128 7.73 vs 7.29 ms); ln_rows takes norms over more rows than this
LN_VEC_MAX_ROWS = 16384


def ln_vectorised(channels: int, itemsize: int, ptrs, rows: int = 0, enabled: bool = True) -> bool:
    """Whether ln_rows_vec takes a LayerNorm; enabled=False keeps ln_rows (the backend's ln_vec
    option, for A/B)."""
    return enabled and rows <= LN_VEC_MAX_ROWS and row_in_registers(channels, itemsize, ptrs)


def dw_ln_applies(channels: int, itemsize: int, kernel: tuple, w_shape: tuple, ptrs) -> bool:
    """Whether dw_ln computes LayerNorm(depthwise conv + bias): one filter per channel, an odd
    kernel ('same' padding k // 2 on both sides), a row that fits a warp's registers."""
    kh, kw = kernel
    return (tuple(w_shape) == (channels, kh, kw, 1) and kh % 2 == 1 and kw % 2 == 1
            and row_in_registers(channels, itemsize, ptrs))


class Kernels:
    """The compiled kernels for one storage dtype ('float32', 'float16', 'bfloat16')."""

    _cache: dict[tuple[str, int], "Kernels"] = {}
    _lock = threading.Lock()

    @classmethod
    def for_dtype(cls, dtype: str) -> "Kernels":
        """The kernels for `dtype` on the current device."""
        import cupy as cp

        device = cp.cuda.Device()
        with cls._lock:
            k = cls._cache.get((dtype, device.id))
            if k is None:
                k = cls._cache[(dtype, device.id)] = cls(dtype, device.attributes["MultiProcessorCount"])
            return k

    def __init__(self, dtype: str, sm_count: int):
        import cupy as cp

        self.cp = cp
        self.dtype = dtype
        self.sm_count = int(sm_count)
        self.module = cp.RawModule(code=SOURCE, options=(f"-DDT={DTYPE_CODES[dtype]}",))
        self._fns = {}

    def _grid(self, n: int) -> int:
        return grid_blocks(n, self.sm_count)

    def fn(self, name: str):
        f = self._fns.get(name)
        if f is None:
            f = self._fns[name] = self.module.get_function(name)
        return f

    # ---- wrappers (inputs must be C-contiguous) -------------------------------------------
    def epilogue(self, x, bias, residual, activation, out=None):
        y = out if out is not None else self.cp.empty_like(x)
        n = x.size
        c = x.shape[-1]
        self.fn("epilogue")((self._grid(n),), (BLOCK,), (
            x, bias if bias is not None else x, residual if residual is not None else x, y,
            np.int64(n), np.int32(c), np.int32(bias is not None), np.int32(residual is not None),
            np.int32(ACT_CODES[activation])))
        return y

    def to_f32(self, x, clip=None):
        """x as a new float32 array, clipped to clip = (lo, hi) when given."""
        lo, hi = (-np.inf, np.inf) if clip is None else clip
        y = self.cp.empty(x.shape, dtype=self.cp.float32)
        self.fn("to_f32")((self._grid(x.size),), (BLOCK,), (x, y, np.int64(x.size), np.float32(lo), np.float32(hi)))
        return y

    def to_u8(self, x):
        """x (C-contiguous, values meant in [0, 1]) as a new uint8 array, pixels_to_uint8's
        formula on each widened float32 value."""
        y = self.cp.empty(x.shape, dtype=self.cp.uint8)
        if x.size:
            self.fn("to_u8")((self._grid(x.size),), (BLOCK,), (x, y, np.int64(x.size)))
        return y

    def from_f32(self, x, storage_dtype):
        y = self.cp.empty(x.shape, dtype=storage_dtype)
        self.fn("from_f32")((self._grid(x.size),), (BLOCK,), (x, y, np.int64(x.size)))
        return y

    def group_norm(self, x, groups, weight, bias, eps, activation):
        """Two launches (and a memset of the (N, G, 2) fp64 accumulator): statistics, then the
        normalisation with the finalize folded in. 16-byte loads where C is a multiple of the
        vector width (always for the hosted models); chunks of rows sized so that ~4 blocks per
        SM of the device run in each pass."""
        s = x.size // (x.shape[0] * x.shape[-1])
        sums = self.group_norm_sums(x, groups)
        return self.group_norm_apply(x, sums, s * (x.shape[-1] // groups), groups, weight, bias, eps, activation)

    def _gn_layout(self, x):
        n, c = x.shape[0], x.shape[-1]
        s = x.size // (n * c)
        vec = int(c % (16 // x.itemsize) == 0 and x.data.ptr % 16 == 0)
        rows_per_chunk, nchunks = gn_chunks(n, s, self.sm_count)
        return n, c, s, vec, rows_per_chunk, nchunks

    def group_norm_sums(self, x, groups):
        """group_norm's first launch: (N, G, 2) float64 sums of x and x*x over each group."""
        n, c, s, vec, rows_per_chunk, nchunks = self._gn_layout(x)
        acc = self.cp.zeros((n, groups, 2), dtype=self.cp.float64)
        self.fn("gn_stats")((nchunks, n), (BLOCK,), (
            x, acc, np.int64(s), np.int32(c), np.int32(groups), np.int64(rows_per_chunk), np.int32(vec)),
            shared_mem=2 * groups * 8)
        return acc

    def group_norm_apply(self, x, sums, count, groups, weight, bias, eps, activation):
        """group_norm's second launch: x normalised with `sums` (group_norm_sums' layout) over
        `count` elements per group: x's own, or those of every shard of an image split by rows."""
        n, c, s, vec, rows_per_chunk, nchunks = self._gn_layout(x)
        i32 = np.int32
        y = self.cp.empty_like(x)
        self.fn("gn_norm")((nchunks, n), (BLOCK,), (
            x, y, sums, weight if weight is not None else x, bias if bias is not None else x,
            np.int64(s), i32(c), i32(groups), np.int64(rows_per_chunk), np.float64(count), np.float32(eps),
            i32(weight is not None), i32(bias is not None), i32(ACT_CODES[activation]), i32(vec)),
            shared_mem=2 * groups * 4)
        return y

    def rms_norm(self, x, weight, eps, activation, out=None, groups=None, bias=None, residual=None):
        """out: where to write (part of a larger buffer): C-contiguous of x's size, or, with
        groups = (rows per group, rows from one group's start to the next's), x's rows in groups
        that far apart from out's first element on (rows of C channels). bias, residual (x's
        layout, contiguous): act(norm * weight + bias) + residual, in the same pass."""
        c = x.shape[-1]
        rows = x.size // c
        y = self.cp.empty_like(x) if out is None else out
        w, b, r = (v if v is not None else x for v in (weight, bias, residual))
        grp, gstride = groups or (rows, rows)
        args = (x, y, w, np.int64(rows), np.int32(c), np.int32(weight is not None), np.float32(eps),
                np.int32(ACT_CODES[activation]), np.int64(grp), np.int64(gstride), b, r, np.int32(bias is not None),
                np.int32(residual is not None))
        if rms_vectorised(c, x.itemsize, (x.data.ptr, y.data.ptr, w.data.ptr, b.data.ptr, r.data.ptr)):
            per_block = BLOCK // (c // (16 // x.itemsize))
            self.fn("rms_rows_vec")((-(-rows // per_block),), (BLOCK,), args, shared_mem=4 * BLOCK)
        else:
            per_block = BLOCK // 32
            self.fn("rms_rows")(((rows + per_block - 1) // per_block,), (BLOCK,), args)
        return y

    def rms_norm_rows(self, parts, weight, eps, activation, out, t0: int = 0):
        """Each part (n, t, rows_i, w, c), contiguous, normed into its rows of out (n, t0 + t,
        sum of rows_i, w, c) from frame t0 on: the parts joined on axis 2 with no joined copy.
        One launch per part and batch item (a part's rows of each frame are a group of the out)."""
        n, _, h, w, c = out.shape
        r0 = 0
        for part in parts:
            rows = int(part.shape[2])
            src = part.reshape(n, -1, c)
            for i in range(n):
                self.rms_norm(src[i], weight, eps, activation, out=out[i, t0:, r0:], groups=(rows * w, h * w))
            r0 += rows
        return out

    def layer_norm(self, x, weight, bias, eps, activation, input_bias=None, vectorised=True):
        """act(LayerNorm(x + input_bias) * weight + bias) over the last axis; `input_bias` is a
        per-channel bias of the op before the norm, added here instead of in its own pass;
        vectorised=False never takes ln_rows_vec."""
        c = x.shape[-1]
        rows = x.size // c
        y = self.cp.empty_like(x)
        per_block = BLOCK // 32
        operands = [x, y] + [v for v in (weight, bias, input_bias) if v is not None]
        vec = ln_vectorised(c, x.itemsize, [v.data.ptr for v in operands], rows, enabled=vectorised)
        name = "ln_rows_vec" if vec else "ln_rows"
        self.fn(name)(((rows + per_block - 1) // per_block,), (BLOCK,), (
            x, y, weight if weight is not None else x, bias if bias is not None else x,
            input_bias if input_bias is not None else x,
            np.int64(rows), np.int32(c), np.int32(weight is not None), np.int32(bias is not None),
            np.int32(input_bias is not None), np.float32(eps), np.int32(ACT_CODES[activation])))
        return y

    def depthwise2d(self, x, wt, bias, residual, activation, stride, pad_lo, dilation, out_shape):
        """x (N,H,W,C), wt (KH,KW,C) contiguous -> act(conv + bias) + residual, (N,OH,OW,C)."""
        y = self.cp.empty(out_shape, dtype=x.dtype)
        n, h, w, c = x.shape
        kh, kw = wt.shape[0], wt.shape[1]
        total = y.size
        i32 = np.int32
        vec = 16 // x.itemsize
        operands = [x, wt, y] + [v for v in (bias, residual) if v is not None]
        if (tuple(stride) == (1, 1) and tuple(dilation) == (1, 1) and c % vec == 0
                and all(v.data.ptr % 16 == 0 for v in operands)):
            items = n * out_shape[1] * -(-out_shape[2] // DW_TW) * (c // vec)
            self.fn("dw2d_vec")((self._grid(items),), (BLOCK,), (
                x, wt, bias if bias is not None else x, residual if residual is not None else x, y,
                i32(h), i32(w), i32(c), i32(out_shape[1]), i32(out_shape[2]), i32(kh), i32(kw),
                i32(pad_lo[0]), i32(pad_lo[1]), i32(bias is not None), i32(residual is not None),
                i32(ACT_CODES[activation]), np.int64(items)))
            return y
        self.fn("dw2d")((self._grid(total),), (BLOCK,), (
            x, wt, bias if bias is not None else x, residual if residual is not None else x, y,
            i32(h), i32(w), i32(c), i32(out_shape[1]), i32(out_shape[2]), i32(kh), i32(kw),
            i32(stride[0]), i32(stride[1]), i32(pad_lo[0]), i32(pad_lo[1]), i32(dilation[0]), i32(dilation[1]),
            i32(bias is not None), i32(residual is not None), i32(ACT_CODES[activation]), np.int64(total)))
        return y

    def depthwise_layer_norm(self, x, wt, bias, norm_w, norm_b, eps, pad_lo):
        """LayerNorm(depthwise stride-1 'same' conv(x) + bias) over channels, one kernel; x
        (N,H,W,C), wt (KH,KW,C). The caller checks dw_ln_applies first."""
        y = self.cp.empty_like(x)
        n, h, w, c = x.shape
        pixels = n * h * w
        per_block = BLOCK // 32
        i32 = np.int32
        self.fn("dw_ln")(((pixels + per_block - 1) // per_block,), (BLOCK,), (
            x, wt, bias if bias is not None else x, norm_w, norm_b, y, i32(h), i32(w), i32(c),
            i32(wt.shape[0]), i32(wt.shape[1]), i32(pad_lo[0]), i32(pad_lo[1]), i32(bias is not None),
            np.float32(eps), np.int64(pixels)))
        return y

    def softmax_rows(self, x, scale: float = 1.0):
        """Softmax over the last axis of contiguous x (times `scale` first)."""
        length = x.shape[-1]
        rows = x.size // length
        y = self.cp.empty_like(x)
        if rows:
            self.fn("softmax_rows")((rows,), (BLOCK,), (x, y, np.int64(rows), np.int32(length),
                                                         np.float32(scale)))
        return y

    def pixel_shuffle3(self, x, factors: tuple[int, int, int], repeats: int, start: int):
        """TensorOps.pixel_shuffle of contiguous x (N, T, H, W, Ci) over its three spatial axes."""
        n, t, h, w, ci = x.shape
        ft, fh, fw = factors
        co = ci * repeats // (ft * fh * fw)
        to, ho, wo = t * ft - start, h * fh, w * fw
        if wo * co >= 2 ** 31 or max(ci, co) * ft * fh * fw >= 2 ** 31:
            raise ValueError(f"pixel_shuffle3: a row of {wo} x {co} is beyond the kernel's int32 indices")
        y = self.cp.empty((n, to, ho, wo, co), dtype=x.dtype)
        rows, row_len = n * to * ho, wo * co
        vec = 16 // x.dtype.itemsize
        whole = (ft * fh * fw) % repeats == 0 and co % vec == 0 and ci % vec == 0 and x.data.ptr % 16 == 0
        if y.size:
            i32 = np.int32
            name, row_units = ("pixel_shuffle3_vec", row_len // vec) if whole else ("pixel_shuffle3", row_len)
            self.fn(name)(shuffle_grid(rows, row_units, self.sm_count), (BLOCK,), (
                x, y, np.int64(rows), i32(t), i32(h), i32(w), i32(ci), i32(to), i32(ho), i32(wo), i32(co),
                i32(ft), i32(fh), i32(fw), i32(repeats), i32(start)))
        return y

    def phase_interleave(self, y, residual=None):
        """upsample_conv2d's phase form (upsample.py): contiguous y (N, H+1, W+1, 4C), the 2x2
        conv's four phases, to (N, 2H, 2W, C) in place order, plus contiguous `residual` of that
        shape if given."""
        n, h1, w1, c4 = y.shape
        h, w, c = h1 - 1, w1 - 1, c4 // 4
        if 2 * w * c >= 2 ** 31 or w1 * c4 >= 2 ** 31:
            raise ValueError(f"phase_interleave: a row of {2 * w} x {c} is beyond the kernel's int32 indices")
        out = self.cp.empty((n, 2 * h, 2 * w, c), dtype=y.dtype)
        rows, row_len = n * 2 * h, 2 * w * c
        vec = 16 // y.dtype.itemsize
        if out.size:
            i32 = np.int32
            whole = c % vec == 0 and y.data.ptr % 16 == 0 and (residual is None or residual.data.ptr % 16 == 0)
            name, row_units = ("phase_interleave_vec", row_len // vec) if whole else ("phase_interleave", row_len)
            self.fn(name)(shuffle_grid(rows, row_units, self.sm_count), (BLOCK,), (
                y, y if residual is None else residual, out, np.int64(rows), i32(h), i32(w), i32(c),
                i32(residual is not None)))
        return out

    def takes_shuffled(self, y, source, factors, repeats: int) -> bool:
        """Whether phase_interleave_shuffled adds pixel_shuffle(source, factors, repeats) to the
        phases y: 2x2 in space (the upsample's own), a repeat count dividing the factors, whole
        16-byte vectors of channels on both sides, aligned buffers."""
        vec = 16 // y.dtype.itemsize
        ft, fh, fw = factors
        return ((fh, fw) == (2, 2) and (ft * 4) % repeats == 0 and (y.shape[-1] // 4) % vec == 0
                and source.shape[-1] % vec == 0 and y.data.ptr % 16 == 0 and source.data.ptr % 16 == 0)

    def phase_interleave_shuffled(self, y, source, ft: int, repeats: int, start: int):
        """phase_interleave(y, residual) with residual = pixel_shuffle(source, (ft, 2, 2), repeats,
        start) read as frames, taken from contiguous source (N, T, H, W, Ci) where it lies: the
        shuffled copy is never made (takes_shuffled says when this applies)."""
        n, t, h, w, ci = source.shape
        f, h1, w1, c4 = y.shape
        c = c4 // 4
        if 2 * w * c >= 2 ** 31 or w1 * c4 >= 2 ** 31 or w * ci >= 2 ** 31:
            raise ValueError(f"phase_interleave_shuffled: a row of {2 * w} x {c} is beyond the kernel's int32 indices")
        out = self.cp.empty((f, 2 * h, 2 * w, c), dtype=y.dtype)
        rows, vec = f * 2 * h, 16 // y.dtype.itemsize
        if out.size:
            i32 = np.int32
            self.fn("phase_interleave_shuffled_vec")(shuffle_grid(rows, 2 * w * c // vec, self.sm_count), (BLOCK,), (
                y, source, out, np.int64(rows), i32(h), i32(w), i32(c), i32(t), i32(ci), i32(f // n), i32(ft),
                i32(repeats), i32(start)))
        return out

    def softmax_rows_f32(self, x, scale: float = 1.0):
        """softmax_rows of contiguous float32 x (bfloat16 attention's scores), each probability as
        two values of this dtype's storage: (..., L) -> (..., 2L), its rounding in the first half
        of a row and the rest in the second (softmax.cu says why)."""
        if x.dtype != np.float32:
            raise TypeError(f"softmax_rows_f32 takes float32 scores, got {x.dtype}")
        length = x.shape[-1]
        rows = x.size // length
        y = self.cp.empty((*x.shape[:-1], 2 * length), dtype=STORAGE[self.dtype])
        if rows:
            self.fn("softmax_rows_f32")((rows,), (BLOCK,), (x, y, np.int64(rows), np.int32(length),
                                                             np.float32(scale)))
        return y
