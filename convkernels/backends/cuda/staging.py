"""Host batches assembled straight into pinned memory, so that their upload is one DMA and no
host copy.

Why: CuPy's `asarray` of an ordinary (pageable) NumPy array first copies it into pinned memory of
its own, then uploads that. A model worker stacking one-image requests into a batch paid for two
host copies of every image, the stack and CuPy's, each about 15 % of its device thread under
ConvNeXt one-image load (py-spy, H200, 2026-11-29). Stacked here, the stack is the only copy.

Rules (one owner: the thread that stacks a batch and then uploads it, the worker's device thread):
- `take(shape, dtype)` hands out the next of SLOTS pinned buffers, round robin, as an array of
  that shape; None above MAX_SLOT_BYTES (the caller assembles it anywhere: the ordinary upload).
- `upload(host)` recognises a taken buffer by its address and starts its DMA on the current
  stream, then records an event; anything else is not its business (None).
- A slot is handed out again only once its last upload has finished (the event, waited for
  asleep). With one batch run ahead, the upload SLOTS batches ago is long done by then.
"""
from __future__ import annotations

import numpy as np

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
