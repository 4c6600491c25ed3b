"""Whole-forward CUDA graphs for the CUDA backend (issue #11's third lever).

A model's forward issues ~100-200 small launches (cuDNN executes, CuPy kernels, cuBLAS); each
costs 50-70 us of Python on the host, so at batch 1 the GPU mostly waits for the host. A
`GraphedForward` runs the forward eagerly the first time a (shape, dtype) is seen (that run
builds the cuDNN plans, compiles the CuPy kernels and sizes the workspace), captures it into a
CUDA graph the second time, and from then on copies the input into the captured input buffer,
launches the graph and copies the outputs out: one launch instead of hundreds.

Memory: everything the capture allocates comes from a CuPy memory pool private to that graph,
so no later allocation can land on memory the graph's replays still write. The one buffer from
outside, the backend's cuDNN workspace, is held by the graph: a later conv that needs a larger
workspace replaces the backend's, and the old one must not return to the pool while replays use it. Each graph keeps its
forward's peak activation memory, so the number of graphs is bounded (LRU); an evicted graph's
pool is freed. Outputs are copied out of the pool on every replay: a caller may keep them.

Metrics: the capture records which (op, path) each conv took; every replay counts them again in
`convkernels_conv_total`, so the counters match an eager run. Sampled conv latency is not
observed for replays (the convs are inside one launch).

A forward that cannot be captured (a host synchronisation inside it, say) runs eagerly for that
key from then on, with one warning in the log.
"""
from __future__ import annotations

import logging
import threading
from collections import Counter, OrderedDict

log = logging.getLogger("convkernels.cuda.graphs")

DEFAULT_CAPACITY = 8


class _Captured:
    def __init__(self, graph, pool, stream, static_in, static_outs, multi: bool, calls: Counter, kept: list):
        self.graph, self.pool, self.stream = graph, pool, stream
        self.static_in, self.static_outs, self.multi = static_in, static_outs, multi
        self.calls = calls
        self.kept = kept  # buffers outside the pool that the replays write (the cuDNN workspace)

    def release(self) -> None:
        self.graph = None
        self.static_in = self.static_outs = None
        self.kept = []
        self.pool.free_all_blocks()


class GraphedForward:
    def __init__(self, backend, fn, capacity: int = DEFAULT_CAPACITY):
        self.backend, self.fn, self.capacity = backend, fn, max(1, int(capacity))
        self._graphs: OrderedDict = OrderedDict()
        self._seen: set = set()
        self.ungraphable: dict = {}
        self.captures = 0
        self.replays = 0
        self._lock = threading.Lock()

    def __call__(self, x):
        key = (tuple(x.shape), x.dtype.str)
        with self._lock:
            if key in self.ungraphable or key not in self._seen:
                self._seen.add(key)
                return self.fn(x)  # first sight: eager, builds plans and compiles kernels
            entry = self._graphs.get(key)
            if entry is None:
                entry = self._capture(key, x)
                if entry is None:
                    return self.fn(x)
            else:
                self._graphs.move_to_end(key)
            return self._replay(entry, x)

    # ---- capture --------------------------------------------------------------------------------
    def _capture(self, key, x):
        cp = self.backend.cp
        self.backend.synchronize()  # the side stream must not overtake work queued for x
        pool = cp.cuda.MemoryPool()
        stream = cp.cuda.Stream(non_blocking=True)
        graph = None
        try:
            with cp.cuda.using_allocator(pool.malloc), stream:
                static_in = cp.empty_like(x)
                static_in[...] = x
                stream.synchronize()
                with self.backend.recording_calls() as (calls, kept):
                    stream.begin_capture()
                    try:
                        out = self.fn(static_in)
                    finally:
                        graph = _end_capture(stream)
                if graph is None:
                    raise RuntimeError("stream capture was invalidated")
        except Exception as exc:  # e.g. a host synchronisation inside the forward
            pool.free_all_blocks()
            self.ungraphable[key] = f"{exc.__class__.__name__}: {exc}"
            log.warning("forward for input %s cannot be captured as a CUDA graph (%s); running it eagerly",
                        key, self.ungraphable[key])
            return None
        multi = isinstance(out, tuple)
        entry = _Captured(graph, pool, stream, static_in, out if multi else (out,), multi, Counter(calls), kept)
        self._graphs[key] = entry
        self.captures += 1
        while len(self._graphs) > self.capacity:
            _, old = self._graphs.popitem(last=False)
            old.release()
        log.info("captured a CUDA graph for input %s: %d convs", key, len(calls))
        return entry

    # ---- replay ---------------------------------------------------------------------------------
    def _replay(self, entry: _Captured, x):
        cp = self.backend.cp
        stream = cp.cuda.get_current_stream()
        entry.static_in[...] = x
        entry.graph.launch(stream)
        self.backend.count_calls(entry.calls)
        self.replays += 1
        outs = tuple(None if o is None else o.copy() for o in entry.static_outs)
        return outs if entry.multi else outs[0]

    def stats(self) -> dict:
        return {"graphs": len(self._graphs), "captures": self.captures, "replays": self.replays,
                "pool_bytes": sum(e.pool.total_bytes() for e in self._graphs.values()),
                "ungraphable": dict(self.ungraphable)}


def _end_capture(stream):
    try:
        return stream.end_capture()
    except Exception:  # the capture was invalidated; the stream is usable again
        return None
