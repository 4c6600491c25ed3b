"""Copies on the CUDA backend that move whole contiguous blocks: device to device as one
cudaMemcpyAsync, device to host on a side stream into pinned memory.

Why not CuPy's `dst[...] = src`: that is an elementwise kernel with one element per thread,
and for 2-byte elements (float16, bfloat16 bits) it ran at about a third of the copy engine's
rate (Wan 2.1 decode, H100, 2026-11-25: 68 ms in 438 `cupy_copy` launches). A block copy is
also a plain memcpy node in a CUDA graph.
"""
from __future__ import annotations

import numpy as np


def is_block(x) -> bool:
    """x covers one contiguous run of device memory (a C-contiguous array or view)."""
    return x.flags.c_contiguous


def copy_into(cp, dst, src) -> None:
    """dst[...] = src on the current stream; one memcpy when both are contiguous blocks of the
    same dtype and size, CuPy's elementwise copy (any strides, casts) otherwise."""
    if dst.dtype == src.dtype and dst.size == src.size and is_block(dst) and is_block(src):
        if dst.size:
            dst.data.copy_from_device_async(src.data, dst.nbytes)
        return
    dst[...] = src


def axis_blocks(shape, axis: int) -> bool:
    """Parts joined along `axis` land in contiguous blocks of a C-ordered result: every axis
    before it has size 1 (a single video's frames along time, for instance)."""
    return all(s == 1 for s in shape[:axis])


class HostTransfer:
    """A device -> host copy under way; result() waits for it. The device array it reads is
    kept alive until then (the copy runs on another stream, after the work that made it)."""

    def __init__(self, host: np.ndarray, done, source):
        self._host, self._done, self._source = host, done, source

    def result(self) -> np.ndarray:
        if self._done is not None:
            self._done.synchronize()
            self._done = self._source = None
        return self._host

    def __del__(self):
        # dropped unread (a client that left mid-stream): the pinned buffer goes back to CuPy's
        # pool, which does not know a copy may still be writing into it; let the copy finish
        done = getattr(self, "_done", None)
        if done is not None:
            try:
                done.synchronize()
            except Exception:  # at interpreter exit the CUDA context may already be gone
                pass


def start_to_host(cp, side_stream, wide) -> HostTransfer:
    """Copy the contiguous device array `wide` (owned by the caller, not reused: a fresh array)
    into pinned host memory on `side_stream`, after everything queued on the current stream so
    far; the current stream goes on with the next work meanwhile."""
    import cupyx

    made = cp.cuda.Event(disable_timing=True)
    made.record()
    side_stream.wait_event(made)
    host = cupyx.empty_pinned(wide.shape, dtype=wide.dtype)
    if wide.size:
        cp.cuda.runtime.memcpyAsync(host.ctypes.data, wide.data.ptr, wide.nbytes,
                                    cp.cuda.runtime.memcpyDeviceToHost, side_stream.ptr)
    # block=True: result() sleeps until the copy is done instead of spinning a core (cudaEventBlockingSync).
    # A model worker waits here once a batch; spinning cost it about a fifth of its CPU under one-image
    # encode load (py-spy, H200, 2026-11-28), CPU its front ends and its next batch's stacking want.
    done = cp.cuda.Event(disable_timing=True, block=True)
    done.record(side_stream)
    return HostTransfer(host, done, wide)
