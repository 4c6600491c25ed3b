"""Recovery from an out-of-memory decode (always on; production, not injection).

A decode that raises MemoryError (CuPy's OutOfMemoryError is one; the NumPy backend raises it too)
is retried on the worker thread, first row by row when the batch has several rows, then in tiles,
each retry in the model's next smaller tiling (its `smaller_tiling` answer, models/contract.py),
down to the model's floor. When every retry fails the request gets DeviceOutOfMemory (503 +
Retry-After), never a crash. A streamed video decode (`frames`) resumes in tiles from the frame
group that ran out, after decoding again (and dropping) the groups already sent. Every step is
counted in `convserve_faults_total{model,fault="device_oom",outcome}`."""
from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from models.contract import TiledDecoder

from ..hosted_model import HostedModel
from ..ipc.worker_errors import DeviceOutOfMemory
from ..metrics import count_fault as count

log = logging.getLogger("convserve.faults")

#: retries in ever smaller tiles after the first tiled attempt
MAX_SMALLER_TILES = 3


@contextmanager
def _tiling(model: TiledDecoder, tiling):
    # the worker thread is the only one running this model, so a temporary swap is safe; a streamed
    # decode already holds its own tile plan (made when it started)
    old = model.tiling
    model.tiling = tiling
    try:
        yield
    finally:
        model.tiling = old


def decode(hm: HostedModel, x: np.ndarray, *, tiled: bool | None, clamp: bool, uint8: bool = False,
           alpha: bool = False) -> np.ndarray:
    """hm.decode(x), retried on MemoryError: row by row, then tiled, then in smaller tiles."""
    try:
        return hm.decode(x, tiled, clamp, uint8, alpha)
    except MemoryError as exc:
        log.warning("%s: out of memory decoding %s (%s); retrying in tiles", hm.name, x.shape, exc)
        count(hm.name, "device_oom", "retried")
    if x.shape[0] > 1:
        out = np.concatenate([_retry_tiled(hm, x[i:i + 1], clamp, uint8, alpha) for i in range(x.shape[0])], axis=0)
    else:
        out = _retry_tiled(hm, x, clamp, uint8, alpha)
    count(hm.name, "device_oom", "recovered")
    return out


def _retry_tiled(hm: HostedModel, x: np.ndarray, clamp: bool, uint8: bool, alpha: bool) -> np.ndarray:
    return _in_smaller_tiles(hm, _tilings_to_try(hm.model), lambda: hm.decode(x, True, clamp, uint8, alpha), None,
                             f"decoding {tuple(x.shape)}")


def frames(hm: HostedModel, latents: np.ndarray, tiled: bool | None, uint8: bool = False) -> Iterator[np.ndarray]:
    """The frame groups of a streamed video decode, retried on MemoryError: the decode restarts
    tiled, then in smaller tiles, decodes again (and drops) the groups already sent, so its causal
    caches hold what they held, and goes on from the group that failed. Groups already sent stay
    as they were. The decode starts now, so bad latents raise before any group."""
    first = hm.model.decode_frames(latents, tiled=tiled, uint8=uint8)

    def groups() -> Iterator[np.ndarray]:
        gen, sent, recovering = first, 0, False
        attempts = _tilings_to_try(hm.model)
        try:
            while True:
                try:
                    group = next(gen)
                except StopIteration:
                    return
                except MemoryError as exc:
                    gen.close()
                    log.warning("%s: out of memory at frame group %d of a streamed decode (%s); resuming in tiles",
                                hm.name, sent, exc)
                    count(hm.name, "device_oom", "retried")
                    gen, recovering = _resumed_tiled(hm, latents, sent, attempts, exc, uint8), True
                    continue
                if recovering:
                    count(hm.name, "device_oom", "recovered")
                    recovering = False
                sent += 1
                yield group
        finally:
            gen.close()

    return groups()


def _tilings_to_try(model: TiledDecoder) -> Iterator:
    """The model's own tiling, then ever smaller ones (at most MAX_SMALLER_TILES)."""
    tiling = model.tiling
    yield tiling
    for _ in range(MAX_SMALLER_TILES):
        tiling = model.smaller_tiling(tiling)
        if tiling is None:
            return
        yield tiling


def _resumed_tiled(hm: HostedModel, latents: np.ndarray, sent: int, attempts: Iterator, exc: BaseException,
                   uint8: bool):
    """A tiled decode advanced past the `sent` groups, in the first of `attempts` that fits them.
    Its next group may still run out of memory: the caller then asks again with the next tiling."""
    def advanced():
        gen = hm.model.decode_frames(latents, tiled=True, uint8=uint8)  # its tile plan is made here, from this tiling
        try:
            for _ in range(sent):
                next(gen)
        except MemoryError:
            gen.close()
            raise
        return gen

    return _in_smaller_tiles(hm, attempts, advanced, exc, f"in a streamed decode after {sent} frame groups,")


def _in_smaller_tiles(hm: HostedModel, attempts: Iterator, run, last: BaseException | None, what: str):
    """run() in the first tiling of `attempts` that does not run out of memory."""
    for i, tiling in enumerate(attempts):
        if i:
            count(hm.name, "device_oom", "retried")
        try:
            with _tiling(hm.model, tiling):
                return run()
        except MemoryError as exc:
            last = exc
    count(hm.name, "device_oom", "failed")
    raise DeviceOutOfMemory(f"out of device memory {what} even in the smallest tiles tried ({last})") from last
