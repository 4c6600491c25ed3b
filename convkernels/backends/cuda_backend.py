"""The CUDA backend: CuPy arrays, convolutions through cuDNN frontend graphs (plan cache with a
cached FALLBACK answer -> gemm_fallback), the rest as CuPy kernels (cuda_kernels.py).

Arrays: cupy.ndarray, channels-last. float16 and float32 are CuPy dtypes; bfloat16 has no CuPy
dtype, so bfloat16 tensors are uint16 arrays of bf16 bit patterns (dtype_of reports
'bfloat16'; to_host returns float32, which holds every bf16 value exactly). Host <-> device
copies happen only in asarray / to_host.

Conv paths: `cudnn` (plan cache), `gemm_fallback` / `tiled_unfold` (CuPy im2col +
cuBLAS in float32, for keys cuDNN refuses or with force_fallback=True), `small_kd_2d` (3D conv
as kD accumulated 2D cuDNN convs) and `depthwise_direct` (our depthwise 2-d kernel with the
epilogue fused); the last two are chosen only by measurement (autotune=True). The metric label
is the path that actually ran: a `cudnn` choice whose key has the FALLBACK marker counts as
`gemm_fallback` (or `tiled_unfold`).

Latency: sampled convs get a pair of CUDA events on the current stream; flush_timings() reads
them after the batch (no synchronisation per conv).

Matmuls (linear, attention, gemm_fallback's products) go through cuBLAS's C API on the backend's
own handle (cuda_blas.py), never CuPy's cuBLAS: that is what lets `graphed` forwards be captured
as CUDA graphs (cuda_graphs.py; on unless cuda_graphs=False).
"""
from __future__ import annotations

import logging
import statistics
import threading
from collections import Counter, OrderedDict
from contextlib import contextmanager

import numpy as np

from ..backend import BackendBase
from ..paths import ConvPath
from ..spec import ConvKey, ConvSpec, prod, upsample_conv_as_transpose
from . import cuda_gemm
from .cuda_blas import Cublas
from .cuda_blas_lt import CublasLt, CublasLtError, lt_epilogue
from .cuda_cudnn import CudnnConvBuilder
from .cuda_graphs import DEFAULT_CAPACITY as GRAPH_CAPACITY
from .cuda_graphs import DEFAULT_MAX_GRAPH_BYTES
from .cuda_graphs import CaptureMissed, GraphCache, GraphedForward
from .cuda_kernels import Kernels, dw_ln_applies
from .cuda_plan_cache import DEFAULT_CAPACITY, Fallback, PlanCache, PlanKey, PlanStore
from .cuda_transfer import axis_blocks, copy_into, start_to_host

log = logging.getLogger("convkernels.cuda")

DEFAULT_UNFOLD_LIMIT = 1 << 30          # bytes of one im2col / col2im buffer in gemm_fallback
ATTENTION_SCORE_BYTES = 256 << 20        # bound on one chunk of attention scores
MAX_PENDING_TIMINGS = 8192


_DTYPE_NAMES = {np.dtype(np.uint16): "bfloat16", np.dtype(np.float16): "float16", np.dtype(np.float32): "float32",
                np.dtype(np.float64): "float64"}
_STORAGE = {"bfloat16": np.dtype(np.uint16), "float16": np.dtype(np.float16), "float32": np.dtype(np.float32)}


