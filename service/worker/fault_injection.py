"""Injected faults (the CONVSERVE_FAULT_* settings, docs/interfaces.md), for tests and chaos drills
on any machine; used only when one is set, and armed only after warm-up, so a server always starts.
The memory limit acts as a device with little free memory would (smaller tiles fit, larger ones do
not), the poison value as a bug inside a model (the worker must fail that batch only and keep
serving); the hold lets a test know when a request occupies the worker and decide for how long,
instead of guessing how long a decode takes on a loaded machine. The faults are survived by the
production paths (oom_recovery.py, the worker) and counted in `convserve_faults_total`."""
from __future__ import annotations

import ctypes
import logging
import time
from pathlib import Path
from typing import Callable

import numpy as np

from convkernels import Backend, ConvSpec

from ..settings import FaultSettings

log = logging.getLogger("convserve.faults")

__all__ = ["CallCheck", "FaultSettings", "arm", "arm_if_configured", "shard_fault"]


def _nbytes(shape, itemsize: int = 4) -> int:
    return int(np.prod([int(s) for s in shape], dtype=np.int64)) * itemsize


def _conv_out_shape(x_shape, w_shape, spec: ConvSpec) -> tuple[int, ...]:
    """Output shape of a channels-last conv (enough for a size check: stride and transpose only)."""
    spatial = [s * st if spec.transpose else -(-s // st) for s, st in zip(x_shape[1:-1], spec.stride)]
    return (x_shape[0], *spatial, w_shape[0])


#: a check run on a model call's inputs before the call (Batcher's `before_call`)
CallCheck = Callable[[np.ndarray], None]


def arm(backend: Backend, settings: FaultSettings) -> CallCheck | None:
    """Install the injection the settings name: the memory limit through the backend's conv seam
    (`Backend.before_conv`); the model-call faults are the check returned, or None without them."""
    limit = settings.oom_above_bytes
    if limit is not None:
        def conv_memory_limit(x, w, spec) -> None:
            need = max(_nbytes(x.shape), _nbytes(_conv_out_shape(tuple(x.shape), tuple(w.shape), spec)))
            if need > limit:
                raise MemoryError(f"injected device out of memory: conv activation of {need} bytes "
                                  f"> CONVSERVE_FAULT_OOM_ABOVE_BYTES={limit}")

        backend.before_conv = conv_memory_limit
        log.warning("fault injection armed: conv activations above %d bytes raise MemoryError", limit)
    if settings.poison_value is None and settings.hold_value is None:
        return None
    if settings.poison_value is not None:
        log.warning("fault injection armed: model calls on inputs holding %r raise", settings.poison_value)
    if settings.hold_value is not None:
        log.warning("fault injection armed: model calls on inputs holding %r wait for %s",
                    settings.hold_value, settings.hold_release_file)
    return lambda inputs: _call_faults(inputs, settings)


def arm_if_configured(backend: Backend) -> CallCheck | None:
    """arm() with the CONVSERVE_FAULT_* settings; with none set nothing is touched and no check is
    returned: a production server never runs this module's code per request."""
    settings = FaultSettings()
    return arm(backend, settings) if settings.active else None


#: the longest an injected hold keeps the worker, should a test never release it
HOLD_MAX_S = 120.0


def _holds(inputs: np.ndarray, value: float | None) -> bool:
    return value is not None and inputs.dtype.kind == "f" and bool((inputs == np.float32(value)).any())


def _call_faults(inputs: np.ndarray, settings: FaultSettings) -> None:
    """Raise on the poison value; wait for the release file on the hold value."""
    if _holds(inputs, settings.poison_value):
        raise RuntimeError(f"injected worker fault: inputs hold the poison value {settings.poison_value!r}")
    if _holds(inputs, settings.hold_value):
        release = Path(settings.hold_release_file or "")
        if settings.hold_release_file:
            release.with_name(release.name + ".holding").touch()
        if settings.hold_lock_s:
            # a PyDLL function keeps the interpreter lock through its call: libc's sleep() then
            # stands for a long C call that never lets the lock go
            ctypes.PyDLL(None).sleep(int(settings.hold_lock_s))
        deadline = time.monotonic() + HOLD_MAX_S
        while not (settings.hold_release_file and release.exists()) and time.monotonic() < deadline:
            time.sleep(0.005)


class _FailingComm:
    """A shard's communicator that fails every collective (CONVSERVE_FAULT_SHARD_FAIL_RANK)."""

    def __init__(self, rank: int):
        self.rank = rank

    def _fail(self, *_, **__):
        raise RuntimeError(f"injected failure of shard {self.rank} (CONVSERVE_FAULT_SHARD_FAIL_RANK)")

    exchange_rows = allreduce_sum = allgather = _fail


def shard_fault():
    """With CONVSERVE_FAULT_SHARD_FAIL_RANK=k (and CONVSERVE_FAULT_SHARD_FAIL_FILE, only while that
    file exists): a wrapper (comm, rank) -> comm that makes rank k of
    every sharded decode fail at its first collective, as a shard's GPU failing mid-decode would;
    else None. Read once, when a worker starts."""
    settings = FaultSettings()
    rank, gate = settings.shard_fail_rank, settings.shard_fail_file
    if rank is None:
        return None
    log.warning("fault injection armed: shard %d of every sharded decode fails%s", rank,
                f" while {gate} exists" if gate else "")

    def wrap(comm, r):
        failing = r == rank and (gate is None or Path(gate).exists())
        return _FailingComm(r) if failing else comm
    return wrap
