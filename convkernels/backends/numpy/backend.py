"""The NumPy backend: the CPU default. Computes in float32 (float64 when given float64);
float16/bfloat16 inputs are accepted and computed in float32."""
from __future__ import annotations

import numpy as np

from ... import _cpu
from ...backend import BackendBase
from ...paths import ConvPath
from ...spec import ConvKey, ConvSpec, is_subpixel_upsample, pad_each_axis, prod, upsample_shapes
from ...unfold import conv_transpose_col2im, conv_unfold_gemm, unfold_bytes
from . import conv as nc, fused, norms
from .activations import apply_activation, c_ready, gelu
from .autotune import time_paths
from .background import Activity
from .blas import BlasThreads
from .memory import retain_freed_memory, watch as watch_memory
from .path_choice import MeasuredChoices
from .path_store import PathStore
from .weight_cache import TransformedWeights

DEFAULT_UNFOLD_LIMIT = 64 * 1024 * 1024

#: numpy-style names of dtypes seen, as dtype_of returns them (str(dtype) costs ~4 us a call)
_DTYPE_NAMES: dict = {}

#: the 3-D weight transform per tile variant (one function each: the weight cache is keyed by it)
_WINOGRAD_3D_WEIGHTS = {nc.F2X3: nc.winograd_weights_3d,
                        nc.F4X3: lambda w: nc.winograd_weights_3d(w, nc.F4X3)}
#: and as gemm.c's panels, transformed and packed in one compiled pass (2-D and 3-D weights)
_WINOGRAD_PANELS = {tile: (lambda w, g=tile.g: fused.winograd_panels(w, g)) for tile in (nc.F2X3, nc.F4X3)}

