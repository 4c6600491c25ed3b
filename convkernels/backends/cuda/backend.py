"""The CUDA backend: CuPy arrays, convolutions through cuDNN frontend graphs, the rest as our
CuPy kernels. Its parts, one module each:
- options.py: the settings (CudaOptions, the one constructor argument).
- arrays.py: storage dtypes and casts (bfloat16 as uint16 bit patterns; to_host returns
  float32, which holds every bf16 value exactly), weights derived once per buffer.
- conv_paths.py: the conv paths (cudnn, gemm_fallback / tiled_unfold, small_kd_2d,
  depthwise_direct) and their measured choice; the metric label is the path that actually ran.
- fusions.py: ConvNeXt's fused depthwise conv + LayerNorm and cuBLASLt linear epilogues.
- graphs.py: whole-forward CUDA graphs, and the capture state every part consults (its
  docstring states what may run inside a capture).
- kernels.py (+ src/*.cu): norms, activations, casts, depthwise, softmax kernels.
- attention.py: attention (cuBLAS products around the softmax kernel), ReLU linear attention.
- blas.py, blas_lt.py, cudnn.py, plan_cache.py, transfer.py, codecs/jpeg.py: cuBLAS, cuBLASLt and cuDNN
  through their C APIs, the plan cache, block copies, the pinned staging of host batches, JPEG decode.

Host <-> device copies happen only in asarray / to_host / to_host_async. Sampled convs get a pair of CUDA
events; flush_timings() reads them after the batch (no synchronisation per conv). Matmuls (linear, attention,
gemm_fallback's products) go through cuBLAS's C API on the backend's own handle, never CuPy's cuBLAS: that
is what lets `graphed` forwards be captured as CUDA graphs.
"""
from __future__ import annotations

import threading
from collections import Counter
from contextlib import contextmanager

import numpy as np

from ...backend import BackendBase
from ...paths import ConvPath
from ...spec import prod
from .arrays import STORAGE, CudaArrays, DerivedWeights, dtype_name
from .attention import SCORE_BYTES, attention, relu_linear_attention_apply, relu_linear_attention_sums
from .blas import Cublas
from .codecs.jpeg import HardwareJpeg
from .conv_paths import CudaConvPaths
from .cudnn import CudnnConvBuilder
from .fusions import CudaFusions, gated, rms_norm_affine
from .graphs import CaptureState, GraphCache, GraphedForward
from .options import DEFAULT_UNFOLD_LIMIT, CudaOptions
from .plan_cache import DEFAULT_CAPACITY, PlanCache, PlanStore
from .transfer import PinnedRegion, copy_into, gather_rows, start_to_host
from .upsample import upsample_conv2d

MAX_PENDING_TIMINGS = 8192


