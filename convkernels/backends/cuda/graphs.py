"""Whole-forward CUDA graphs for the CUDA backend, on by default.

A model's forward issues ~100-200 small launches (cuDNN executes, CuPy kernels, cuBLAS); each
costs 50-70 us of Python on the host, so at batch 1 the GPU mostly waits for the host. A
`GraphedForward` runs the forward eagerly the first time a (shape, dtype) is seen (that run
builds the cuDNN plans, compiles the CuPy kernels and sizes the workspaces), captures it into a
CUDA graph the second time, and from then on copies the input into the captured input buffer,
launches the graph and copies the outputs out: one launch instead of hundreds.

What may run inside a capture (the backend keeps to it): no host synchronisation, no CuPy
cuBLAS (matmuls go through blas.py's own handle), no cuRAND, no plan building or path
measuring (a cache miss under capture raises CaptureMissed: that call runs eagerly and the next
one captures again), and no host-side cache entry pointing into the capture's memory. NCCL
collectives queued on the capturing stream may be captured (convkernels/collectives/nccl.py, the sharded
Wan decode's steady chunks): only with nothing asked of the host (an all-gather is told its
lengths), and a graph's replay then issues them in the order its eager run would, which every
rank of the group keeps.

Memory: everything the capture allocates comes from a CuPy memory pool private to that graph,
so no later allocation can land on memory the graph's replays still write. Buffers from
outside that the replays use (the cuDNN and cuBLAS workspaces, the cuDNN plans whose kernels
were captured) are held by the graph: the backend may replace its workspace with a larger one,
and the old one must not return to the pool while replays use it. Each graph keeps its
forward's peak activation memory, so graphs are bounded per backend (`GraphCache`, LRU over all
models and shapes); an evicted graph's pool is freed. Outputs are copied out of the pool on
every replay: a caller may keep them. A replay waits (on the device, not the host) for the
previous replay of the same graph to finish copying out before it overwrites the input buffer.

Metrics: the capture records which (op, path) each conv took; every replay counts them again in
`convkernels_conv_total`, so the counters match an eager run. Replays, captures (and failed
captures), graphs held and the bytes their pools hold are `convkernels_cuda_graph_*` series.
Sampled conv latency is not observed for replays (the convs are inside one launch).

A forward that cannot be captured (a host synchronisation inside it, say) runs eagerly for that
key from then on, with one warning in the log; the GPU tests assert that no model forward does.
A capture that fails where the eager run of the same input fails too (bad data, an injected
fault) marks nothing: the error is the forward's. Out of memory while capturing (the capture's
pool comes on top of the eager run's cached memory) defers like a cache miss.
"""
from __future__ import annotations

import itertools
import logging
import threading
import weakref
from collections import Counter, OrderedDict
from contextlib import contextmanager

from ...metrics import CUDA_GRAPH_CAPTURES, CUDA_GRAPH_POOL_BYTES, CUDA_GRAPH_REPLAYS, CUDA_GRAPHS_HELD
from .transfer import copy_into

log = logging.getLogger("convkernels.cuda.graphs")

DEFAULT_CAPACITY = 16
#: a graph whose pool would hold more is dropped after its capture and its key runs eagerly: at
#: that size the kernels dwarf the launches a replay saves, and the pool doubles the memory peak
#: (Wan 2.1 at 480x832: a 5.9 GB pool per chunk step, no faster than eager on the H100)
DEFAULT_MAX_GRAPH_BYTES = 4 << 30
#: a capture that met a plan cache miss this many times in a row is given up on
MAX_MISSED_CAPTURES = 3


class CaptureMissed(RuntimeError):
    """Raised under capture where eager-only work (building a plan, measuring paths) was needed:
    that call runs eagerly instead, and the next call of the key captures again."""


