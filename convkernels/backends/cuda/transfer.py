"""Copies on the CUDA backend that move whole contiguous blocks: device to device as one
cudaMemcpyAsync, device to host on a side stream into pinned memory, and host batches stacked
in pinned memory and uploaded from there (PinnedStaging).

Why not CuPy's `dst[...] = src`: that is an elementwise kernel with one element per thread,
and for 2-byte elements (float16, bfloat16 bits) it ran at about a third of the copy engine's
rate (Wan 2.1 decode, H100, 2026-11-25: 68 ms in 438 `cupy_copy` launches). A block copy is
also a plain memcpy node in a CUDA graph.
"""
from __future__ import annotations

import threading

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


# ---- host batches stacked in pinned memory ----------------------------------------------------
# PinnedStaging: host batches assembled straight into pinned memory, so that their upload is one DMA and no
# host copy.
#
# Why: CuPy's `asarray` of an ordinary (pageable) NumPy array first copies it into pinned memory of
# its own, then uploads that. A model worker stacking one-image requests into a batch paid for two
# host copies of every image, the stack and CuPy's, each about 15 % of its device thread under
# ConvNeXt one-image load (py-spy, H200, 2026-11-29). Stacked here, the stack is the only copy.
#
# Rules (one owner: the thread that stacks a batch and then uploads it, the worker's device thread):
# - `take(shape, dtype)` hands out the next of SLOTS pinned buffers, round robin, as an array of
#   that shape; None above MAX_SLOT_BYTES (the caller assembles it anywhere: the ordinary upload).
# - `upload(host)` recognises a taken buffer by its address and starts its DMA on the current
#   stream, then records an event; anything else is not its business (None).
# - A slot is handed out again only once its last upload has finished (the event, waited for
#   asleep). With one batch run ahead, the upload SLOTS batches ago is long done by then.
#
SLOTS = 3
#: larger batches (video latents, 4K images) are rare and take the ordinary path
MAX_SLOT_BYTES = 64 << 20


class _Slot:
    __slots__ = ("buffer", "uploaded")

    def __init__(self, buffer: np.ndarray):
        self.buffer = buffer  # pinned uint8 bytes
        self.uploaded = None  # the event after this slot's last upload


class PinnedStaging:
    def __init__(self, cp, slots: int = SLOTS, max_slot_bytes: int = MAX_SLOT_BYTES):
        self.cp = cp
        self.max_slot_bytes = max_slot_bytes
        self._slots: list[_Slot | None] = [None] * slots
        self._next = 0
        self._by_address: dict[int, _Slot] = {}

    def take(self, shape: tuple, dtype) -> np.ndarray | None:
        dtype = np.dtype(dtype)
        nbytes = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
        if nbytes == 0 or nbytes > self.max_slot_bytes:
            return None
        i = self._next
        self._next = (i + 1) % len(self._slots)
        slot = self._slots[i]
        if slot is not None and slot.uploaded is not None:
            slot.uploaded.synchronize()  # its last upload must be done before it is written again
            slot.uploaded = None
        if slot is None or slot.buffer.nbytes < nbytes:
            import cupyx
            if slot is not None:
                self._by_address.pop(slot.buffer.ctypes.data, None)
            # room to grow: the next batch of the same kind is often a few rows larger
            slot = _Slot(cupyx.empty_pinned(min(max(nbytes * 2, 1 << 20), self.max_slot_bytes), np.uint8))
            self._slots[i] = slot
            self._by_address[slot.buffer.ctypes.data] = slot
        return slot.buffer[:nbytes].view(dtype).reshape(shape)

    def upload(self, host: np.ndarray):
        """A device copy of `host` if it is a taken buffer (its DMA queued on the current stream),
        else None."""
        slot = self._by_address.get(host.ctypes.data) if host.flags.c_contiguous else None
        if slot is None:
            return None
        cp = self.cp
        dev = cp.empty(host.shape, dtype=host.dtype)
        if host.nbytes:
            stream = cp.cuda.get_current_stream()
            cp.cuda.runtime.memcpyAsync(dev.data.ptr, host.ctypes.data, host.nbytes,
                                        cp.cuda.runtime.memcpyHostToDevice, stream.ptr)
            slot.uploaded = cp.cuda.Event(disable_timing=True, block=True)
            slot.uploaded.record(stream)
        return dev