class CudaBackend(BackendBase):
    name = "cuda"
    supported_dtypes = ("float16", "bfloat16", "float32")
    runs_ahead = True
    path_memo_events = False  # the plan cache emits the plan cache events

    def __init__(self, dtype: str = "float16", device: int = 0, plan_cache_capacity: int | None = None,
                 plan_cache_dir: str | None = None, unfold_limit_bytes: int | None = None,
                 force_fallback: bool = False, autotune: bool = False, autotune_max_plans: int = 4,
                 allow_tf32: bool = False, timing_sample_rate: float = 0.1, cuda_graphs: bool = True,
                 graph_capacity: int = GRAPH_CAPACITY, graph_max_bytes: int = DEFAULT_MAX_GRAPH_BYTES,
                 dw_ln: bool = False, dw_bias_in_ln: bool = True, lt_epilogues: bool = True,
                 lt_gelu_approx: bool = True, ln_vec: bool = True):
        import cupy as cp
        import cudnn

        self.cp = cp
        self.cudnn = cudnn
        self.device_id = int(device)
        self.device = cp.cuda.Device(self.device_id)
        self.device.use()
        props = cp.cuda.runtime.getDeviceProperties(self.device_id)
        name = props["name"]
        self.gpu_name = name.decode() if isinstance(name, bytes) else str(name)
        # a quarter of the card per model call: at 1 GiB (the CPU default) the service decoded
        # SD-VAE 512 in nine 256-px tiles on an 80 GB H100 (72 ms a request instead of 7)
        self.work_memory_budget = int(props["totalGlobalMem"]) // 4
        self.cudnn_version = str(cudnn.backend_version())
        self.unfold_limit_bytes = int(unfold_limit_bytes or DEFAULT_UNFOLD_LIMIT)
        # the service passes CONVSERVE_CUDA_AUTOTUNE (Settings.backend_options)
        self.autotune = bool(autotune)
        self.allow_tf32 = bool(allow_tf32)
        # whole forwards replayed as CUDA graphs from their second call (cuda_graphs.py); the
        # service passes CONVSERVE_CUDA_GRAPHS / CONVSERVE_CUDA_GRAPH_CAPACITY
        self.cuda_graphs = bool(cuda_graphs)
        self.graph_capacity = int(graph_capacity)
        self.graphs = GraphCache(self.graph_capacity, self.name, graph_max_bytes)
        self._graph_lock = threading.RLock()
        # ConvNeXt block fusions, on/off for A/B runs (benchmarks/convnext_fusion_ab.py); the
        # defaults are the measured best. The service passes CONVSERVE_CUDA_DW_LN,
        # CONVSERVE_CUDA_DW_BIAS_IN_LN, CONVSERVE_CUDA_LT_EPILOGUES, CONVSERVE_CUDA_LT_GELU_APPROX
        # and CONVSERVE_CUDA_LN_VEC (Settings.backend_options)
        self.dw_ln = bool(dw_ln)                    # depthwise conv + bias + LayerNorm as one kernel
        self.dw_bias_in_ln = bool(dw_bias_in_ln)    # else the LayerNorm adds the depthwise conv's bias
        self.lt_epilogues = bool(lt_epilogues)      # linear bias / GELU / residual inside cuBLASLt
        self.lt_gelu_approx = bool(lt_gelu_approx)  # cuBLASLt's tanh GELU for erf GELU, float16 only
        self.ln_vec = bool(ln_vec)                  # ln_rows_vec (row in registers) where it applies
        self._tls = threading.local()
        # matmuls through cuBLAS's C API: CuPy's cuBLAS calls cannot be captured (cuda_blas.py)
        self.blas = Cublas(cp, allow_tf32=self.allow_tf32)
        self.handle = cudnn.create_handle()
        self.builder = CudnnConvBuilder(cudnn, self.handle, allow_tf32=self.allow_tf32, autotune=self.autotune,
                                        autotune_max_plans=autotune_max_plans)
        store = PlanStore(plan_cache_dir, self.gpu_name, self.cudnn_version) if plan_cache_dir else None
        capacity = plan_cache_capacity or DEFAULT_CAPACITY
        self.plan_cache = PlanCache(capacity, self.name, store=store, serializer=self.builder)
        self._ws = None
        self._copy_stream = None  # device -> host copies of to_host_async
        self._pending: list = []
        self._event_pool: list = []
        self._timing_lock = threading.Lock()
        self.measurements: dict = {}
        self._dw_cache: OrderedDict = OrderedDict()
        super().__init__(dtype, timing_sample_rate)
        if force_fallback:
            self.paths.forced = "gemm_fallback"

    # ---- arrays -------------------------------------------------------------------------------
    def asarray(self, host, dtype=None):
        """Host array -> device array in `dtype`. The host array crosses as it is (float16 or
        float32) and is cast on the device: NumPy's host-side casts would cost more than the copy."""
        dt = dtype or self.dtype
        if dt not in self.supported_dtypes:
            raise ValueError(f"cuda backend: unsupported dtype {dt!r}; use one of {self.supported_dtypes}")
        host = np.asarray(host)
        if host.dtype.kind != "f" and str(host.dtype) != "bfloat16" and host.dtype != np.uint8:
            raise ValueError(f"cuda backend: expected a floating or uint8 array, got dtype {host.dtype}")
        # uint8 (8-bit pixels) crosses as bytes and is widened on the device, exactly (0..255)
        if host.dtype not in (np.float16, np.float32, np.uint8):  # float64, ml_dtypes bfloat16
            host = host.astype(np.float32)
        dev = self.cp.asarray(np.ascontiguousarray(host))
        return self._as(dev, dt)

    def to_host(self, x) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        return self.cp.asnumpy(self._widened(x, fresh=False))

    def to_host_async(self, x, clip=None, *, uint8=False):
        """The copy runs on a side stream into pinned memory, after the work queued so far: the
        caller queues its next chunk before it waits (Wan's decode overlaps each frame group's
        copy and host work with the next group's kernels). clip: done by the widening kernel.
        uint8: one kernel reads x, widens, clips, scales and rounds to uint8 (pixels_to_uint8),
        and a quarter of float32's bytes (half of float16's) cross."""
        if isinstance(x, np.ndarray):
            return super().to_host_async(x, clip, uint8=uint8)
        if self._copy_stream is None:
            self._copy_stream = self.cp.cuda.Stream(non_blocking=True)
        out = self._as_uint8(x) if uint8 else self._widened(x, fresh=True, clip=clip)
        return start_to_host(self.cp, self._copy_stream, out)

    def _as_uint8(self, x):
        """x as a new contiguous uint8 array of 8-bit pixels: pixels_to_uint8 of the float32
        values _widened would give, in one kernel (float64 and the like: CuPy's cast first)."""
        if x.dtype not in _STORAGE.values():
            return self._k("float32").to_u8(self._c(x.astype(np.float32)))
        return self._k(self.dtype_of(x)).to_u8(self._c(x))

    def _widened(self, x, fresh: bool, clip=None):
        """x as contiguous float32 for the host, clipped to clip = (lo, hi) when given; fresh:
        never x itself (its buffer may be reused while an async copy still reads the result).
        Widening on the device: NumPy's float16 -> float32 cast has no SIMD path and cost 4 ms of
        a 9 ms SD-VAE 512 decode on the H100's host; the copy of twice the bytes costs less."""
        if x.dtype == np.float32 and clip is None and not fresh:
            return self._c(x)
        if x.dtype not in _STORAGE.values():  # float64 and the like: CuPy's own cast and clip
            y = x.astype(np.float32)
            return y if clip is None else self.cp.clip(y, clip[0], clip[1], out=y)
        return self._k(self.dtype_of(x)).to_f32(self._c(x), clip)

    def dtype_of(self, x) -> str:
        name = _DTYPE_NAMES.get(x.dtype)
        return name if name is not None else str(x.dtype)

    def _storage(self, dt: str):
        return np.uint16 if dt == "bfloat16" else np.dtype(dt)

    def _k(self, dt: str) -> Kernels:
        return Kernels.for_dtype(dt)

    def _c(self, x):
        return self.cp.ascontiguousarray(x)

    def _as(self, x, dt: str):
        """x in storage dtype `dt` (contiguous)."""
        if x is None:
            return None
        if x.dtype == _STORAGE[dt] and x.flags.c_contiguous:
            return x
        x = self._c(x)
        src = self.dtype_of(x)
        if src == dt:
            return x
        if src == "bfloat16":
            x = self._k(src).to_f32(x)
        if dt == "bfloat16":
            return self._k(dt).from_f32(self._c(x.astype(np.float32, copy=False)), np.uint16)
        return x.astype(dt)

    def _f32(self, x):
        return self._as(x, "float32")

    def synchronize(self) -> None:
        self.cp.cuda.get_current_stream().synchronize()

    # ---- timing ---------------------------------------------------------------------------------
    def _event(self):
        return self._event_pool.pop() if self._event_pool else self.cp.cuda.Event()

    def flush_timings(self) -> None:
        """Harvest sampled conv times. Call after the batch's output reached the host (the
        events are complete then, so this does not wait on the device)."""
        with self._timing_lock:
            pending, self._pending = self._pending, []
        for op, path, start, end in pending:
            end.synchronize()
            self._conv_metrics(op, path)[1].observe(self.cp.cuda.get_elapsed_time(start, end) / 1e3)
            self._event_pool += [start, end]

    # ---- convolutions ---------------------------------------------------------------------------
    def _conv_operands(self, op, x, w, bias, residual):
        """Every operand in the storage dtype of x (one of supported_dtypes), contiguous."""
        dt = self.dtype_of(x)
        if dt not in _STORAGE:
            raise ValueError(f"{op}: the cuda backend computes in {self.supported_dtypes}, got {dt}")
        return self._as(x, dt), self._as(w, dt), self._as(bias, dt), self._as(residual, dt)

    def _run(self, path, key, x, w, bias, residual, activation):
        """Runs the path and counts the path that actually ran (a `cudnn` choice whose key has the
        FALLBACK marker runs gemm_fallback)."""
        op = key.op
        recorded = getattr(self._tls, "calls", None)  # a CUDA graph capture is under way
        sampled = recorded is None and self._sampled()
        if sampled:
            start = self._event()
            start.record()
        out, used = path.run(x, w, key, bias, residual, activation)
        if recorded is not None:
            recorded.append((op, used))  # counted at each replay, not at capture
        else:
            self._conv_metrics(op, used)[0].inc()
        if sampled:
            end = self._event()
            end.record()
            with self._timing_lock:
                self._pending.append((op, used, start, end))
                if len(self._pending) > MAX_PENDING_TIMINGS:  # never flushed: keep memory bounded
                    self._pending = self._pending[-MAX_PENDING_TIMINGS:]
        return out

    # ---- CUDA graphs ------------------------------------------------------------------------------
    @property
    def calls_to_warm(self) -> int:
        return 2 if self.cuda_graphs else 1

    def graphed(self, fn):
        return GraphedForward(self, fn, self.graphs, self._graph_lock) if self.cuda_graphs else fn

    def bind_stream(self, stream) -> None:
        """Point the cuBLAS and cuDNN handles at `stream` before a capture begins on it: their
        stream is set outside the capture, as in the probes that captured them successfully."""
        self.blas.bind(stream.ptr)
        if self.handle.stream != stream.ptr:
            self.cudnn.set_stream(handle=self.handle, stream=stream.ptr)

    def capturing(self) -> bool:
        return getattr(self._tls, "calls", None) is not None

    @contextmanager
    def recording_calls(self):
        """While a graph is captured on this thread: convs are listed (op, path), not counted or
        timed; device buffers the captured work keeps using (the cuDNN workspace) are listed for
        the graph to hold. Yields (calls, kept_buffers)."""
        calls: list = []
        keep: list = []
        self._tls.calls, self._tls.keep = calls, keep
        keep.append(self.blas.workspace)  # replaced never, but held like the cuDNN workspace
        lt = getattr(self, "_lt_state", (None,))[0]
        if lt is not None:
            keep.append(lt.workspace)
        try:
            yield calls, keep
        finally:
            self._tls.calls = self._tls.keep = None

    def count_calls(self, calls: Counter) -> None:
        for (op, path), n in calls.items():
            self._conv_metrics(op, path)[0].inc(n)

    def conv_paths(self) -> list[ConvPath]:
        def small_kd(k: ConvKey) -> bool:
            return k.op == "conv3d" and 1 < k.kernel[0] <= 4

        def exceeds(k: ConvKey) -> bool:
            return cuda_gemm.unfold_bytes(k.x_shape, k.w_shape, k.out_shape, k.spec) > self.unfold_limit_bytes

        def depthwise_2d(k: ConvKey) -> bool:
            return k.op == "conv2d" and k.is_depthwise

        return [
            ConvPath("cudnn", lambda k: True, lambda k: 1.0, self._run_cudnn),
            # our own kernel; taken where autotune measures it faster than cuDNN's plan
            ConvPath("depthwise_direct", depthwise_2d, lambda k: 1.5, self._run_depthwise),
            # static rule: native cuDNN 3D wins on the H100 (measured); only measurement picks this
            ConvPath("small_kd_2d", small_kd, lambda k: 2.0, self._run_small_kd),
            ConvPath("gemm_fallback", lambda k: True, lambda k: 1e9, self._run_gemm),
            ConvPath("tiled_unfold", exceeds, lambda k: 2e9, self._run_gemm),
        ]

    def measure_paths(self):
        return self._measure

    def _measure(self, key: ConvKey, valid: list[ConvPath]) -> ConvPath:
        static = min(valid, key=lambda p: p.cost(key))
        contenders = [p for p in valid if p.name in ("cudnn", "small_kd_2d", "depthwise_direct")]
        if not self.autotune or len(contenders) < 2:
            return static
        if self.capturing():  # timing synchronises with the host: not inside a capture
            raise CaptureMissed(f"path choice for a new {key.op} key")
        cp = self.cp
        rng = cp.random.default_rng()

        def rand(shape):
            return self._as(rng.standard_normal(shape, dtype=cp.float32), key.dtype)
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

    def _workspace(self, nbytes: int) -> int:
        if self._ws is None or self._ws.nbytes < max(1, nbytes):
            self._ws = self.cp.empty(max(256, nbytes), dtype=self.cp.uint8)
        keep = getattr(self._tls, "keep", None)
        if keep is not None and not any(k is self._ws for k in keep):
            # a captured graph writes this scratch on every replay: it must outlive a later,
            # larger workspace replacing it here, or the replays scribble on whatever reuses it
            keep.append(self._ws)
        return self._ws.data.ptr

    def _run_cudnn(self, x, w, key: ConvKey, bias, residual, activation):
        cp = self.cp
        spec = key.spec
        out = cp.empty(key.out_shape, dtype=self._storage(key.dtype))
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
            ws = self._dgrad_weights(ws, spec.groups)
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
        if fresh and self.capturing():  # building (and autotuning) a plan is eager-only work
            raise CaptureMissed(f"no cached cuDNN plan for {pk.kind} {pk.x_shape}")
        entry = self.plan_cache.get(pk, lambda: self.builder.build(pk, ptrs, self._workspace))
        if isinstance(entry, Fallback):
            return self._run_gemm(x, w, key, bias, residual, activation)
        plan = entry.plan
        keep = getattr(self._tls, "keep", None)
        if keep is not None:  # the captured kernels may live in the plan (runtime-compiled engines)
            keep.append(plan)
        try:
            self.builder.execute(plan, ptrs, self._workspace(plan.workspace), cp.cuda.get_current_stream().ptr)
        except Exception as exc:
            if not fresh:
                raise
            # cuDNN built a plan it then would not run (MLX conv.cpp treats this the same way)
            log.info("cuDNN plan for %s failed its first execution (%s); caching FALLBACK", pk, exc)
            self.plan_cache.demote(pk, f"first execution failed: {exc}")
            return self._run_gemm(x, w, key, bias, residual, activation)
        fb, fa, fr = plan.fused
        rest_b = None if fb else bias
        rest_a = None if fa else activation
        rest_r = None if fr else residual
        if rest_b is not None or rest_a is not None or rest_r is not None:
            self._k(key.dtype).epilogue(out, rest_b, rest_r, rest_a, out=out)
        return out, "cudnn"

    def _run_gemm(self, x, w, key: ConvKey, bias, residual, activation):
        fn = cuda_gemm.conv_transpose if key.spec.transpose else cuda_gemm.conv_forward
        out32, tiled = fn(self.cp, self._f32(x), self._f32(w), key.spec, key.out_shape, self.unfold_limit_bytes,
                          matmul=self.blas.matmul)
        out = self._as(out32, key.dtype)
        if bias is not None or residual is not None or activation is not None:
            self._k(key.dtype).epilogue(out, bias, residual, activation, out=out)
        return out, ("tiled_unfold" if tiled else "gemm_fallback")

    def _run_depthwise(self, x, w, key: ConvKey, bias, residual, activation):
        wt = self._dw_weights(w)
        spec = key.spec
        out = self._k(key.dtype).depthwise2d(x, wt, bias, residual, activation, spec.stride,
                                             tuple(p[0] for p in spec.padding), spec.dilation, key.out_shape)
        return out, "depthwise_direct"

    def _dw_weights(self, w):
        """(C,KH,KW,1) -> (KH,KW,C), once per weight buffer."""
        return self._derived_weights("depthwise", w, lambda v: self.cp.ascontiguousarray(
            v.reshape(v.shape[0], -1).T).reshape(*v.shape[1:-1], v.shape[0]))

    def _dgrad_weights(self, w, groups: int):
        """A transposed conv's weight in cuDNN's dgrad filter layout, once per weight buffer (a
        model's weights never change; re-laying them out cost a copy per call):
        (Cin, *k, O/g) with F[g*cg + c, k, o] = w[g*og + o, k, c]."""
        def relayout(v):
            o_ch, cg = v.shape[0], v.shape[-1]
            kdims = v.shape[1:-1]
            nk = len(kdims)
            return self.cp.ascontiguousarray(
                v.reshape(groups, o_ch // groups, *kdims, cg).transpose(0, nk + 2, *range(2, nk + 2), 1)
            ).reshape(groups * cg, *kdims, o_ch // groups)
        return self._derived_weights(("dgrad", groups), w, relayout)

    def _derived_weights(self, kind, w, derive):
        """derive(w), cached per (kind, weight buffer), LRU. The entry keeps the weight array
        alive, so its pointer cannot be reused by another array while cached. Filled by a
        model's first (eager) forward, so a CUDA graph captured later only reads it."""
        k = (kind, w.data.ptr, w.shape, w.dtype.str)
        hit = self._dw_cache.get(k)
        if hit is not None:
            self._dw_cache.move_to_end(k)
            return hit[1]
        wt = derive(w)
        if self.capturing():  # wt lives in the graph's pool: an entry would outlive an evicted graph
            return wt
        self._dw_cache[k] = (w, wt)
        if len(self._dw_cache) > 512:
            self._dw_cache.popitem(last=False)
        return wt

    def _run_small_kd(self, x, w, key: ConvKey, bias, residual, activation):
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
            acc, _ = self._run_cudnn(frames, wk, key2, bias if kd == 0 else None, acc, None)
        out = acc.reshape(key.out_shape)
        if activation is not None or residual is not None:
            self._k(key.dtype).epilogue(out, None, residual, activation, out=out)
        return out, "small_kd_2d"

    # ---- normalisation and activations -------------------------------------------------------
    def _group_norm(self, x, num_groups, weight, bias, eps, activation):
        dt = self.dtype_of(x)
        return self._k(dt).group_norm(self._c(x), num_groups, self._as(weight, dt), self._as(bias, dt), eps,
                                      activation)

    def _layer_norm(self, x, weight, bias, eps, activation):
        dt = self.dtype_of(x)
        return self._k(dt).layer_norm(self._c(x), self._as(weight, dt), self._as(bias, dt), eps, activation,
                                      vectorised=self.ln_vec)

    def depthwise_conv_layer_norm(self, x, w, bias, norm_w, norm_b, eps: float):
        """LayerNorm(depthwise 'same' stride-1 conv2d(x, w) + bias) over channels (ConvNeXt's
        block), or None where this does not apply (the caller runs conv2d then layer_norm):
        - dw_ln=True: one kernel (dw_ln; the conv output never goes to memory). Off by
          default: our depthwise kernel against cuDNN's is a measured choice
          (benchmarks/convnext_fusion_ab.py).
        - else: cuDNN's conv without the bias, which the LayerNorm kernel adds as it reads the
          conv output. A depthwise conv + bias graph may build only unfused (then the bias costs a
          pass of its own) or on a slower fusion engine; the bare depthwise conv is the one
          measured equal to PyTorch's. dw_bias_in_ln=False turns it off."""
        dt = self.dtype_of(x)
        if dt not in _STORAGE or x.ndim != 4 or w.ndim != 4 or norm_w is None or norm_b is None:
            return None
        c = int(x.shape[-1])
        kernel = (int(w.shape[1]), int(w.shape[2]))
        if tuple(w.shape) != (c, *kernel, 1) or kernel[0] % 2 == 0 or kernel[1] % 2 == 0:
            return None
        x, w = self._as(x, dt), self._as(w, dt)
        nw, nb, b = self._as(norm_w, dt), self._as(norm_b, dt), self._as(bias, dt)
        if nw.shape != (c,) or nb.shape != (c,) or (b is not None and b.shape != (c,)):
            return None
        pad = (kernel[0] // 2, kernel[1] // 2)
        if self.dw_ln:
            ptrs = [v.data.ptr for v in (x, w, nw, nb, b) if v is not None]
            wt = self._dw_weights(w) if dw_ln_applies(c, x.itemsize, kernel, tuple(w.shape), ptrs) else None
            if wt is not None and wt.data.ptr % 16 == 0:
                recorded = getattr(self._tls, "calls", None)
                if recorded is not None:
                    recorded.append(("conv2d", "depthwise_layer_norm"))
                else:
                    self._conv_metrics("conv2d", "depthwise_layer_norm")[0].inc()
                return self._k(dt).depthwise_layer_norm(x, wt, b, nw, nb, float(eps), pad)
        if b is None or not self.dw_bias_in_ln:
            return None
        h = self.conv2d(x, w, None, padding=pad, groups=c)
        return self._k(dt).layer_norm(self._c(h), nw, nb, float(eps), None, input_bias=b, vectorised=self.ln_vec)

    def _rms_norm(self, x, weight, eps, activation):
        # one kernel: the base class's layer_norm route concatenates [x, -x] (copies) and
        # runs in bands
        dt = self.dtype_of(x)
        return self._k(dt).rms_norm(self._c(x), self._as(weight, dt), eps, activation)

    def _rms_norm_after(self, prefix, x, weight, eps, activation):
        # the kernel writes behind the prefix frames: no joined copy of the norm's output
        if not axis_blocks(x.shape, 1):
            return super()._rms_norm_after(prefix, x, weight, eps, activation)
        cp, dt = self.cp, self.dtype_of(x)
        t0 = prefix.shape[1]
        out = cp.empty((x.shape[0], t0 + x.shape[1], *x.shape[2:]), dtype=x.dtype)
        copy_into(cp, out[:, :t0], prefix)
        self._k(dt).rms_norm(self._c(x), self._as(weight, dt), eps, activation, out=out[:, t0:])
        return out

    def _activation(self, x, activation):
        return self._k(self.dtype_of(x)).epilogue(self._c(x), None, None, activation)

    def _linear(self, x, weight, bias, residual, activation):
        dt = self.dtype_of(x)
        lead = tuple(x.shape[:-1])
        fused = self._linear_fused(x, weight, bias, residual, activation, dt)
        if fused is not None:
            return fused.reshape(*lead, weight.shape[0])
        out = self._matmul(self.reshape(x, (-1, x.shape[-1])), self.transpose(self._as(weight, dt), (1, 0)))
        out = self._c(out)
        res = None if residual is None else self._as(residual, dt).reshape(out.shape)
        if bias is not None or res is not None or activation is not None:
            self._k(dt).epilogue(out, self._as(bias, dt), res, activation, out=out)
        return out.reshape(*lead, weight.shape[0])

    def _blas_lt(self):
        """The cuBLASLt fused-linear handle, made on first use outside a capture (its workspace
        must not come from a graph's pool); None where fused linears are off or unavailable.
        lt_epilogues=False turns them off (A/B against gemm + epilogue kernel)."""
        state = getattr(self, "_lt_state", None)
        if state is None:
            if self.capturing():
                raise CaptureMissed("cuBLASLt handle not made yet")
            lt = None
            if self.lt_epilogues:
                try:
                    lt = CublasLt(self.cp, allow_tf32=self.allow_tf32)
                except (OSError, AttributeError, CublasLtError) as exc:  # no library, an old one
                    log.warning("cuBLASLt unavailable (%s): linear layers run gemm + epilogue kernel", exc)
            # the tanh GELU for erf-GELU layers in float16 (cuda_blas_lt.py says why);
            # lt_gelu_approx=False keeps those layers on the exact erf epilogue kernel
            approx = self.lt_gelu_approx
            state = self._lt_state = (lt, approx)
        return state

    def _linear_fused(self, x, weight, bias, residual, activation, dt):
        """act(x @ W^T + bias) + residual as one cuBLASLt call, or None (no such epilogue, mixed
        dtypes, cuBLASLt off or without an algorithm): the caller runs gemm + epilogue kernel."""
        if bias is None and residual is None and activation is None:
            return None  # a plain matmul: cuBLAS already does it in one call
        if dt not in _STORAGE:
            return None
        lt, approx = self._blas_lt()
        if lt is None:
            return None
        if dt == "float32" and activation in ("gelu", "gelu_tanh"):
            return None  # float32 answers to 1e-5: cuBLASLt's GELU is not promised that close
        epilogue = lt_epilogue(bias is not None, activation, residual is not None, approx and dt == "float16")
        if epilogue is None:
            return None
        x2 = self._c(self._as(x, dt).reshape(-1, x.shape[-1]))
        w = self._c(self._as(weight, dt))
        b = None if bias is None else self._c(self._as(bias, dt))
        r = None if residual is None else self._c(self._as(residual, dt)).reshape(x2.shape[0], w.shape[0])
        try:
            return lt.linear(x2, w, b, r, epilogue, allow_new=not self.capturing())
        except LookupError as exc:
            raise CaptureMissed(str(exc)) from exc

    # ---- resampling and padding ----------------------------------------------------------------
    def _upsample_nearest(self, x, scale):
        cp = self.cp
        nd = len(scale)
        expanded, target = [x.shape[0]], [x.shape[0]]
        for i in range(nd):
            expanded += [x.shape[1 + i], 1]
            target += [x.shape[1 + i], scale[i]]
        expanded.append(x.shape[-1])
        target.append(x.shape[-1])
        out = cp.ascontiguousarray(cp.broadcast_to(self._c(x).reshape(expanded), target))
        return out.reshape(x.shape[0], *(x.shape[1 + i] * scale[i] for i in range(nd)), x.shape[-1])

    def _upsample_conv2d(self, x, weight, bias):
        # the equivalent stride-2 transposed conv: one cuDNN dgrad writes the four output phases
        # interleaved, 4 instead of 9 taps per output and no 4x-size upsampled input (measured:
        # conv_transpose2d k4 s2 2.3-3.6x faster than nearest + 3x3 on the H100)
        dt = self.dtype_of(x)
        w4 = self._derived_weights("upsample_as_transpose", weight, lambda v: self._as(
            upsample_conv_as_transpose(self.cp, self._f32(v)), dt))
        return self.conv_transpose2d(x, w4, bias, stride=2, padding=1)

    def _pad(self, x, pads, mode):
        width = ((0, 0), *pads, (0, 0))
        if mode == "zeros":  # zero bits are 0.0 in every storage dtype, bf16 included
            return self.cp.pad(x, width, mode="constant")
        return self.cp.pad(x, width, mode="edge")

    # ---- dense ops -----------------------------------------------------------------------------
    def _binary(self, a, b, fn):
        """a (op) b with NumPy broadcasting; either side may be a Python scalar."""
        bf16 = [getattr(v, "dtype", None) == np.uint16 for v in (a, b)]
        if any(bf16):
            a, b = (self._f32(v) if hasattr(v, "dtype") else v for v in (a, b))
            return self._as(fn(a, b), "bfloat16")
        return fn(a, b)

    def _matmul(self, a, b):
        if a.dtype != b.dtype:  # mixed storage dtypes: float32, and bfloat16 if either side was
            bf16 = np.dtype(np.uint16) in (a.dtype, b.dtype)
            out = self._mm(self._f32(a), self._f32(b))
            return self._as(out, "bfloat16") if bf16 else out
        return self._mm(a, b)

    def add(self, a, b):
        return self._binary(a, b, self.cp.add)

    def mul(self, a, b):
        return self._binary(a, b, self.cp.multiply)

    def _softmax(self, x, axis):
        dt = self.dtype_of(x)
        axis = axis % x.ndim
        moved = axis != x.ndim - 1
        xs = self._c(self.cp.moveaxis(x, axis, -1) if moved else x)
        y = self._k(dt).softmax_rows(xs)
        return self._c(self.cp.moveaxis(y, -1, axis)) if moved else y

    def _mm(self, a, b):
        """cuBLAS through its C API (cuda_blas.py; bfloat16 as bfloat16): capturable into a CUDA
        graph, unlike cp.matmul. Transposed views stay views (cuBLAS takes them as op T) and
        batches are one strided-batched call."""
        if a.dtype == b.dtype and a.dtype in _STORAGE.values():
            return self.blas.matmul(a, b)
        return self.blas.matmul(self._f32(a), self._f32(b))  # float64: no compute dtype here, never in a model

    def _attention(self, q, k, v, scale):
        """softmax(q k^T * scale) v, query rows in chunks so the score matrix stays bounded.
        float16 multiplies in float16 (cuBLAS, float32 accumulate); bfloat16 computes in float32."""
        cp = self.cp
        dt = self.dtype_of(q)
        work = "float32" if dt == "bfloat16" else dt
        q, k, v = self._as(q, work), self._as(k, work), self._as(v, work)
        kern = self._k(work)
        kt = cp.swapaxes(k, -1, -2)
        lq, lk = q.shape[-2], k.shape[-2]
        lead = prod(q.shape[:-2])
        step = max(1, min(lq, ATTENTION_SCORE_BYTES // max(1, lead * lk * np.dtype(work).itemsize)))
        out = cp.empty((*q.shape[:-1], v.shape[-1]), dtype=work)
        for s in range(0, lq, step):
            scores = self._c(self._mm(q[..., s:s + step, :], kt))
            out[..., s:s + step, :] = self._mm(kern.softmax_rows(scores, scale), v)
        return self._as(out, dt)

    def _concat(self, xs, axis):
        """One copy per part into the result. cp.concatenate joins more than two small arrays in
        one kernel whose pointer table is copied from host memory: a CUDA graph would replay that
        copy from a host buffer long gone."""
        cp = self.cp
        axis = axis % xs[0].ndim
        shape = list(xs[0].shape)
        shape[axis] = sum(x.shape[axis] for x in xs)
        out = cp.empty(shape, dtype=cp.result_type(*xs))
        at = 0
        for x in xs:
            part = out[(slice(None),) * axis + (slice(at, at + x.shape[axis]),)]
            copy_into(cp, part, x)  # one memcpy where the part is a block (axis_blocks)
            at += x.shape[axis]
        return out

    def _mean(self, x, axes, keepdims):
        dt = self.dtype_of(x)
        return self._as(self._f32(x).mean(axis=axes, keepdims=keepdims), dt)

    # ---- introspection ------------------------------------------------------------------------
    def plan_cache_stats(self) -> dict:
        return {"memoised_keys": len(self.paths.choices()), **self.plan_cache.stats()}

    def describe(self) -> dict:
        return {**super().describe(), "device": self.device_id, "gpu": self.gpu_name,
                "pci_bus_id": self.cp.cuda.Device(self.device_id).pci_bus_id,
                "cudnn": self.cudnn_version, "cupy": self.cp.__version__,
                "cudnn_frontend": getattr(self.cudnn, "__version__", "?"), "autotune": self.autotune,
                "allow_tf32": self.allow_tf32, "cuda_graphs": self.cuda_graphs,
                "force_fallback": self.paths.forced == "gemm_fallback",
                "unfold_limit_bytes": self.unfold_limit_bytes, "plan_cache_capacity": self.plan_cache.capacity,
                "plan_cache_dir": None if self.plan_cache.store is None else self.plan_cache.store.dir,
                "fusions": {"dw_ln": self.dw_ln, "dw_bias_in_ln": self.dw_bias_in_ln,
                            "lt_epilogues": self.lt_epilogues, "lt_gelu_approx": self.lt_gelu_approx,
                            "ln_vec": self.ln_vec}}
