"""The CUDA backend's conv paths and their measured choice.

- `cudnn`: a cuDNN frontend graph per conv key, from the plan cache (plan_cache.py); a key
  cuDNN has no plan for is cached as FALLBACK and runs gemm_fallback, and the metrics then name
  the path that ran.
- `gemm_fallback` / `tiled_unfold`: explicit im2col / col2im (convkernels/unfold.py on CuPy) +
  cuBLAS in float32, for keys cuDNN refuses or with force_fallback; `tiled_unfold` where the
  unfold buffer tiles. It is the correctness path: float32 whatever the storage dtype.
- `small_kd_2d`: a 3-d conv as kD accumulated 2-d cuDNN convs over frames.
- `depthwise_direct`: our depthwise 2-d kernel with the epilogue fused.
- `grouped_pointwise`: our kernel for a grouped 1x1 conv of small groups (GP_MAXC channels at
  most), the epilogue fused; it takes such keys without measurement: cuDNN ran DC-AE's (96 groups
  of 32) as one sliced GEMM per group or a direct kernel of 2 ms (one H200, 2026-11-29).
small_kd_2d is chosen only by measurement (autotune); depthwise_direct by measurement too, which
depthwise keys always get (cuDNN's grouped direct kernel took 2 ms for one of DC-AE's 5x5
depthwise convs, ours a tenth of it; two contenders timed at a key's first call). Every runner
returns (out, the path that ran). Under a CUDA graph capture (graphs.py) nothing here builds a
plan or measures, and the workspace and plans the captured work uses are held by the graph.
"""
from __future__ import annotations

import logging
import statistics

import numpy as np

from ...paths import ConvPath
from ...spec import ConvKey, ConvSpec
from ...unfold import NumpyLike, conv_transpose_col2im, conv_unfold_gemm, unfold_bytes
from .arrays import storage_dtype
from .kernels import ACT_CODES, BLOCK
from .plan_cache import Fallback, PlanKey

log = logging.getLogger("convkernels.cuda")

#: the paths a measured choice times against each other (a key whose static choice is another keeps it)
MEASURED = ("cudnn", "small_kd_2d", "depthwise_direct")
#: grouped_pw's bounds (src/depthwise.cu): channels a group, pixels a block
GP_MAXC, GP_TT = 64, 64