class CudaBackend(BackendBase):
    name = "cuda"
    supported_dtypes = ("float16", "bfloat16", "float32")
    attention_score_bytes = SCORE_BYTES
    reads_shuffled_residual = True  # the phase form adds it in place (upsample.py)
    runs_ahead = True
    path_memo_events = False  # the plan cache emits the plan cache events

    def __init__(self, options: CudaOptions | None = None):
        import cupy as cp
        import cudnn

        options = options or CudaOptions()
        self.options = options
        self.cp, self.cudnn = cp, cudnn
        self.device_id = int(options.device)
        self.device = cp.cuda.Device(self.device_id)
        self.device.use()
        props = cp.cuda.runtime.getDeviceProperties(self.device_id)
        self.gpu_name = props["name"].decode() if isinstance(props["name"], bytes) else str(props["name"])
        # a quarter of the card per model call: at 1 GiB (the CPU default) the service decoded
        # SD-VAE 512 in nine 256-px tiles on an 80 GB H100 (72 ms a request instead of 7)
        self.work_memory_budget = int(props["totalGlobalMem"]) // 4
        self.cudnn_version = str(cudnn.backend_version())
        self.unfold_limit_bytes = int(options.unfold_limit_bytes or DEFAULT_UNFOLD_LIMIT)
        # models built while this is False get eager forwards (a benchmark compares both)
        self.cuda_graphs = bool(options.cuda_graphs)
        self.graphs = GraphCache(options.graph_capacity, self.name, options.graph_max_bytes)
        self._graph_lock = threading.RLock()
        self.capture = CaptureState()
        self.arrays = CudaArrays(cp)
        # host batches stacked in pinned buffers, or gathered from memory pinned in place (transfer.py)
        self.host_batch = lambda shape, dtype: self.arrays.staging.take(tuple(shape), dtype)
        self.pin_host_region = lambda address, nbytes: PinnedRegion(cp, address, nbytes)
        self.gather_rows = lambda parts, regions, addresses=None: gather_rows(cp, parts, regions, addresses)
        self.jpeg_decoder = lambda: HardwareJpeg(cp, self.device_id)  # raises without nvImageCodec
        self.weights = DerivedWeights(self.capture)
        # matmuls through cuBLAS's C API: CuPy's cuBLAS calls cannot be captured (blas.py)
        self.blas = Cublas(cp, allow_tf32=options.allow_tf32)
        self.handle = cudnn.create_handle()
        builder = CudnnConvBuilder(cudnn, self.handle, allow_tf32=options.allow_tf32, autotune=options.autotune,
                                   autotune_max_plans=options.autotune_max_plans)
        store = PlanStore(options.plan_cache_dir, self.gpu_name, self.cudnn_version) if options.plan_cache_dir else None
        self.plan_cache = PlanCache(options.plan_cache_capacity or DEFAULT_CAPACITY, self.name, store=store,
                                    serializer=builder)
        self.convs = CudaConvPaths(cp, self.arrays, self.capture, self.weights, builder, self.plan_cache, self.blas,
                                   self.device_id, self.unfold_limit_bytes, options.autotune)
        self.fusions = CudaFusions(cp, self.arrays, self.capture, options, self.convs.depthwise_weights,
                                   self.conv2d, self._count_conv)
        # device -> host copies of to_host_async; timing events queued, and free for reuse
        self._copy_stream, self._pending, self._event_pool = None, [], []
        self._timing_lock = threading.Lock()
        super().__init__(options.dtype, options.timing_sample_rate)
        if options.force_fallback:
            self.paths.forced = "gemm_fallback"

    @property
    def measurements(self) -> dict:
        """key -> {path: median ms} of each measured path choice (autotune)."""
        return self.convs.measurements

    # ---- arrays -------------------------------------------------------------------------------
    def asarray(self, host, dtype=None):
        """Host array -> device array in `dtype` (arrays.CudaArrays.from_host)."""
        dt = dtype or self.dtype
        if dt not in self.supported_dtypes:
            raise ValueError(f"cuda backend: unsupported dtype {dt!r}; use one of {self.supported_dtypes}")
        host = np.asarray(host)
        if host.dtype.kind != "f" and str(host.dtype) != "bfloat16" and host.dtype != np.uint8:
            raise ValueError(f"cuda backend: expected a floating or uint8 array, got dtype {host.dtype}")
        return self.arrays.from_host(host, dt)

    def to_host(self, x) -> np.ndarray:
        if isinstance(x, np.ndarray):
            return x
        return self.cp.asnumpy(self.arrays.widened(x, fresh=False))

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
        out = self.arrays.as_uint8(x) if uint8 else self.arrays.widened(x, fresh=True, clip=clip)
        return start_to_host(self.cp, self._copy_stream, out)

    def dtype_of(self, x) -> str:
        return dtype_name(x)

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
    def conv_paths(self) -> list[ConvPath]:
        return self.convs.catalogue()

    def measure_paths(self):
        return self.convs.measure

    def _conv_operands(self, op, x, w, bias, residual):
        """Every operand in the storage dtype of x (one of supported_dtypes), contiguous."""
        dt = self.dtype_of(x)
        if dt not in STORAGE:
            raise ValueError(f"{op}: the cuda backend computes in {self.supported_dtypes}, got {dt}")
        cast = self.arrays.cast
        return cast(x, dt), cast(w, dt), cast(bias, dt), cast(residual, dt)

    def _count_conv(self, op: str, path: str) -> None:
        """Count a conv now, or, under a CUDA graph capture, list it for each replay to count."""
        if not self.capture.record(op, path):
            self._conv_metrics(op, path)[0].inc()

    def _run(self, path, key, x, w, bias, residual, activation):
        """Runs the path and counts the path that actually ran (a `cudnn` choice whose key has the
        FALLBACK marker runs gemm_fallback). Not timed under capture: a replay runs no Python."""
        sampled = not self.capture.active and self._sampled()
        if sampled:
            start = self._event()
            start.record()
        out, used = path.run(x, w, key, bias, residual, activation)
        self._count_conv(key.op, used)
        if sampled:
            end = self._event()
            end.record()
            with self._timing_lock:
                self._pending.append((key.op, used, start, end))
                if len(self._pending) > MAX_PENDING_TIMINGS:  # never flushed: keep memory bounded
                    self._pending = self._pending[-MAX_PENDING_TIMINGS:]
        return out

    def _upsample_conv2d(self, x, weight, bias, residual=None):
        return upsample_conv2d(self, x, weight, bias, residual)  # its two forms: upsample.py

    def depthwise_conv_layer_norm(self, x, w, bias, norm_w, norm_b, eps: float):
        return self.fusions.depthwise_conv_layer_norm(x, w, bias, norm_w, norm_b, eps)

    # ---- CUDA graphs ------------------------------------------------------------------------------
    @property
    def calls_to_warm(self) -> int:
        return 2 if self.cuda_graphs else 1

    def graphed(self, fn):
        return GraphedForward(self, fn, self.graphs, self._graph_lock) if self.cuda_graphs else super().graphed(fn)

    def bind_stream(self, stream) -> None:
        """Point the cuBLAS and cuDNN handles at `stream` before a capture begins on it: their
        stream is set outside the capture, as in the probes that captured them successfully."""
        self.blas.bind(stream.ptr)
        if self.handle.stream != stream.ptr:
            self.cudnn.set_stream(handle=self.handle, stream=stream.ptr)

    @contextmanager
    def recording_calls(self):
        """While a graph is captured on this thread: convs are listed (op, path), not counted or
        timed; device buffers the captured work keeps using are held by the graph, from the
        cuBLAS and cuBLASLt workspaces (replaced never, but held like the cuDNN workspace) on.
        Yields (calls, kept_buffers)."""
        with self.capture.recording([self.blas.workspace, *self.fusions.held_buffers()]) as recorded:
            yield recorded

    def count_calls(self, calls: Counter) -> None:
        for (op, path), n in calls.items():
            self._conv_metrics(op, path)[0].inc(n)

    # ---- normalisation and activations -------------------------------------------------------
    def _group_norm(self, x, num_groups, weight, bias, eps, activation):
        dt, cast = self.dtype_of(x), self.arrays.cast
        return self.arrays.kernels(dt).group_norm(self.arrays.contiguous(x), num_groups, cast(weight, dt),
                                                  cast(bias, dt), eps, activation)

    def _group_norm_sums(self, x, num_groups):
        return self.arrays.kernels(self.dtype_of(x)).group_norm_sums(self.arrays.contiguous(x), num_groups)

    def _group_norm_apply(self, x, sums, count, num_groups, weight, bias, eps, activation):
        dt, cast = self.dtype_of(x), self.arrays.cast
        return self.arrays.kernels(dt).group_norm_apply(self.arrays.contiguous(x), self.cp.asarray(sums, np.float64),
                                                        count, num_groups, cast(weight, dt), cast(bias, dt), eps,
                                                        activation)

    def _layer_norm(self, x, weight, bias, eps, activation):
        dt, cast = self.dtype_of(x), self.arrays.cast
        return self.arrays.kernels(dt).layer_norm(self.arrays.contiguous(x), cast(weight, dt), cast(bias, dt), eps,
                                                  activation, vectorised=self.options.ln_vec)

    def _rms_norm(self, x, weight, eps, activation):
        # one kernel: the base class's layer_norm route concatenates [x, -x] (copies) and
        # runs in bands
        dt = self.dtype_of(x)
        return self.arrays.kernels(dt).rms_norm(self.arrays.contiguous(x), self.arrays.cast(weight, dt), eps,
                                                activation)

    def _rms_norm_after(self, prefix, x, weight, eps, activation):
        if x.ndim != 5:
            return super()._rms_norm_after(prefix, x, weight, eps, activation)
        return self._rms_norm_joined(prefix, [x], weight, eps, activation)

    def _rms_norm_joined(self, prefix, parts, weight, eps, activation):
        # each part's norm written into its rows of one buffer, behind the prefix frames: neither
        # the joined input (a sharded conv's halo rows around its own) nor the output is copied
        shape, dt = parts[0].shape, self.dtype_of(parts[0])
        n, t = (1, prod(shape[:-3])) if prefix is None else (int(shape[0]), int(shape[1]))
        t0 = 0 if prefix is None else int(prefix.shape[1])
        out = self.cp.empty((n, t0 + t, sum(int(p.shape[-3]) for p in parts), *shape[-2:]), dtype=parts[0].dtype)
        if prefix is not None:
            copy_into(self.cp, out[:, :t0], prefix)
        parts = [self.arrays.contiguous(p).reshape(n, t, *p.shape[-3:]) for p in parts]
        self.arrays.kernels(dt).rms_norm_rows(parts, self.arrays.cast(weight, dt), eps, activation, out, t0)
        return out if prefix is not None else out.reshape(*shape[:-3], *out.shape[2:])

    def _activation(self, x, activation):
        return self.arrays.kernels(self.dtype_of(x)).epilogue(self.arrays.contiguous(x), None, None, activation)

    def _linear(self, x, weight, bias, residual, activation):
        dt, cast = self.dtype_of(x), self.arrays.cast
        lead = tuple(x.shape[:-1])
        fused = self.fusions.linear(x, weight, bias, residual, activation, dt)
        if fused is not None:
            return fused.reshape(*lead, weight.shape[0])
        out = self._matmul(self.reshape(x, (-1, x.shape[-1])), self.transpose(cast(weight, dt), (1, 0)))
        out = self.arrays.contiguous(out)
        res = None if residual is None else cast(residual, dt).reshape(out.shape)
        if bias is not None or res is not None or activation is not None:
            self.arrays.kernels(dt).epilogue(out, cast(bias, dt), res, activation, out=out)
        return out.reshape(*lead, weight.shape[0])

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
        out = cp.ascontiguousarray(cp.broadcast_to(self.arrays.contiguous(x).reshape(expanded), target))
        return out.reshape(x.shape[0], *(x.shape[1 + i] * scale[i] for i in range(nd)), x.shape[-1])

    def _pixel_shuffle(self, x, factors, repeats, start):
        """One copy kernel (src/shuffle.cu) for 2 or 3 spatial axes, not the reference's repeat
        and transposed copy; a 2-D input is one frame of a 3-D one."""
        if len(factors) not in (2, 3) or (len(factors) == 2 and start) or x.dtype not in STORAGE.values():
            return super()._pixel_shuffle(x, factors, repeats, start)
        kern = self.arrays.kernels(self.dtype_of(x))
        x = self.arrays.contiguous(x)
        if len(factors) == 3:
            return kern.pixel_shuffle3(x, tuple(factors), repeats, start)
        y = kern.pixel_shuffle3(x.reshape(x.shape[0], 1, *x.shape[1:]), (1, *factors), repeats, 0)
        return y.reshape(y.shape[0], *y.shape[2:])

    def _pad(self, x, pads, modes):
        if set(modes) != {"zeros"}:  # one vectorised copy (shuffle.cu pad3); cp.pad's edge is several
            return self.arrays.pad3(x, pads, modes)
        return self.cp.pad(x, ((0, 0), *pads, (0, 0)), mode="constant")

    # ---- dense ops -----------------------------------------------------------------------------
    def _matmul(self, a, b):
        if a.dtype != b.dtype:  # mixed storage dtypes: float32, and bfloat16 if either side was
            bf16 = np.dtype(np.uint16) in (a.dtype, b.dtype)
            out = self._mm(self.arrays.f32(a), self.arrays.f32(b))
            return self.arrays.cast(out, "bfloat16") if bf16 else out
        return self._mm(a, b)

    def add(self, a, b):
        return self.arrays.binary(a, b, self.cp.add)

    def mul(self, a, b):
        return self.arrays.binary(a, b, self.cp.multiply)

    def divide(self, a, b):
        return self.arrays.binary(a, b, self.cp.divide)

    def _astype(self, x, dtype: str):  # bfloat16 is uint16 bit patterns here: our casts, not CuPy's
        return self.arrays.cast(x, dtype)

    def _softmax(self, x, axis):
        dt, contiguous = self.dtype_of(x), self.arrays.contiguous
        axis = axis % x.ndim
        moved = axis != x.ndim - 1
        xs = contiguous(self.cp.moveaxis(x, axis, -1) if moved else x)
        y = self.arrays.kernels(dt).softmax_rows(xs)
        return contiguous(self.cp.moveaxis(y, -1, axis)) if moved else y

    def _mm(self, a, b):
        """cuBLAS through its C API (blas.py; bfloat16 as bfloat16): capturable into a CUDA
        graph, unlike cp.matmul. Transposed views stay views (cuBLAS takes them as op T) and
        batches are one strided-batched call."""
        if a.dtype == b.dtype and a.dtype in STORAGE.values():
            return self.blas.matmul(a, b)
        # float64: no compute dtype here, never in a model
        return self.blas.matmul(self.arrays.f32(a), self.arrays.f32(b))

    def _attention(self, q, k, v, scale):
        return attention(self, q, k, v, scale)  # attention.py: chunked, per storage dtype
    # attention.py: q, k and v read in place; fusions.py: a norm's bias and residual, a gate, in one pass
    relu_linear_attention_sums, relu_linear_attention_apply = relu_linear_attention_sums, relu_linear_attention_apply
    rms_norm_affine, gated = rms_norm_affine, gated

    def _concat(self, xs, axis):
        """One copy per part into the result. cp.concatenate joins more than two small arrays in one
        kernel reading a pointer table from host memory, which a CUDA graph's replay would not have."""
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
        return self.arrays.cast(self.arrays.f32(x).mean(axis=axes, keepdims=keepdims), dt)

    # ---- introspection ------------------------------------------------------------------------
    def plan_cache_stats(self) -> dict:
        return {"memoised_keys": len(self.paths.choices()), **self.plan_cache.stats()}

    def describe(self) -> dict:
        o = self.options
        return {**super().describe(), "device": self.device_id, "gpu": self.gpu_name,
                "pci_bus_id": self.cp.cuda.Device(self.device_id).pci_bus_id,
                "cudnn": self.cudnn_version, "cupy": self.cp.__version__,
                "cudnn_frontend": getattr(self.cudnn, "__version__", "?"), "autotune": o.autotune,
                "allow_tf32": o.allow_tf32, "cuda_graphs": self.cuda_graphs,
                "force_fallback": self.paths.forced == "gemm_fallback",
                "unfold_limit_bytes": self.unfold_limit_bytes, "plan_cache_capacity": self.plan_cache.capacity,
                "plan_cache_dir": None if self.plan_cache.store is None else self.plan_cache.store.dir,
                "fusions": o.fusions(), "upsample_form": o.upsample_form,
                # what CuPy's pool holds now, free blocks included: its high-water mark unless freed
                "pool_bytes": int(self.cp.get_default_memory_pool().total_bytes()),
                "graph_pool_bytes": self.graphs.held_bytes()}  # the recorded graphs' own pools
