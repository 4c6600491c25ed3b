"""Shared fixtures: real convserve servers (`python -m service.cli serve`, the README's path) on
free localhost ports in subprocesses, with the tiny presets and random weights; and the backends
the op suite runs on (op_backends.py)."""
from __future__ import annotations

import os
import signal

import pytest

# CONVSERVE_TEST_GPU_SPREAD=N on a machine of N GPUs: pytest-xdist worker gwK sees only GPU K mod N,
# so the GPU suite runs N times as wide (set before anything starts CUDA; tests needing two GPUs
# then skip, and run in a pass of their own)
if os.environ.get("CONVSERVE_TEST_GPU_SPREAD") and os.environ.get("PYTEST_XDIST_WORKER", "").startswith("gw"):
    os.environ["CUDA_VISIBLE_DEVICES"] = str(int(os.environ["PYTEST_XDIST_WORKER"][2:])
                                             % int(os.environ["CONVSERVE_TEST_GPU_SPREAD"]))

# Under pytest-xdist each worker's PyTorch (the references) takes its share of the cores, not all
# of them (16 workers of 16 threads on 16 cores): the GPU suite's unfinished tail on 2026-11-26 was
# its full-size CPU references (Wan 2.2's full preset in float32)
if os.environ.get("PYTEST_XDIST_WORKER_COUNT"):
    try:
        import torch
    except ImportError:
        torch = None
    if torch is not None:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

# tests import helpers from live_server and op_backends, never `from conftest` (tests/gpu has a
# conftest too)
from live_server import LiveServer, start_server
from op_backends import HALF_TARGETS, TARGETS, Target, available, target_params


#: every server the factory started, in order, and those a session-scoped fixture keeps
_STARTED: list[LiveServer] = []
_SESSION_OWNED: set[int] = set()
#: the servers of the module that ended last: told to stop, not yet waited for
_DRAINING: list[LiveServer] = []


def _tell_to_stop(servers: list[LiveServer]) -> None:
    for s in servers:
        if s.proc.poll() is None:
            s.proc.send_signal(signal.SIGTERM)


def _stop_all(servers: list[LiveServer]) -> None:
    """All told to drain at once, then waited for (one by one, the drains' grace added up to
    ~34 s at the end of the suite)."""
    _tell_to_stop(servers)
    for s in servers:
        s.stop()


@pytest.fixture(scope="session")
def server_factory(tmp_path_factory):
    """start(**settings) -> LiveServer. A server lives until the end of the test module that
    started it (_servers_end_with_their_module), one a session fixture owns until the session's."""
    log_dir = tmp_path_factory.mktemp("servers")

    def start(**settings) -> LiveServer:
        s = start_server(log_dir, **settings)
        _STARTED.append(s)
        return s

    yield start
    _stop_all(_STARTED)


@pytest.fixture(scope="module", autouse=True)
def _servers_end_with_their_module():
    """Servers a module started stop when it ends: kept to the session's end, 35 modules' idle
    servers (three processes each) held memory and woke the CPU through every later module."""
    first = len(_STARTED)
    yield
    # Told to stop now, waited for when the next module ends: an idle server takes ~0.5 s to
    # drain and exit, a module's several ~1-2 s, which the test process spent waiting at each
    # of 35 modules' ends. By the next module's end they are long gone, so that wait is nil.
    # (The session's end waits for all: server_factory's teardown.)
    ended, _DRAINING[:] = list(_DRAINING), [s for s in _STARTED[first:] if id(s) not in _SESSION_OWNED]
    _tell_to_stop(_DRAINING)
    for s in ended:
        s.stop()


@pytest.fixture(scope="session")
def live_server(server_factory) -> LiveServer:
    """The default model set (tiny-vae, tiny-convnext, tiny-wan-vae), default limits."""
    s = server_factory(models="tiny-vae,tiny-convnext,tiny-wan-vae")
    _SESSION_OWNED.add(id(s))
    return s


@pytest.fixture(params=target_params(TARGETS))
def target(request) -> Target:
    """Each backend in each dtype it computes in (op_backends.TARGETS); skipped where it cannot run."""
    return available(request)


@pytest.fixture(params=target_params(HALF_TARGETS))
def half_target(request) -> Target:
    """The half-precision dtypes of the backends that have them."""
    return available(request)
