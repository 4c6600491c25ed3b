"""GPU tests: shared fixtures. Every GPU test skips with the reason when there is no usable
CUDA device, CuPy or cuDNN frontend (CI has none); the CPU-only files here test the pure
Python parts of the CUDA backend (plan cache, graph bookkeeping, cuBLAS plans, capture rules,
kernels emulated on the CPU) and always run. The op suite's cuda targets are tests/test_ops*.py."""
from __future__ import annotations

import gc
import os
import sys

import pytest

# the shared torch reference helpers live one folder up
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Helpers are imported from named modules (gpu_support, live_server), never `from conftest`:
# two conftest.py files share that module name, so which one an import finds depends on order.
from gpu_support import cuda_or_skip  # noqa: E402


@pytest.fixture(scope="session")
def cuda_available():
    cuda_or_skip()
    return True


@pytest.fixture(autouse=True)
def _gpu_memory_given_back(request):
    """After each test, this process hands its cached GPU memory back to the device, and on a GPU
    machine's run ($OUT) writes the test's peak to $OUT/gpu_memory.txt.

    Why: pytest-xdist runs 8 processes on one GPU. CuPy's pool and torch's caching allocator keep
    every freed block for reuse. So each process's footprint would grow to its largest test's and
    stay there. On one H200 on 2026-11-29, eight such footprints left no room: other processes then
    failed to create a cuBLAS handle (cublasStatus 3) or to load a model."""
    yield
    cupy, torch = sys.modules.get("cupy"), sys.modules.get("torch")
    peak = {}
    if torch is not None and torch.cuda.is_initialized():
        peak["torch"] = torch.cuda.max_memory_reserved()
    if cupy is not None:
        try:
            peak["cupy"] = cupy.get_default_memory_pool().total_bytes()
        except Exception:  # CuPy present but no device: nothing cached
            cupy = None
    gc.collect()  # models and arrays the test left in reference cycles
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    if cupy is not None:
        cupy.get_default_memory_pool().free_all_blocks()
        cupy.get_default_pinned_memory_pool().free_all_blocks()
    if peak and _out():
        with open(os.path.join(_out(), "gpu_memory.txt"), "a") as f:
            f.write(" ".join(f"{k} {v / 2**30:6.2f} GiB" for k, v in peak.items()) + f" {request.node.nodeid}\n")


def _out():
    out = os.environ.get("OUT")
    return out if out and os.path.isdir(out) else None


def pytest_runtest_logstart(nodeid, location):
    """$OUT/started.txt: every test as it starts, so a run cut off at its time limit shows which never finished
    (started.txt less timings.txt)."""
    if _out():
        with open(os.path.join(_out(), "started.txt"), "a") as f:
            f.write(nodeid + "\n")


def pytest_runtest_logreport(report):
    """When $OUT names an output folder (a GPU machine's run), each test's duration goes to $OUT/timings.txt and each
    failure to $OUT/failures.txt as it happens: a run stopped at the device's time limit never prints pytest's
    summary."""
    out = _out()
    if out and (report.when == "call" or report.skipped):
        with open(os.path.join(out, "timings.txt"), "a") as f:
            f.write(f"{report.duration:8.1f} {report.outcome} {report.nodeid}\n")
    if not report.failed or not out:
        return
    with open(os.path.join(out, "failures.txt"), "a") as f:
        f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-6000:]}\n")


def pytest_sessionfinish(session, exitstatus):
    """When $OUT names an output folder (a GPU machine's run), keep the CUDA kernel metrics the tests produced: which path
    each op ran on, plan cache events, build times."""
    out = os.environ.get("OUT")
    if not out or not os.path.isdir(out):
        return
    try:
        from prometheus_client import generate_latest

        from convkernels import REGISTRY
    except ImportError:
        return
    lines = [ln for ln in generate_latest(REGISTRY).decode().splitlines()
             if 'backend="cuda"' in ln and not ln.startswith("#") and "_bucket" not in ln]
    with open(os.path.join(out, "gpu_metrics.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