class NumpyBackend(BackendBase):
    name = "numpy"
    supported_dtypes = ("float32", "float64")

    def __init__(self, dtype: str = "float32", unfold_limit_bytes: int | None = None,
                 timing_sample_rate: float = 1.0, attention_chunk: int = 2048,
                 autotune_min_macs: float = 5e7, plan_cache_dir: str | None = None,
                 autotune: str = "background"):
        self.unfold_limit_bytes = int(unfold_limit_bytes or DEFAULT_UNFOLD_LIMIT)
        self.attention_chunk = attention_chunk
        # Convs above this size pick their path by measurement (the winner flips with channels, size
        # and machine), by default in the background after the cost model has answered (path_choice.py);
        # smaller ones use the static cost rule, where measuring costs more than it saves. inf disables.
        self.autotune_min_macs = float(autotune_min_macs)
        self.autotune = autotune
        # measured choices outlive the process when a directory is given (as CUDA's plans do)
        self.path_store = PathStore(plan_cache_dir) if plan_cache_dir else None
        self.activity = Activity()  # convs and linears in flight: the background tuner waits for none
        self.blas_threads = BlasThreads()
        retain_freed_memory()  # reused pages, not a fresh mmap's page faults per op (memory.py)
        watch_memory(self.activity)  # the heap's free pages handed back once this backend idles (memory.py)
        self._wino_cache = TransformedWeights()  # weights transformed once per buffer (weight_cache.py)
        super().__init__(dtype, timing_sample_rate)

    # ---- arrays ---------------------------------------------------------------------------
    def _compute_dtype(self, dt) -> np.dtype:
        return np.dtype(np.float64) if np.dtype(dt) == np.float64 else np.dtype(np.float32)

    def asarray(self, host, dtype=None):
        host = np.asarray(host)
        if host.dtype.kind != "f" and str(host.dtype) != "bfloat16" and host.dtype != np.uint8:
            raise ValueError(f"numpy backend: expected a floating or uint8 array, got dtype {host.dtype}")
        return np.ascontiguousarray(host, dtype=self._compute_dtype(dtype or self.dtype))

    def to_host(self, x):
        return np.asarray(x)

    def dtype_of(self, x) -> str:
        dt = x.dtype if isinstance(x, np.ndarray) else np.asarray(x).dtype
        name = _DTYPE_NAMES.get(dt)
        if name is None:  # str(dtype) costs ~4 us; a conv asks three times
            name = _DTYPE_NAMES[dt] = str(dt)
        return name

    _f = staticmethod(norms.as_compute)  # half inputs upcast to float32; float32 and float64 kept

    def measure_paths(self):  # hooks late-bound: tests wrap _time_paths
        self.choice = MeasuredChoices(self.autotune, self.autotune_min_macs, self.path_store,
                                      lambda k, v: self._time_paths(k, v), lambda m: self.paths.rechoose(m), self.activity)
        return self.choice

    def _time_paths(self, key: ConvKey, valid: list[ConvPath]) -> ConvPath:
        return time_paths(key, valid)

    # ---- conv paths -----------------------------------------------------------------------
    def conv_paths(self) -> list[ConvPath]:
        def is_pointwise(k: ConvKey) -> bool:
            s = k.spec
            return (not s.transpose and s.groups == 1 and all(v == 1 for v in k.kernel)
                    and all(v == 1 for v in s.stride) and not any(lo or hi for lo, hi in s.padding))

        def fits(k: ConvKey) -> bool:
            # not where subpixel_gemm runs: col2im does the same multiplies plus 16 scatter-adds
            # over the output (1.25-1.5x slower from 32 to 512 channels, one thread), and timing it only
            # to lose would add tens of seconds to a first SD-VAE 512 decode
            return unfold_bytes(k.x_shape, k.w_shape, k.out_shape, k.spec) <= self.unfold_limit_bytes \
                and not is_subpixel_upsample(k)

        def dense_cost(k: ConvKey) -> float:
            return float(k.macs())

        def depthwise_cost(k: ConvKey) -> float:
            # shifted multiply-adds beat per-channel gemms whenever the conv is depthwise
            return float(k.macs()) * (0.5 if k.is_depthwise else 1e9)

        def direct_depthwise_ok(k: ConvKey) -> bool:
            return (_cpu.AVAILABLE and k.is_depthwise and not k.spec.transpose and k.spec.nd == 2
                    and k.dtype in ("float32", "float16", "bfloat16"))

        def shift_ok(k: ConvKey) -> bool:
            s = k.spec
            # per-tap gemms need a deep enough reduction (C_in) to keep BLAS efficient
            return (not s.transpose and s.groups == 1 and all(v == 1 for v in s.stride)
                    and prod(k.kernel) > 1 and k.in_channels >= 32)

        def winograd_ok(k: ConvKey) -> bool:
            s = k.spec
            return (not s.transpose and s.nd == 2 and k.kernel == (3, 3) and s.groups == 1
                    and s.stride == (1, 1) and s.dilation == (1, 1) and k.in_channels >= 32
                    and k.out_channels >= 32)

        def winograd4_ok(k: ConvKey) -> bool:
            return _cpu.AVAILABLE and winograd_ok(k)  # C transforms only

        def winograd_3d_ok(k: ConvKey, tile=nc.F2X3) -> bool:
            # Wan's CausalConv3d (3x3x3 and, on the first latent frame, 1x3x3); the C transforms
            # are the only implementation, so no compiler means no such path
            s = k.spec
            return (_cpu.AVAILABLE and not s.transpose and s.nd == 3 and k.kernel[1:] == (3, 3)
                    and s.groups == 1 and s.stride == (1, 1, 1) and s.dilation == (1, 1, 1)
                    and k.in_channels >= 32 and k.out_channels >= 32
                    and nc.winograd_3d_row_bytes(k, tile) <= nc.WINOGRAD_3D_ROW_MAX_BYTES)

        return [
            ConvPath("pointwise_gemm", is_pointwise, lambda k: 0.5 * k.macs(), self._run_pointwise,
                     self._prepare_gemm),
            # measured on 2 Xeon cores: 7x7 depthwise 96ch 56x56 15 ms shifted, ~1 ms direct
            ConvPath("depthwise_direct", direct_depthwise_ok, lambda k: 0.05 * k.macs(), self._run_depthwise_direct),
            ConvPath("depthwise_shift", lambda k: k.is_depthwise and not k.spec.transpose,
                     depthwise_cost, self._run_depthwise),
            # 2.25x fewer multiplies; oneDNN uses Winograd for these convs too
            ConvPath("winograd_f2x3", winograd_ok, lambda k: 0.5 * k.macs(), self._run_winograd,
                     self._prepare_winograd(nc.F2X3, nc.winograd_weights)),
            ConvPath("winograd_f2x3_3d", winograd_3d_ok, lambda k: 0.5 * k.macs(), self._run_winograd_3d,
                     self._prepare_winograd(nc.F2X3, _WINOGRAD_3D_WEIGHTS[nc.F2X3])),
            # F(4x4): 1.5-1.6x faster than F(2x2) on large convs, ~7x its rounding error; the
            # static rule (small convs) never picks it, measured choice takes it where it wins
            ConvPath("winograd_f4x3", winograd4_ok, lambda k: 0.6 * k.macs(), self._run_winograd4,
                     self._prepare_winograd(nc.F4X3, nc.winograd4_weights)),
            ConvPath("winograd_f4x3_3d", lambda k: winograd_3d_ok(k, nc.F4X3), lambda k: 0.6 * k.macs(),
                     self._run_winograd4_3d,
                     self._prepare_winograd(nc.F4X3, _WINOGRAD_3D_WEIGHTS[nc.F4X3])),
            # no unfold buffer and ~10% faster than im2col at 512ch (measured)
            ConvPath("shift_gemm", shift_ok, lambda k: 0.9 * k.macs(), self._run_shift),
            # k4 s2 p1 transposed convs (nearest 2x + 3x3 conv as one conv): four phase convs
            # written straight into the interleaved output
            ConvPath("subpixel_gemm", is_subpixel_upsample, lambda k: 0.5 * k.macs(), self._run_subpixel),
            ConvPath("im2col_gemm", fits, dense_cost, self._run_unfold, self._prepare_gemm),
            ConvPath("tiled_unfold", lambda k: not fits(k) and not is_subpixel_upsample(k), dense_cost,
                     self._run_unfold, self._prepare_gemm),
        ]

    def _run(self, path, key, x, w, bias, residual, activation):
        with self.activity:
            return self._run_pinned(path, key, x, w, bias, residual, activation)

    def _run_pinned(self, path, key, x, w, bias, residual, activation):
        spec = key.spec
        if key.w_shape[-1] == 1 and spec.groups > 1 and not spec.transpose:
            # depthwise paths call no BLAS: pinning its threads would cost ~10 us for nothing
            return self._count_and_time(path, key, x, w, bias, residual, activation)
        # small convs run their gemms on one BLAS thread (blas.SMALL_GEMM_MACS)
        rows = prod(key.x_shape[:-1]) * prod(spec.stride) if spec.transpose else \
            key.x_shape[0] * prod(key.out_shape[1:-1])
        macs = float(rows) * key.w_shape[0] * prod(key.w_shape[1:])
        with self.blas_threads.for_macs(macs):
            return self._count_and_time(path, key, x, w, bias, residual, activation)

    def _epilogue(self, out, bias, residual, activation):
        b = None if bias is None else self._f(bias).astype(out.dtype, copy=False)
        r = None if residual is None else self._f(residual).astype(out.dtype, copy=False)
        if fused.epilogue_in_place(out, b, r, activation):  # one compiled pass, on the threads
            return out
        out = apply_activation(out if b is None else np.add(out, b, out=out), activation, owned=True)
        return out if r is None else out + r

    def _operands(self, x, w):
        x, w = self._f(x), self._f(w)
        dt = np.result_type(x.dtype, w.dtype)
        return x.astype(dt, copy=False), w.astype(dt, copy=False)

    def _run_pointwise(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        return self._epilogue(nc.conv_pointwise(x, w, key, self._tiles_matmul), bias, residual, activation)

    def _run_depthwise(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        return self._epilogue(nc.conv_depthwise_shift(x, w, key), bias, residual, activation)

    def _run_depthwise_direct(self, x, w, key, bias, residual, activation):
        out = nc.conv_depthwise_direct(self._f(x), self._f(w), key, None if bias is None else self._f(bias))
        return self._epilogue(out, None, residual, activation)

    def _run_winograd(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        if c_ready(x):
            u, planes = self._winograd_weights(w, nc.F2X3, nc.winograd_weights)
            out = nc.conv_winograd_compiled(x, w, key, self.unfold_limit_bytes, u, nc.F2X3, planes)
        else:
            out = nc.conv_winograd_f2x3(x, w, key, self.unfold_limit_bytes)
        return self._epilogue(out, bias, residual, activation)

    def _run_winograd4(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        u, planes = self._winograd_weights(w, nc.F4X3, nc.winograd4_weights)
        out = nc.conv_winograd_compiled(x, w, key, self.unfold_limit_bytes, u, nc.F4X3, planes)
        return self._epilogue(out, bias, residual, activation)

    def _run_winograd_3d(self, x, w, key, bias, residual, activation, tile=nc.F2X3):
        x, w = self._operands(x, w)
        u, planes = self._winograd_weights(w, tile, _WINOGRAD_3D_WEIGHTS[tile])
        out = nc.conv_winograd_3d(x, w, key, self.unfold_limit_bytes, u, tile, planes)
        return self._epilogue(out, bias, residual, activation)

    def _run_winograd4_3d(self, x, w, key, bias, residual, activation):
        return self._run_winograd_3d(x, w, key, bias, residual, activation, nc.F4X3)

    def _prepare_winograd(self, tile, transform):
        """a Winograd path's `prepare` (paths.py): the weight transform its calls look up, at load"""
        return lambda w, key: self._winograd_weights(self._f(w), tile, transform)

    def _prepare_gemm(self, w, key):
        """an ungrouped pointwise or unfolded conv's `prepare`: its (O, k C) weight packed as its calls
        pack it (their gemm's transposed view, unfold.py)"""
        if key.spec.groups == 1 and not key.spec.transpose and fused.panel_width() and self.dtype == "float32":
            self._pack(self._f(w).reshape(w.shape[0], -1))

    def _winograd_weights(self, w: np.ndarray, tile, transform):
        """(U = transform(w), None) for NumPy's per-plane matmuls; or where gemm.c has tiles, (None,
        the per-plane products on them), w transformed straight into their panels. Once per buffer."""
        if not fused.panel_width():
            return self._wino_cache(w, transform), None
        packed = self._wino_cache(w, _WINOGRAD_PANELS[tile])
        return None, lambda v, out, frames=None: fused.planes_matmul(v, packed, out, frames)

    def _run_shift(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        return self._epilogue(nc.conv_shift_gemm(x, w, key, self.unfold_limit_bytes), bias, residual, activation)

    def _run_subpixel(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        wp = self._wino_cache(w, nc.subpixel_weights) if x.dtype == np.float32 else None
        out = nc.conv_transpose_subpixel(x, w, key, self.unfold_limit_bytes, wp)
        return self._epilogue(out, bias, residual, activation)

    def _run_unfold(self, x, w, key, bias, residual, activation):
        """im2col_gemm and tiled_unfold: convkernels/unfold.py on NumPy (col2im if transposed)."""
        x, w = self._operands(x, w)
        if key.spec.transpose:
            out, _ = conv_transpose_col2im(nc.NUMPY, x, w, key.spec, key.out_shape, self.unfold_limit_bytes)
        else:
            out, _ = conv_unfold_gemm(nc.NUMPY, x, w, key.spec, key.out_shape, self.unfold_limit_bytes,
                                      self._tiles_matmul)
        return self._epilogue(out, bias, residual, activation)

    def prepare_linear(self, weight) -> None:
        if fused.panel_width() and self.dtype == "float32":
            self._pack(self._f(weight))

    def _pack(self, w: np.ndarray) -> np.ndarray:
        """a linear's (O, I) weight as gemm.c's panels, packed once per weight buffer"""
        return self._wino_cache(w, fused.pack_panels)

    def _taps(self, w: np.ndarray) -> np.ndarray:
        """a depthwise conv's weight as the compiled kernels' taps, once per weight buffer"""
        return self._wino_cache(w, fused.depthwise_taps)

    def _tiles_matmul(self, a: np.ndarray, wt: np.ndarray) -> np.ndarray:
        """a @ wt (wt a weight's transposed view) on gemm.c's tiles where they apply"""
        return fused.matmul(a, wt, self._pack)

    # ---- other ops ------------------------------------------------------------------------
    def _block_products(self) -> tuple:
        """How ConvNeXt's block calls multiply: (a weight's panels, bfloat16?, fused.linear's twin or None)"""
        return self._pack, False, None

    def mlp(self, x, w1, b1, w2, b2, activation, residual):
        """The two products over blocks of rows (fused.mlp) where their hidden activations would
        not stay in cache, else None (the caller runs the two linears)."""
        x, w1 = self._operands(x, w1)
        if not fused.mlp_applies(x.size // x.shape[-1], w1.shape[0]):
            return None
        w2, b1, b2 = (None if a is None else self._f(a) for a in (w2, b1, b2))
        with self.activity:
            out = fused.mlp(x.reshape(-1, x.shape[-1]), w1, b1, w2, b2, activation, self._f(residual),
                            *self._block_products()[::2])
        return None if out is None else out.reshape(*x.shape[:-1], w2.shape[0])

    def depthwise_conv_layer_norm(self, x, w, bias, norm_w, norm_b, eps: float):
        """ConvNeXt's depthwise 'same' conv + LayerNorm as one compiled pass (fused.py), or None
        where it does not apply. Still a conv to the before_conv hook and the conv metrics."""
        if not fused.depthwise_layer_norm_applies(x, w, bias, norm_w, norm_b):
            return None
        kernel = (w.shape[1], w.shape[2])
        if self.before_conv is not None:
            self.before_conv(x, w, ConvSpec.make(2, 1, (kernel[0] // 2, kernel[1] // 2), 1, x.shape[-1]))
        return self._counted("conv2d", "depthwise_layer_norm", fused.depthwise_layer_norm, x,
                             self._taps(w), kernel, bias, norm_w, norm_b, eps)

    def depthwise_ln_mlp(self, x, blocks, eps: float, activation):
        """ConvNeXt's block bodies (fused.depthwise_ln_mlp) in one compiled call, or None. Counted and
        timed as one conv a block on its own path; not taken while before_conv watches each conv alone."""
        blocks = [(w, bias, nw, nb, *(None if a is None else self._f(a) for a in mlp))
                  for w, bias, nw, nb, *mlp in blocks]
        if self.before_conv is not None or not fused.depthwise_ln_mlp_applies(x, blocks, activation):
            return None
        with self.activity:
            return self._counted("conv2d", "depthwise_ln_mlp", fused.depthwise_ln_mlp, x, blocks, eps, activation,
                                 self._taps, *self._block_products()[:2], calls=len(blocks))

    # the norms: one compiled pass each where the C extension runs (norms.py)
    _group_norm = staticmethod(norms.group_norm)
    _layer_norm = staticmethod(norms.layer_norm)
    _rms_norm = staticmethod(norms.rms_norm)

    def rms_norm_affine(self, x, weight, bias, residual, eps):
        return norms.rms_norm_affine(x, weight, bias, residual, eps)  # the compiled RMS pass, or None

    def _activation(self, x, activation):
        return apply_activation(self._f(x), activation)

    def _upsample_nearest(self, x, scale):
        x = np.asarray(x)
        expanded, target, final = upsample_shapes(x.shape, scale)
        return np.ascontiguousarray(np.broadcast_to(x.reshape(expanded), target)).reshape(final)

    def _pad(self, x, pads, modes):
        return pad_each_axis(np.asarray(x), pads, modes, lambda a, width, mode: np.pad(a, width, mode=mode))

    def _linear(self, x, weight, bias, residual, activation):
        with self.activity:  # ConvNeXt's MLPs: most of its time, and no conv
            return self._linear_run(x, weight, bias, residual, activation)

    def _linear_run(self, x, weight, bias, residual, activation):
        x, weight = self._operands(x, weight)
        x2 = x.reshape(-1, x.shape[-1])
        b = None if bias is None else self._f(bias).astype(x2.dtype, copy=False)
        # the compiled tiles (bias, activation and residual applied in registers) call no BLAS, so
        # they skip threadpoolctl's limit for small gemms (~15 us a call)
        macs = float("inf") if fused.panel_width() else float(x2.shape[0]) * weight.shape[0] * weight.shape[1]
        with self.blas_threads.for_macs(macs):
            out = fused.linear(x2, weight, b, None if residual is None else self._f(residual), activation, self._pack)
            if out is not None:
                return out.reshape(*x.shape[:-1], weight.shape[0])
            out = np.matmul(x2, weight.T)
        if activation == "gelu":
            out = gelu(out, b)
        else:
            if b is not None:
                out += b
            out = apply_activation(out, activation, owned=True)
        out = out.reshape(*x.shape[:-1], weight.shape[0])
        if residual is not None:
            out += self._f(residual).astype(out.dtype, copy=False)
        return out

    def _matmul(self, a, b):
        a, b = self._f(a), self._f(b)
        macs = float(np.prod(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]) or (1,))) * a.shape[-2] * a.shape[-1] * b.shape[-1]
        with self.blas_threads.for_macs(macs):
            return np.matmul(a, b)

    def _softmax(self, x, axis):
        x = self._f(x)
        e = np.exp(x - x.max(axis=axis, keepdims=True))
        e /= e.sum(axis=axis, keepdims=True)
        return e

    def _attention(self, q, k, v, scale):
        # query rows in chunks so the score matrix stays bounded for large latents
        q, k, v = self._f(q), self._f(k), self._f(v)
        kt = np.swapaxes(k, -1, -2)
        lq = q.shape[-2]
        out = np.empty((*q.shape[:-1], v.shape[-1]), dtype=np.result_type(q, v))
        step = max(1, self.attention_chunk)
        for s in range(0, lq, step):
            scores = np.matmul(q[..., s:s + step, :], kt) * np.asarray(scale, q.dtype)
            out[..., s:s + step, :] = np.matmul(self._softmax(scores, -1), v)
        return out

    def _concat(self, xs, axis):
        return np.concatenate([np.asarray(x) for x in xs], axis=axis)

    def _mean(self, x, axes, keepdims):
        return self._f(x).mean(axis=axes, keepdims=keepdims)

    def describe(self) -> dict:
        return {**super().describe(), "unfold_limit_bytes": self.unfold_limit_bytes, "autotune": self.autotune}
