"""Service metrics (names are a public contract: docs/interfaces.md), on their own registry;
/metrics serves it together with convkernels.metrics.REGISTRY.

With `--workers N` every worker process writes its values to files under
PROMETHEUS_MULTIPROC_DIR (the CLI sets it up), and /metrics, whichever worker answers, sums them
(prometheus_client's multiprocess mode): counters and histograms add up, the in-flight and queue
gauges add up over live workers, the load/warm-up gauges report the slowest worker."""
from __future__ import annotations

import bisect
import functools
import glob
import os

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from convkernels.metrics import REGISTRY as KERNEL_REGISTRY

REGISTRY = CollectorRegistry(auto_describe=True)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

REQUESTS = Counter("convserve_requests_total", "Requests by model, endpoint and HTTP status",
                   ["model", "endpoint", "status"], registry=REGISTRY)
REQUEST_SECONDS = Histogram("convserve_request_seconds", "Request latency, body read to response ready",
                            ["model", "endpoint"], registry=REGISTRY, buckets=_LATENCY_BUCKETS)
QUEUE_WAIT_SECONDS = Histogram("convserve_queue_wait_seconds", "Time a request waited for its batch to start",
                               ["model"], registry=REGISTRY, buckets=_LATENCY_BUCKETS)
BATCH_SIZE = Histogram("convserve_batch_size", "Rows (images, videos) per model call",
                       ["model"], registry=REGISTRY, buckets=(1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64, 128))
INFLIGHT = Gauge("convserve_inflight_requests", "Requests admitted and not yet answered",
                 ["model"], registry=REGISTRY, multiprocess_mode="livesum")
QUEUE_DEPTH = Gauge("convserve_queue_depth", "Requests waiting in the batcher queue",
                    ["model"], registry=REGISTRY, multiprocess_mode="livesum")
REJECTED = Counter("convserve_rejected_total",
                   "Requests not run: queue_full, memory_budget, too_much_work, new_shape_limit, timeout, "
                   "client_gone, shutting_down",
                   ["model", "reason"], registry=REGISTRY)
# Every request touches these children; prometheus_client's labels() checks and hashes the label
# values on each call (with --workers N, under a lock around its files). Looked up once per model
# and endpoint (names the front end has already checked, so few): about a tenth of the metrics'
# share of a front end's CPU per one-image request.
@functools.lru_cache(maxsize=1024)
def request_children(model: str, endpoint: str):
    """(in-flight gauge, latency histogram) of `model` on `endpoint`."""
    return INFLIGHT.labels(model), REQUEST_SECONDS.labels(model, endpoint)


@functools.lru_cache(maxsize=4096)
def request_counter(model: str, endpoint: str, status: int):
    return REQUESTS.labels(model, endpoint, str(status))


MEMORY_BUDGET_USED = Gauge("convserve_memory_budget_used_bytes",
                           "Bytes of admitted bodies and their arrays the front ends hold (their memory budget's use)",
                           registry=REGISTRY, multiprocess_mode="livesum")
MEMORY_BUDGET_LIMIT = Gauge("convserve_memory_budget_bytes", "The front ends' memory budget (CONVSERVE_MEMORY_BUDGET_BYTES)",
                            registry=REGISTRY, multiprocess_mode="livesum")
WRITE_STALLS = Counter("convserve_write_stalls_total",
                       "Connections dropped because the client read nothing of its response for CONVSERVE_WRITE_TIMEOUT_S",
                       registry=REGISTRY)
ABANDONED = Counter("convserve_abandoned_batches_total",
                    "Model calls stopped at a tile or frame group because every requester had gone",
                    ["model"], registry=REGISTRY)
FAULTS = Counter("convserve_faults_total",
                 "Faults met: device_oom (retried, recovered, failed), worker_exception (failed), "
                 "worker_died (failed: a request its worker took down with it), load_error (failed)", ["model", "fault", "outcome"], registry=REGISTRY)
WORKER_UP = Gauge("convserve_worker_up", "1 while the device's model worker process runs, 0 while it is restarted",
                  ["device"], registry=REGISTRY, multiprocess_mode="max")
WORKER_RESTARTS = Counter("convserve_worker_restarts_total", "Model worker processes started again after dying",
                          ["device"], registry=REGISTRY)
DEVICE_ROWS = Counter("convserve_device_rows_total", "Rows (images, videos, frame groups) run, per device",
                      ["model", "device"], registry=REGISTRY)
DEVICE_BATCHES = Counter("convserve_device_batches_total", "Model calls run, per device",
                         ["model", "device"], registry=REGISTRY)
WORKER_SUBMIT_MESSAGES = Counter("convserve_worker_submit_messages_total",
                                 "Submit and SubmitMany messages model workers read from the front ends",
                                 ["device"], registry=REGISTRY)
IMAGE_DECODES = Counter("convserve_image_decodes_total",
                        "Encode requests' image files decoded, by where: frontend (PIL in an HTTP front end), "
                        "device (the GPU's JPEG engines, in the model worker), worker-host (PIL in the model worker)",
                        ["model", "where"], registry=REGISTRY)
WORKER_SUBMITS = Counter("convserve_worker_submits_total",
                         "Requests those messages carried (over the messages: the requests a message carries on average)",
                         ["device"], registry=REGISTRY)


def count_fault(model: str, fault: str, outcome: str) -> None:
    FAULTS.labels(model, fault, outcome).inc()