# ---- large pageable host arrays, copied into pinned memory by several threads -----------------
# ParallelUpload: a large ordinary (pageable) host array put on the device by copying it into a
# pinned buffer in parts, on several threads, each part's DMA queued as soon as it is in.
#
# Why: CuPy's upload of a pageable array is one thread's copy into pinned memory, then the DMA.
# For ConvNeXt-T b128 float32 pixels (77 MB) that took 15.8 ms where the DMA alone takes 1.4 and
# the network 6.9 (one H200, 16-core host, 2026-11-29, benchmarks/gpu/host_upload.py): one core
# copies at ~5 GB/s. Copied by 8 threads in 32 parts, with the parts' DMAs overlapping the copies,
# the same upload took 3.5 ms; registering the array's pages in place (cudaHostRegister) took 5.4.
#
# Rules (one owner: the thread that uploads, a model's device thread):
# - Only C-contiguous arrays of at least MIN_BYTES go this way; smaller ones cost less than the
#   threads' start (the staging slots and CuPy's own path take them).
# - The pool's threads only copy bytes (np.copyto releases the GIL); every CUDA call (each part's
#   DMA, the event) is made by the owner, on its current stream, in part order, as parts land.
# - One pinned buffer, grown to the largest array seen, reused once its last upload's event has
#   fired (waited for asleep): the next large upload usually comes a whole forward later.
#
MIN_BYTES = 16 << 20
PART_BYTES = 2 << 20