class CudaConvPaths:
    """The path catalogue of one CudaBackend and what its runners share: the cuDNN plan cache and
    workspace, the cuBLAS handle of gemm_fallback, derived weights, measurements."""

    def __init__(self, cp, arrays, capture, weights, builder, plan_cache, blas, device_id: int,
                 unfold_limit_bytes: int, autotune: bool):
        self.cp, self.arrays, self.capture, self.weights = cp, arrays, capture, weights
        self.builder, self.plan_cache, self.blas = builder, plan_cache, blas
        self.device_id = device_id
        self.unfold_limit_bytes = unfold_limit_bytes
        self.autotune = autotune
        #: CuPy as unfold.py's array namespace; the cuBLAS products take contiguous weights
        self.xp = NumpyLike(cp, contiguous_weights=True)
        #: the cuDNN workspace, replaced by a larger one when a plan needs more
        self.workspace = None
        #: key -> {path: median ms} of each measured choice
        self.measurements: dict = {}

    def catalogue(self) -> list[ConvPath]:
        def small_kd(k: ConvKey) -> bool:
            return k.op == "conv3d" and 1 < k.kernel[0] <= 4

        def exceeds(k: ConvKey) -> bool:
            return unfold_bytes(k.x_shape, k.w_shape, k.out_shape, k.spec) > self.unfold_limit_bytes

        def depthwise_2d(k: ConvKey) -> bool:
            return k.op == "conv2d" and k.is_depthwise

        def grouped_pointwise(k: ConvKey) -> bool:
            s, g = k.spec, k.spec.groups
            return (k.op == "conv2d" and not s.transpose and g > 1 and not k.is_depthwise
                    and k.kernel == (1, 1) and s.stride == (1, 1) and s.dilation == (1, 1)
                    and all(p == (0, 0) for p in s.padding) and k.in_channels // g <= GP_MAXC
                    and k.out_channels // g <= GP_MAXC and g <= 65535)

        return [
            ConvPath("cudnn", lambda k: True, lambda k: 1.0, self.run_cudnn),
            # our own kernel; taken where autotune measures it faster than cuDNN's plan
            ConvPath("depthwise_direct", depthwise_2d, lambda k: 1.5, self.run_depthwise),
            ConvPath("grouped_pointwise", grouped_pointwise, lambda k: 0.5, self.run_grouped_pointwise),
            # static rule: native cuDNN 3D wins on the H100 (measured); only measurement picks this
            ConvPath("small_kd_2d", small_kd, lambda k: 2.0, self.run_small_kd),
            ConvPath("gemm_fallback", lambda k: True, lambda k: 1e9, self.run_gemm),
            ConvPath("tiled_unfold", exceeds, lambda k: 2e9, self.run_gemm),
        ]

    def measure(self, key: ConvKey, valid: list[ConvPath]) -> ConvPath:
        static = min(valid, key=lambda p: p.cost(key))
        contenders = [p for p in valid if p.name in MEASURED]
        if not (self.autotune or key.is_depthwise) or len(contenders) < 2 or static.name not in MEASURED:
            return static
        # timing synchronises with the host: not inside a capture
        self.capture.require_eager(f"path choice for a new {key.op} key")
        cp = self.cp
        rng = cp.random.default_rng()

        def rand(shape):
            return self.arrays.cast(rng.standard_normal(shape, dtype=cp.float32), key.dtype)
        x, w = rand(key.x_shape), rand(key.w_shape)
        has_b, has_r, act = key.epilogue
        b = rand((key.out_channels,)) if has_b else None
        r = rand(key.out_shape) if has_r else None
        start, end = cp.cuda.Event(), cp.cuda.Event()
        times = {}
        for p in contenders:
            p.run(x, w, key, b, r, act)  # warm-up: builds plans
            ts = []
            for _ in range(5):
                start.record()
                p.run(x, w, key, b, r, act)
                end.record()
                end.synchronize()
                ts.append(cp.cuda.get_elapsed_time(start, end))
            times[p.name] = statistics.median(ts)
        best = min(contenders, key=lambda p: times[p.name])
        self.measurements[key] = times
        log.info("path choice for %s measured %s -> %s", key.op, times, best.name)
        return best

    def workspace_ptr(self, nbytes: int) -> int:
        if self.workspace is None or self.workspace.nbytes < max(1, nbytes):
            self.workspace = self.cp.empty(max(256, nbytes), dtype=self.cp.uint8)
        # a captured graph writes this scratch on every replay: it must outlive a later, larger
        # workspace replacing it here, or the replays scribble on whatever reuses it
        self.capture.keep(self.workspace)
        return self.workspace.data.ptr

    # ---- runners: (x, w, key, bias, residual, activation) -> (out, path that ran) -------------------
    def run_cudnn(self, x, w, key: ConvKey, bias, residual, activation):
        cp = self.cp
        spec = key.spec
        out = cp.empty(key.out_shape, dtype=storage_dtype(key.dtype))
        xs, ws, ys, rs = x, w, out, residual
        stride, dil = spec.stride, spec.dilation
        lo = tuple(p[0] for p in spec.padding)
        hi = tuple(p[1] for p in spec.padding)
        if spec.nd == 1:  # cuDNN convolves 2+ spatial dims: a 1-d conv is a 2-d one with H = 1
            xs = x.reshape(x.shape[0], 1, *x.shape[1:])
            ws = w.reshape(w.shape[0], 1, *w.shape[1:])
            ys = out.reshape(out.shape[0], 1, *out.shape[1:])
            rs = None if residual is None else residual.reshape(ys.shape)
            stride, dil, lo, hi = (1, *stride), (1, *dil), (0, *lo), (0, *hi)
        if spec.transpose:
            ws = self.dgrad_weights(ws, spec.groups)
        ptrs = {"x": xs.data.ptr, "w": ws.data.ptr, "y": ys.data.ptr}
        if bias is not None:
            ptrs["b"] = bias.data.ptr
        if rs is not None:
            ptrs["r"] = rs.data.ptr
        aligned = tuple(ptrs.get(r, 0) % 16 == 0 for r in ("x", "w", "y", "b", "r"))
        pk = PlanKey(self.device_id, key.dtype, "dgrad" if spec.transpose else "fprop", tuple(xs.shape),
                     tuple(ws.shape), tuple(ys.shape), tuple(stride), tuple(lo), tuple(hi), tuple(dil),
                     spec.groups, spec.transpose, key.epilogue, aligned)
        fresh = pk not in self.plan_cache
        if fresh:  # building (and autotuning) a plan is eager-only work
            self.capture.require_eager(f"no cached cuDNN plan for {pk.kind} {pk.x_shape}")
        entry = self.plan_cache.get(pk, lambda: self.builder.build(pk, ptrs, self.workspace_ptr))
        if isinstance(entry, Fallback):
            return self.run_gemm(x, w, key, bias, residual, activation)
        plan = entry.plan
        self.capture.keep(plan)  # the captured kernels may live in the plan (runtime-compiled engines)
        try:
            self.builder.execute(plan, ptrs, self.workspace_ptr(plan.workspace), cp.cuda.get_current_stream().ptr)
        except Exception as exc:
            if not fresh:
                raise
            # cuDNN built a plan it then would not run (MLX conv.cpp treats this the same way)
            log.info("cuDNN plan for %s failed its first execution (%s); caching FALLBACK", pk, exc)
            self.plan_cache.demote(pk, f"first execution failed: {exc}")
            return self.run_gemm(x, w, key, bias, residual, activation)
        fb, fa, fr = plan.fused
        rest_b = None if fb else bias
        rest_a = None if fa else activation
        rest_r = None if fr else residual
        if rest_b is not None or rest_a is not None or rest_r is not None:
            self.arrays.kernels(key.dtype).epilogue(out, rest_b, rest_r, rest_a, out=out)
        return out, "cudnn"

    def run_gemm(self, x, w, key: ConvKey, bias, residual, activation):
        # the products through cuBLAS's C API on the backend's handle: capturable, unlike cp.matmul
        conv = conv_transpose_col2im if key.spec.transpose else conv_unfold_gemm
        out32, tiled = conv(self.xp, self.arrays.f32(x), self.arrays.f32(w), key.spec, key.out_shape,
                            self.unfold_limit_bytes, matmul=self.blas.matmul)
        out = self.arrays.cast(out32, key.dtype)
        if bias is not None or residual is not None or activation is not None:
            self.arrays.kernels(key.dtype).epilogue(out, bias, residual, activation, out=out)
        return out, ("tiled_unfold" if tiled else "gemm_fallback")

    def run_depthwise(self, x, w, key: ConvKey, bias, residual, activation):
        wt = self.depthwise_weights(w)
        spec = key.spec
        out = self.arrays.kernels(key.dtype).depthwise2d(x, wt, bias, residual, activation, spec.stride,
                                                         tuple(p[0] for p in spec.padding), spec.dilation,
                                                         key.out_shape)
        return out, "depthwise_direct"

    def run_grouped_pointwise(self, x, w, key: ConvKey, bias, residual, activation):
        cp, i32 = self.cp, np.int32
        g, x, w = key.spec.groups, self.arrays.contiguous(x), self.arrays.contiguous(w)
        out = cp.empty(key.out_shape, dtype=storage_dtype(key.dtype))
        pixels = out.size // out.shape[-1]
        b = x if bias is None else bias
        r = x if residual is None else self.arrays.contiguous(residual)
        self.arrays.kernels(key.dtype).fn("grouped_pw")((-(-pixels // GP_TT), g), (BLOCK,), (
            x, w, b, r, out, np.int64(pixels), i32(g), i32(key.in_channels // g), i32(key.out_channels // g),
            i32(bias is not None), i32(residual is not None), i32(ACT_CODES[activation])))
        return out, "grouped_pointwise"

    def run_small_kd(self, x, w, key: ConvKey, bias, residual, activation):
        """3D conv as kD accumulated 2D convs over frames (each partial sum fused as the next
        conv's residual); activation and the caller's residual run after the sum."""
        cp = self.cp
        spec = key.spec
        st, dt = spec.stride[0], spec.dilation[0]
        lo, hi = spec.padding[0]
        if lo or hi:
            x = cp.pad(x, ((0, 0), (lo, hi), (0, 0), (0, 0), (0, 0)))
        n = x.shape[0]
        t_out = key.out_shape[1]
        spec2 = ConvSpec(spec.stride[1:], spec.padding[1:], spec.dilation[1:], spec.groups)
        acc = None
        for kd in range(key.kernel[0]):
            t0 = kd * dt
            frames = cp.ascontiguousarray(x[:, t0:t0 + (t_out - 1) * st + 1:st])
            frames = frames.reshape(n * t_out, *frames.shape[2:])
            wk = cp.ascontiguousarray(w[:, kd])
            key2 = ConvKey("conv2d", tuple(frames.shape), tuple(wk.shape), key.dtype, spec2,
                           (kd == 0 and bias is not None, acc is not None, None))
            acc, _ = self.run_cudnn(frames, wk, key2, bias if kd == 0 else None, acc, None)
        out = acc.reshape(key.out_shape)
        if activation is not None or residual is not None:
            self.arrays.kernels(key.dtype).epilogue(out, None, residual, activation, out=out)
        return out, "small_kd_2d"

    # ---- weights in the layouts the runners read ------------------------------------------------
    def depthwise_weights(self, w):
        """(C,KH,KW,1) -> (KH,KW,C), once per weight buffer."""
        return self.weights.get("depthwise", w, lambda v: self.cp.ascontiguousarray(
            v.reshape(v.shape[0], -1).T).reshape(*v.shape[1:-1], v.shape[0]))

    def dgrad_weights(self, w, groups: int):
        """A transposed conv's weight in cuDNN's dgrad filter layout, once per weight buffer:
        (Cin, *k, O/g) with F[g*cg + c, k, o] = w[g*og + o, k, c]."""
        def relayout(v):
            o_ch, cg = v.shape[0], v.shape[-1]
            kdims = v.shape[1:-1]
            nk = len(kdims)
            return self.cp.ascontiguousarray(
                v.reshape(groups, o_ch // groups, *kdims, cg).transpose(0, nk + 2, *range(2, nk + 2), 1)
            ).reshape(groups * cg, *kdims, o_ch // groups)
        return self.weights.get(("dgrad", groups), w, relayout)