class CaptureState:
    """What the backend does differently while a graph is captured on this thread, so that it
    keeps the rules above: each conv's (op, path) is listed for the replays to count instead of
    being counted (`record`); every buffer from outside the capture's pool that the captured work
    uses is held by the graph (`keep`); eager-only work raises CaptureMissed (`require_eager`);
    and `active` tells caches not to make entries that would point into the capture's pool.
    Per thread: a capture on one thread leaves eager calls on others as they are."""

    def __init__(self):
        self._tls = threading.local()

    @property
    def active(self) -> bool:
        return getattr(self._tls, "calls", None) is not None

    def record(self, op: str, path: str) -> bool:
        """Under capture, list a conv (counted at each replay, not at capture) and return True;
        otherwise False: the caller counts it now."""
        calls = getattr(self._tls, "calls", None)
        if calls is None:
            return False
        calls.append((op, path))
        return True

    def keep(self, held) -> None:
        """Under capture, make the graph hold `held` (a workspace its replays write, a cuDNN plan
        whose runtime-compiled kernels it captured) for as long as the graph lives: the backend
        may replace it meanwhile, and it must not go back to the pool while replays use it."""
        kept = getattr(self._tls, "keep", None)
        if kept is not None and not any(k is held for k in kept):
            kept.append(held)

    def require_eager(self, what: str) -> None:
        """Under capture, raise CaptureMissed: `what` (building a plan, measuring paths, making a
        handle) is eager-only; that call then runs eagerly and a later one captures."""
        if self.active:
            raise CaptureMissed(what)

    @contextmanager
    def recording(self, held=()):
        """The capture of one forward on this thread: yields (calls, kept), the convs listed and
        the buffers held, starting with `held`."""
        calls: list = []
        kept: list = list(held)
        self._tls.calls, self._tls.keep = calls, kept
        try:
            yield calls, kept
        finally:
            self._tls.calls = self._tls.keep = None


class GraphCache:
    """LRU of captured graphs over every GraphedForward of one backend. Entries have
    `release()` and `nbytes`; keys are (owner token, input key). Holds no device state itself,
    so the bookkeeping is tested on the CPU."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, backend_name: str = "cuda",
                 max_graph_bytes: int = DEFAULT_MAX_GRAPH_BYTES):
        self.capacity = max(1, int(capacity))
        self.max_graph_bytes = int(max_graph_bytes)
        self.backend_name = backend_name
        self._entries: OrderedDict = OrderedDict()
        self._lock = threading.Lock()
        self.evictions = 0

    def admits(self, nbytes: int) -> bool:
        """Whether a captured graph whose pool holds `nbytes` is worth keeping."""
        return nbytes <= self.max_graph_bytes

    def get(self, key):
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
            return entry

    def put(self, key, entry) -> list:
        """Insert (newest); evicts and releases the least recently used beyond capacity.
        Returns the evicted keys."""
        with self._lock:
            old = self._entries.pop(key, None)
            self._entries[key] = entry
            evicted = []
            while len(self._entries) > self.capacity:
                k, e = self._entries.popitem(last=False)
                evicted.append((k, e))
        if old is not None and old is not entry:
            old.release()
        for _, e in evicted:
            e.release()
        self.evictions += len(evicted)
        self._export()
        return [k for k, _ in evicted]

    def drop_owner(self, owner) -> None:
        """Release every graph of one forward (its model went away)."""
        with self._lock:
            gone = [k for k in self._entries if k[0] == owner]
            entries = [self._entries.pop(k) for k in gone]
        for e in entries:
            e.release()
        self._export()

    def keys_of(self, owner) -> list:
        with self._lock:
            return [k[1] for k in self._entries if k[0] == owner]

    def held_bytes(self, owner=None) -> int:
        """Bytes the graphs' pools hold: all of them, or one forward's."""
        with self._lock:
            return sum(e.nbytes for k, e in self._entries.items() if owner is None or k[0] == owner)

    def __len__(self) -> int:
        return len(self._entries)

    def _export(self) -> None:
        CUDA_GRAPHS_HELD.labels(self.backend_name).set(len(self._entries))
        CUDA_GRAPH_POOL_BYTES.labels(self.backend_name).set(self.held_bytes())


def _copied(cp, o):
    """A fresh copy of a graph's output buffer (the next replay overwrites it)."""
    out = cp.empty(o.shape, dtype=o.dtype)
    copy_into(cp, out, o)
    return out