class ParallelUpload:
    def __init__(self, cp, threads: int | None = None):
        import os

        self.cp = cp
        self.threads = threads or max(1, min(8, (os.cpu_count() or 2) // 2))
        self._pool = None
        self._buffer: np.ndarray | None = None  # pinned uint8 bytes
        self._uploaded = None  # the event after the buffer's last upload

    def takes(self, host: np.ndarray) -> bool:
        return self.threads > 1 and host.nbytes >= MIN_BYTES and host.flags.c_contiguous

    def upload(self, host: np.ndarray):
        """A device copy of `host` (which `takes`), its DMAs queued on the current stream."""
        from concurrent.futures import ThreadPoolExecutor

        cp = self.cp
        n = host.nbytes
        buffer = self._pinned(n)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="pinned-upload")
        src = host.reshape(-1).view(np.uint8)
        parts = max(self.threads, -(-n // PART_BYTES))
        bounds = [n * i // parts // 64 * 64 for i in range(parts)] + [n]

        def copy(a: int, b: int) -> None:
            np.copyto(buffer[a:b], src[a:b])

        dev = cp.empty(host.shape, dtype=host.dtype)
        stream = cp.cuda.get_current_stream()
        rt = cp.cuda.runtime
        spans = list(zip(bounds[:-1], bounds[1:]))
        for (a, b), future in zip(spans, [self._pool.submit(copy, a, b) for a, b in spans]):
            future.result()  # in part order: later parts are being copied meanwhile
            if b > a:
                rt.memcpyAsync(dev.data.ptr + a, buffer.ctypes.data + a, b - a, rt.memcpyHostToDevice, stream.ptr)
        self._uploaded = cp.cuda.Event(disable_timing=True, block=True)
        self._uploaded.record(stream)
        return dev

    def _pinned(self, nbytes: int) -> np.ndarray:
        if self._uploaded is not None:
            self._uploaded.synchronize()  # its last DMAs must be done before it is written again
            self._uploaded = None
        if self._buffer is None or self._buffer.nbytes < nbytes:
            import cupyx
            self._buffer = None  # the old one back to CuPy's pinned pool first
            self._buffer = cupyx.empty_pinned(nbytes, np.uint8)
        return self._buffer


# ---- host memory pinned where it lies: a batch gathered from its requests' own blocks ----------
# PinnedRegion: the low pages of a front end's shared-memory arena, pinned in place in the model
# worker (cudaHostRegister), so that a batch of requests is gathered on the device straight from
# the blocks the front ends wrote: one DMA a request and no host copy (gather_rows).
#
# Why: the batch was stacked into a pinned buffer first. Under ConvNeXt-T one-image load that
# host copy was 38 % of the worker's device thread's busy samples (27 uint8 images of 150 KB a
# batch; one H200, 2026-11-30, py-spy --native), about 30 us of CPU a request.
#
# Rules:
# - A region is pinned for the first batch gathered from its front end's arena and unpinned
#   (`release`) when that front end's link ends, before the arena's mapping may go
#   (service/worker/frontend_link.py does both, under the link's lock).
# - gather_rows (a model's device thread) holds every region it reads from locked while it queues
#   the DMAs and records the event after them; `release` takes the lock, marks the region gone,
#   waits for its last DMAs' event, then unpins. So no DMA is queued from, or still reading, pages
#   no longer pinned.
# - A part outside every live region (a block above the pinned pages, a front end gone) makes
#   gather_rows answer None: the caller stacks that batch the ordinary way.

class PinnedRegion:
    def __init__(self, cp, address: int, nbytes: int):
        cp.cuda.runtime.hostRegister(address, nbytes, 0)
        self.cp, self.address, self.end = cp, address, address + nbytes
        self.lock = threading.Lock()
        self.live = True
        self.uploaded = None  # the event after the last DMAs from here

    def covers(self, ptr: int, nbytes: int) -> bool:
        return self.live and self.address <= ptr and ptr + nbytes <= self.end

    def release(self) -> None:
        with self.lock:
            if not self.live:
                return
            self.live = False
            if self.uploaded is not None:
                self.uploaded.synchronize()
            self.cp.cuda.runtime.hostUnregister(self.address)


def gather_rows(cp, parts: list[np.ndarray], regions: list[PinnedRegion | None], addresses: list[int] | None = None):
    """The parts (C-contiguous, one dtype and row shape; parts[i] in regions[i]) joined along axis
    0 on the device, each part's DMA queued on the current stream from where it lies; None (and
    nothing queued) where a part is not in its live region. Each part's address is read once, or
    not at all where `addresses` gives it (non-zero): `ndarray.ctypes` costs ~2-3 us, a sizeable
    share of this function's cost a row; the caller vouches that a given address is the part's."""
    if not parts or any(r is None for r in regions) or any(not p.flags.c_contiguous for p in parts):
        return None
    if addresses is None:
        addresses = [0] * len(parts)
    spans = [(a or p.ctypes.data, p.nbytes) for p, a in zip(parts, addresses)]
    held = list({id(r): r for r in regions}.values())
    for region in held:
        region.lock.acquire()
    try:
        if not all(r.covers(ptr, n) for (ptr, n), r in zip(spans, regions)):
            return None
        first = parts[0]
        dev = cp.empty((sum(p.shape[0] for p in parts), *first.shape[1:]), dtype=first.dtype)
        stream, rt, at = cp.cuda.get_current_stream(), cp.cuda.runtime, dev.data.ptr
        for ptr, n in spans:
            if n:
                rt.memcpyAsync(at, ptr, n, rt.memcpyHostToDevice, stream.ptr)
                at += n
        done = cp.cuda.Event(disable_timing=True, block=True)
        done.record(stream)
        for region in held:
            region.uploaded = done
        return dev
    finally:
        for region in held:
            region.lock.release()
