"""Per-model inference statistics in the shape of Triton's statistics extension
(`GET /v2/models/{name}/stats`): cumulative counts and nanoseconds per model.

Prometheus histograms hold the same events but as bucketed seconds, and with `--workers N` they
are summed across processes; Triton clients (perf_analyzer) want exact per-model integer counts
and ns from the process they talk to. So this record is kept beside the metrics and updated at
the same points: the request's end (success/fail, as convserve_requests_total) and the batcher's
model call (queue wait, batch size, as convserve_queue_wait_seconds and convserve_batch_size).
It is written by the worker thread and the event loop, hence the lock.

Since the model workers run in their own processes (one per device), a front end keeps the
request half (success, fail) and each worker the batch half; a front end's statistics answer adds
the workers' records (`records()`, sent over the worker link) to its own (`snapshot(..., also=)`)."""
from __future__ import annotations

import copy
import threading
import time
from collections import defaultdict
from dataclasses import dataclass, field

#: Triton's per-request duration fields, in the order its statistics extension lists them
DURATIONS = ("success", "fail", "queue", "compute_input", "compute_infer", "compute_output",
             "cache_hit", "cache_miss")
_COMPUTE = ("compute_input", "compute_infer", "compute_output")


@dataclass
class Duration:
    count: int = 0
    ns: int = 0

    def add(self, ns: int, count: int = 1) -> None:
        self.count += count
        self.ns += ns

    def json(self) -> dict:
        return {"count": self.count, "ns": self.ns}


@dataclass
class ModelRecord:
    durations: dict[str, Duration] = field(default_factory=lambda: {k: Duration() for k in DURATIONS})
    inference_count: int = 0
    execution_count: int = 0
    last_inference_ms: int = 0
    #: batch size -> compute_input/compute_infer/compute_output of the model calls of that size
    batches: dict[int, dict[str, Duration]] = field(default_factory=dict)


@dataclass(frozen=True)
class BatchTimes:
    """One successful model call of `rows` rows, run for `items` queued requests."""
    rows: int
    queue_ns: tuple[int, ...]  # one per item
    input_ns: int               # stacking the items' rows into one array
    infer_ns: int               # the model call
    output_ns: int              # splitting the result into each item's rows


def ns(seconds: float) -> int:
    return max(0, int(round(seconds * 1e9)))


class ModelStats:
    def __init__(self):
        self._lock = threading.Lock()
        self._models: defaultdict[str, ModelRecord] = defaultdict(ModelRecord)

    def request_done(self, model: str, ok: bool, duration_ns: int) -> None:
        """A request for `model` was answered: 2xx counts as success, anything else as fail."""
        with self._lock:
            self._models[model].durations["success" if ok else "fail"].add(duration_ns)

    def batch_done(self, model: str, t: BatchTimes) -> None:
        """A model call succeeded. Like Triton, each request of the batch is charged the whole
        call's compute times; inference_count counts rows, execution_count calls."""
        items = len(t.queue_ns)
        with self._lock:
            rec = self._models[model]
            rec.durations["queue"].add(sum(t.queue_ns), items)
            per_batch = rec.batches.setdefault(t.rows, {k: Duration() for k in _COMPUTE})
            for key, spent in zip(_COMPUTE, (t.input_ns, t.infer_ns, t.output_ns)):
                rec.durations[key].add(spent * items, items)
                per_batch[key].add(spent)
            rec.inference_count += t.rows
            rec.execution_count += 1
            rec.last_inference_ms = int(time.time() * 1000)

    def records(self) -> dict[str, ModelRecord]:
        """A copy of every model's record (what a worker sends its front ends)."""
        with self._lock:
            return copy.deepcopy(dict(self._models))

    def snapshot(self, model: str, version: str, also: list[ModelRecord] = ()) -> dict:
        """Triton's `model_stats` entry for one model (zeros before its first request), with the
        records in `also` (the model workers') added to this process's own."""
        with self._lock:
            rec = _merged([self._models.get(model) or ModelRecord(), *also])
            return {
                "name": model, "version": version, "last_inference": rec.last_inference_ms,
                "inference_count": rec.inference_count, "execution_count": rec.execution_count,
                "inference_stats": {k: d.json() for k, d in rec.durations.items()},
                "response_stats": {},
                "batch_stats": [{"batch_size": size, **{k: d.json() for k, d in per.items()}}
                                for size, per in sorted(rec.batches.items())],
                "memory_usage": [],
            }


def _merged(records: list[ModelRecord]) -> ModelRecord:
    out = ModelRecord()
    for rec in records:
        for key, d in rec.durations.items():
            out.durations[key].add(d.ns, d.count)
        out.inference_count += rec.inference_count
        out.execution_count += rec.execution_count
        out.last_inference_ms = max(out.last_inference_ms, rec.last_inference_ms)
        for size, per in rec.batches.items():
            mine = out.batches.setdefault(size, {k: Duration() for k in _COMPUTE})
            for key, d in per.items():
                mine[key].add(d.ns, d.count)
    return out