class _Captured:
    def __init__(self, graph, pool, static_ins: tuple, static_outs, multi: bool, calls: Counter, kept: list, done):
        self.graph, self.pool = graph, pool
        self.static_ins, self.static_outs, self.multi = static_ins, static_outs, multi
        self.calls = calls
        self.kept = kept  # what the replays use from outside the pool (workspaces, cuDNN plans)
        self.done = done  # recorded after each replay's outputs are copied out
        self.nbytes = int(pool.total_bytes())

    def release(self) -> None:
        self.graph = None
        self.static_ins = self.static_outs = None
        self.kept = []
        self.pool.free_all_blocks()
        self.nbytes = 0


_tokens = itertools.count()


class GraphedForward:
    """fn(*xs) -> array or tuple of arrays, replayed from a CUDA graph per (shape, dtype) of the
    inputs. Several inputs carry state between calls (a causal decoder's cache): each is copied
    into its captured buffer, as a single input is."""

    def __init__(self, backend, fn, cache: GraphCache, lock=None):
        self.backend, self.fn, self.cache = backend, fn, cache
        self.token = next(_tokens)
        self._seen: set = set()
        self._missed: Counter = Counter()
        self.ungraphable: dict = {}
        self.too_large: dict = {}  # key -> pool bytes of the capture that was dropped
        self.captures = 0
        self.replays = 0
        # one lock for all of a backend's forwards: a capture may evict (and free) another
        # forward's graph, which must not be mid-replay in another thread then
        self._lock = lock if lock is not None else threading.RLock()
        # a model that goes away frees its graphs; at interpreter exit the process frees everything
        weakref.finalize(self, cache.drop_owner, self.token).atexit = False

    @staticmethod
    def _key(xs):
        key = tuple((tuple(x.shape), x.dtype.str) for x in xs)
        return key[0] if len(key) == 1 else key

    def records(self, *xs) -> bool:
        """False once inputs like these are known to run eagerly for good (ungraphable, or a graph
        over the byte bound); until then a call may be the one that captures. A caller whose own
        eager route frees state as it goes (Wan's cache) takes that route when False."""
        key = self._key(xs)
        return key not in self.ungraphable and key not in self.too_large

    def __call__(self, *xs):
        key = self._key(xs)
        with self._lock:
            if key in self.ungraphable or key in self.too_large or key not in self._seen:
                self._seen.add(key)
                return self.fn(*xs)  # first sight: eager, builds plans and compiles kernels
            entry = self.cache.get((self.token, key))
            if entry is None:
                entry, failure = self._capture(key, xs)
                if entry is None:
                    # if this raises too, the forward fails on this input (bad data, an injected
                    # fault): that says nothing about capturing it, so nothing is marked
                    out = self.fn(*xs)
                    if failure is not None:
                        self._give_up(key, failure)
                    return out
            return self._replay(entry, xs)

    # ---- capture --------------------------------------------------------------------------------
    def _capture(self, key, xs):
        """(entry, None) when captured; (None, None) when deferred (a cache miss under capture,
        out of memory with a second pool); (None, exception) when the forward cannot be captured."""
        cp = self.backend.cp
        self.backend.synchronize()  # the side stream must not overtake work queued for x
        # the eager run just before left its activations cached in the shared pool; give them
        # back so the capture's private pool reuses that memory instead of doubling the peak
        cp.get_default_memory_pool().free_all_blocks()
        pool = cp.cuda.MemoryPool()
        caller = cp.cuda.get_current_stream()
        stream = cp.cuda.Stream(non_blocking=True)
        try:
            return self._capture_on(key, xs, pool, stream)
        finally:
            # the capture stream dies with this call: handles left pointing at it would hand
            # cuDNN a destroyed stream (its plan deserialisation captures a warm-up on the
            # handle's stream: "cuda_stream_is_capturing ... context is destroyed" on the H100)
            self.backend.bind_stream(caller)

    def _capture_on(self, key, xs, pool, stream):
        cp = self.backend.cp
        graph = None
        try:
            with cp.cuda.using_allocator(pool.malloc), stream:
                static_ins = tuple(cp.empty_like(x) for x in xs)
                for static, x in zip(static_ins, xs):
                    copy_into(cp, static, x)
                stream.synchronize()
                self.backend.bind_stream(stream)
                with self.backend.recording_calls() as (calls, kept):
                    stream.begin_capture()
                    try:
                        out = self.fn(*static_ins)
                    finally:
                        graph = _end_capture(stream)
                if graph is None:
                    raise RuntimeError("stream capture was invalidated")
        except (CaptureMissed, MemoryError) as exc:
            pool.free_all_blocks()
            self._missed[key] += 1
            if self._missed[key] >= MAX_MISSED_CAPTURES:
                return None, exc
            log.info("capture for input %s deferred: %s", key, exc)
            return None, None
        except Exception as exc:  # e.g. a host synchronisation inside the forward
            pool.free_all_blocks()
            return None, exc
        self._missed.pop(key, None)
        if not self.cache.admits(int(pool.total_bytes())):
            self.too_large[key] = int(pool.total_bytes())
            graph = out = None
            pool.free_all_blocks()
            CUDA_GRAPH_CAPTURES.labels(self.backend.name, "too_large").inc()
            log.info("graph for input %s dropped: its pool holds %d bytes, over the %d-byte bound; "
                     "running it eagerly", key, self.too_large[key], self.cache.max_graph_bytes)
            return None, None
        multi = isinstance(out, tuple)
        entry = _Captured(graph, pool, static_ins, out if multi else (out,), multi, Counter(calls), kept,
                          cp.cuda.Event(disable_timing=True))
        self.captures += 1
        CUDA_GRAPH_CAPTURES.labels(self.backend.name, "captured").inc()
        self.cache.put((self.token, key), entry)
        log.info("captured a CUDA graph for input %s: %d convs, %d pool bytes", key, len(calls), entry.nbytes)
        return entry, None

    def _give_up(self, key, exc) -> None:
        self.ungraphable[key] = f"{exc.__class__.__name__}: {exc}"
        self._missed.pop(key, None)
        CUDA_GRAPH_CAPTURES.labels(self.backend.name, "failed").inc()
        log.warning("forward for input %s cannot be captured as a CUDA graph (%s); running it eagerly",
                    key, self.ungraphable[key])

    # ---- replay ---------------------------------------------------------------------------------
    def _replay(self, entry: _Captured, xs):
        cp = self.backend.cp
        stream = cp.cuda.get_current_stream()
        stream.wait_event(entry.done)  # a replay on another stream may still be copying out
        for static, x in zip(entry.static_ins, xs):
            copy_into(cp, static, x)
        entry.graph.launch(stream)
        outs = tuple(None if o is None else _copied(cp, o) for o in entry.static_outs)
        entry.done.record(stream)
        self.backend.count_calls(entry.calls)
        self.replays += 1
        CUDA_GRAPH_REPLAYS.labels(self.backend.name).inc()
        return outs if entry.multi else outs[0]

    def captured(self) -> list:
        """This forward's graphs the cache holds now."""
        return [e for e in (self.cache.get((self.token, k)) for k in self.cache.keys_of(self.token)) if e]

    def stats(self) -> dict:
        keys = self.cache.keys_of(self.token)
        return {"graphs": len(keys), "captures": self.captures, "replays": self.replays,
                "pool_bytes": self.cache.held_bytes(self.token),
                "ungraphable": {str(k): v for k, v in self.ungraphable.items()},
                "too_large": {str(k): v for k, v in self.too_large.items()}}


def _end_capture(stream):
    try:
        return stream.end_capture()
    except Exception:  # the capture was invalidated; the stream is usable again
        return None
