"""Python's cyclic garbage collector in the service's processes (HTTP front ends and model workers).

The rules:
1. Once a process can serve (a front end: its app started; a model worker: its models loaded and
   warmed up), what is alive then is collected once and frozen out of every later collection
   (`gc.freeze`). Why: a front end holds ~75-83k start-up objects (FastAPI, pydantic, the routes)
   and a worker ~65k (its modules and models). A full collection walks all of them, and it stops
   every thread of the process while it does: ~50 ms on one H200 host's Xeon, 30-100 ms on a 2-core
   EPYC, a front end's whole event loop or the worker's device thread held still. Requests make
   full collections come every few seconds under load, so their pauses set the latency tail (one
   image a request on one H200: p99 at 2.9-4.6x p50 as shipped, 1.5-1.8x frozen in most runs).
   Frozen, a full collection walks only what was made since: the ~1-4k objects requests left.
2. Every collection's pause is observed in `convserve_gc_pause_seconds{process,generation}`, so a tail
   that comes back shows its cause on /metrics.
3. Nothing here turns the collector off: cycles requests make are still collected.
4. What was alive at the freeze and is later dropped inside a reference cycle is never collected.
   So nothing large may rely on the collector: the service frees its big resources itself (an
   evicted CUDA graph releases its pool, a closed stream drops its generator), and what leaks is
   bounded by what start-up made.
5. `GC_FREEZE=false` keeps the collector as Python ships it (for comparison).
"""
from __future__ import annotations

import gc
import threading
import time
from collections import deque

from . import metrics, threads

#: how often the pauses gathered are written to the histogram
PUBLISH_S = 1.0

_started: list[float] = [0.0]
#: (generation, seconds) of the collections not yet published. Why not observe in the callback:
#: a collection can start inside prometheus_client's own locked write (any allocation may start
#: one), and its multiprocess lock is not re-entrant. A deque's append takes no lock.
_pauses: deque[tuple[int, float]] = deque(maxlen=100_000)
_process = ["frontend"]
#: the freeze's own collection is start-up, not a pause a request meets: not observed
_freezing = [False]
#: one publication at a time: a publish_pauses() call returns with every pause gathered before it written
_publish_lock = threading.Lock()


def _observe(phase: str, info: dict) -> None:
    # runs on whichever thread's allocation started the collection, all other threads held
    if phase == "start":
        _started[0] = time.perf_counter()
    elif not _freezing[0]:
        _pauses.append((info["generation"], time.perf_counter() - _started[0]))


def _publish() -> None:
    while True:
        time.sleep(PUBLISH_S)
        publish_pauses()


def publish_pauses() -> None:
    """The pauses gathered so far into `convserve_gc_pause_seconds`, one write per bucket touched."""
    with _publish_lock:
        by_generation: dict[int, list[float]] = {}
        while _pauses:
            generation, seconds = _pauses.popleft()
            by_generation.setdefault(generation, []).append(seconds)
        for generation, pauses in by_generation.items():
            metrics.observe_many(metrics.GC_PAUSE_SECONDS.labels(_process[0], str(generation)), pauses)


def watch(process: str) -> None:
    """Observe this process's collection pauses, labelled `process` (frontend, worker), and publish
    them every PUBLISH_S (once per process)."""
    _process[0] = process
    if _observe not in gc.callbacks:
        gc.callbacks.append(_observe)
        threads.start(_publish, "convserve-gc-pauses")


def freeze_startup_heap(process: str, enabled: bool = True) -> int:
    """Rule 1, where `enabled`: collect once, then freeze what is left; the count frozen goes to
    `convserve_gc_frozen_objects{process}` and is returned (0 where not enabled)."""
    if not enabled:
        metrics.GC_FROZEN_OBJECTS.labels(process).set(0)
        return 0
    _freezing[0] = True
    try:
        gc.collect()
    finally:
        _freezing[0] = False
    gc.freeze()
    frozen = gc.get_freeze_count()
    metrics.GC_FROZEN_OBJECTS.labels(process).set(frozen)
    return frozen