def observe_many(child, values) -> None:
    """A histogram child's `observe` of each value, with one write per bucket touched and one to
    its sum: in multiprocess mode each write is a locked store into a memory-mapped file, and a
    batch's queue waits would otherwise cost two of them per request."""
    bounds, counts = child._upper_bounds, {}
    for value in values:
        i = bisect.bisect_left(bounds, value)  # the first bound >= value, as observe's <= test
        counts[i] = counts.get(i, 0) + 1
    for i, n in counts.items():
        child._buckets[i].inc(n)
    child._sum.inc(sum(values))

MODEL_LOADS = Counter("convserve_model_loads_total", "Model loads, per device (one per model and model worker)",
                      ["model", "device"], registry=REGISTRY)
MODEL_LOAD_SECONDS = Gauge("convserve_model_load_seconds", "Seconds to build/load the model",
                           ["model"], registry=REGISTRY, multiprocess_mode="max")
MODEL_WARMUP_SECONDS = Gauge("convserve_model_warmup_seconds", "Seconds of the warm-up call",
                             ["model"], registry=REGISTRY, multiprocess_mode="max")
TIME_TO_FIRST_FRAME = Histogram("convserve_time_to_first_frame_seconds", "Streaming: request to first frame",
                                ["model", "backend"], registry=REGISTRY, buckets=_LATENCY_BUCKETS)
#: where a stream's time to its first frame goes, stage by stage (they add up to it): `body`, the
#: request's body read, parsed and checked; `open`, the decode opened on its worker (or shard
#: group); `first_group`, the first frame group decoded and back in the front end; `send`, that
#: group encoded and handed to the socket
STREAM_STAGE_SECONDS = Histogram("convserve_stream_first_frame_stage_seconds",
                                 "Streaming: the time to the first frame, by stage", ["model", "backend", "stage"],
                                 registry=REGISTRY, buckets=_LATENCY_BUCKETS)
#: each frame group after the first of a streamed or whole-clip video answer, by stage: `wait`, the
#: sender waited for the group to come back decoded (the decode is behind); `encode`, the group
#: encoded (MP4) or framed (.npy); `send`, handed to the socket (the reader is behind). Their sums
#: per format say which of the three a clip's time went to (benchmarks/service/streaming.py)
STREAM_GROUP_SECONDS = Histogram("convserve_stream_group_stage_seconds",
                                 "Video answers: each frame group's time by stage", ["model", "backend", "format", "stage"],
                                 registry=REGISTRY, buckets=_LATENCY_BUCKETS)
STREAM_FPS = Histogram("convserve_stream_frames_per_second", "Streaming: frames per second per request",
                       ["model", "backend"], registry=REGISTRY,
                       buckets=(0.5, 1, 2, 5, 10, 20, 30, 60, 120, 240))

#: each pause of Python's cyclic garbage collector in a front end or model worker, by generation
#: (service/gc_pauses.py: a full collection stops every thread of its process)
GC_PAUSE_SECONDS = Histogram("convserve_gc_pause_seconds",
                             "Pauses of Python's garbage collector in the service's processes (frontend, worker), by generation",
                             ["process", "generation"], registry=REGISTRY,
                             buckets=(0.0001, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25))

GC_FROZEN_OBJECTS = Gauge("convserve_gc_frozen_objects",
                          "Objects a front end or model worker froze out of garbage collection once it could serve",
                          ["process"], registry=REGISTRY, multiprocess_mode="max")

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def exposition() -> bytes:
    """Prometheus text of the service registry followed by the kernel registry; under several
    workers, of every worker's values summed."""
    if os.environ.get(MULTIPROC_ENV):
        merged = CollectorRegistry()
        _SizedFilesCollector(merged)
        return generate_latest(merged) + _declared_only({fam.name for fam in merged.collect()})
    return generate_latest(REGISTRY) + generate_latest(KERNEL_REGISTRY)


def _sized_files(path: str) -> list[str]:
    """The value files of the multiprocess directory that have their header. A process's first
    value of a kind creates its file empty and sizes it a moment later (prometheus_client's
    MmapedDict); read in between, the file has no header and the whole scrape would fail with a
    500. Such a file holds no value yet, so leaving it out of one scrape loses nothing."""
    files = []
    for name in glob.glob(os.path.join(path, "*.db")):
        try:
            if os.path.getsize(name) >= 8:
                files.append(name)
        except FileNotFoundError:  # a live gauge's file, removed as its process exited
            pass
    return files


class _SizedFilesCollector:
    """prometheus_client's multiprocess collector over `_sized_files` only."""

    def __init__(self, registry: CollectorRegistry):
        self._path = os.environ[MULTIPROC_ENV]
        registry.register(self)

    def collect(self):
        from prometheus_client import multiprocess

        return multiprocess.MultiProcessCollector.merge(_sized_files(self._path), accumulate=True)


def _declared_only(present: set[str]) -> bytes:
    """HELP and TYPE of the families no process has a value for yet (the multiprocess collector
    reads values, not declarations), so every family is declared from the start, as a single
    process's registry does: dashboards and alerts may refer to series that come with traffic."""
    lines = []
    for registry in (REGISTRY, KERNEL_REGISTRY):
        for fam in registry.collect():
            if fam.name not in present:
                doc = fam.documentation.replace("\\", "\\\\").replace("\n", "\\n")
                lines.append(f"# HELP {fam.name} {doc}\n# TYPE {fam.name} {fam.type}\n")
    return "".join(lines).encode()


def worker_exiting() -> None:
    """Drop this process's live gauges from the sums (multiprocess mode only)."""
    if os.environ.get(MULTIPROC_ENV):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(os.getpid())
