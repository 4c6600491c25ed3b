"""Kernel metrics. Names and labels are a public contract (docs/interfaces.md); the service exposes
`REGISTRY` beside its own."""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

REGISTRY = CollectorRegistry(auto_describe=True)

CONV_TOTAL = Counter(
    "convkernels_conv_total", "Convolution calls by the kernel path chosen for them",
    ["backend", "op", "path"], registry=REGISTRY)

CONV_SECONDS = Histogram(
    "convkernels_conv_seconds", "Device time per convolution (sampled)",
    ["backend", "op", "path"], registry=REGISTRY,
    buckets=(1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0, 10.0))

PLAN_CACHE_EVENTS = Counter(
    "convkernels_plan_cache_events_total", "Plan cache / path memo events: hit, miss, evict, fallback",
    ["backend", "event"], registry=REGISTRY)

PLAN_BUILD_SECONDS = Histogram(
    "convkernels_plan_build_seconds", "Seconds spent choosing a path / building a plan for a new conv key",
    ["backend"], registry=REGISTRY,
    buckets=(1e-5, 1e-4, 1e-3, 1e-2, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0))

# ---- CUDA graphs (convkernels/backends/cuda/graphs.py) -------------------------------------------
CUDA_GRAPH_REPLAYS = Counter(
    "convkernels_cuda_graph_replays_total", "Forward calls (one per batch) served by replaying a CUDA graph",
    ["backend"], registry=REGISTRY)

CUDA_GRAPH_CAPTURES = Counter(
    "convkernels_cuda_graph_captures_total",
    "CUDA graph captures of a forward by outcome: captured, failed (that input shape then runs eagerly)",
    ["backend", "outcome"], registry=REGISTRY)

CUDA_GRAPHS_HELD = Gauge(
    "convkernels_cuda_graphs", "CUDA graphs held (LRU-bounded by CONVSERVE_CUDA_GRAPH_CAPACITY)",
    ["backend"], registry=REGISTRY, multiprocess_mode="livesum")

CUDA_GRAPH_POOL_BYTES = Gauge(
    "convkernels_cuda_graph_pool_bytes", "Device bytes the held CUDA graphs' private memory pools hold",
    ["backend"], registry=REGISTRY, multiprocess_mode="livesum")
