"""Tensors between an HTTP front end and the model workers, in shared memory (never pickled).

Each front-end process owns one `Arena`: an anonymous shared-memory file (`memfd_create` on
Linux; an unlinked temporary file elsewhere) mapped once, with a first-fit allocator over it. The
file descriptor goes to every model worker over the worker's Unix socket (SCM_RIGHTS, see
service/frontend/engine.py), and the worker maps the same pages (`ArenaView`). A request's inputs
are written into blocks of its front end's arena; the worker reads them there and writes the
outputs into blocks the front end allocated beforehand (it knows every output's shape), so each
tensor crosses the process boundary with no copy beyond the one into the arena.

Why a memfd and not /dev/shm: nothing is left behind when a process dies (the pages go with the
last mapping), and containers' small /dev/shm (Docker's default is 64 MiB) does not bound it. The
file is sparse: pages cost memory only once touched, and `trim()` gives large idle regions back.

Rules the rest keeps:
- Only the front end allocates and frees; the worker only reads inputs and writes outputs.
- A block is freed only after the worker has answered for it (result, failure, or its death),
  never while a submitted request may still write into it (service/frontend/engine.py's Lease).
- A worker may pin the low pages of a mapping in place for its GPU's DMAs; it unpins them before
  it releases the mapping (service/worker/frontend_link.py), so no pinned page outlives its mapping.
- A worker's mapping of a front end's arena lives as long as that front end's link: the worker
  `release()`s it when the link ends (the front end stopped or died), and it is unmapped then, or,
  while arrays still view it (a running batch's inputs), at the first `sweep()` after they are
  gone; a dead front end's pages never stay mapped in a worker. The worker keeps no descriptor of
  it (the mapping holds the file), so each front end is one memfd in a worker's /proc/<pid>/fd."""
from __future__ import annotations

import math
import mmap
import os
import sys
import tempfile
import threading
from bisect import insort

import msgspec
import numpy as np

#: blocks start on page boundaries: arrays are aligned for any dtype, and trims work per page
ALIGN = mmap.PAGESIZE
#: after a burst, what stays mapped and resident below this offset is kept for the next one
KEEP_RESIDENT_BYTES = 256 << 20


class ArenaFull(Exception):
    """No free block of the size asked for right now (the arena is shared by requests in flight)."""


class TooLarge(ArenaFull):
    """The block asked for exceeds the whole arena: no amount of waiting makes it fit."""


class TensorRef(msgspec.Struct, array_like=True, frozen=True):
    """Where a tensor lies in an arena: what travels in a message instead of the data (a field
    of service/ipc/worker_protocol.py's messages)."""
    offset: int
    shape: tuple[int, ...]
    dtype: str

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _dtype(self.dtype).itemsize


_DTYPES: dict[str, np.dtype] = {}


def _dtype(name: str) -> np.dtype:
    """np.dtype(name), kept: a request's blocks are viewed three times in the worker, and the
    dtype's parse was a third of each view's cost."""
    dt = _DTYPES.get(name)
    if dt is None:
        dt = _DTYPES[name] = np.dtype(name)
    return dt


def _round_up(n: int) -> int:
    return max(ALIGN, -(-n // ALIGN) * ALIGN)


def _anonymous_file(size: int) -> int:
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("convserve-arena", os.MFD_CLOEXEC)
    else:  # macOS: an unlinked file; MAP_SHARED pages of it are shared all the same
        fd, path = tempfile.mkstemp(prefix="convserve-arena-")
        os.unlink(path)
    os.ftruncate(fd, size)
    return fd


class _Mapping:
    """A shared mapping of an arena file and numpy views into it."""

    def __init__(self, fd: int, size: int):
        self.fd, self.size = fd, size
        self.map = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        self._buf = np.frombuffer(self.map, dtype=np.uint8)

    @property
    def address(self) -> int:
        """Where the mapping starts in this process (0 once released)."""
        return 0 if self._buf is None else self._buf.ctypes.data

    def array(self, ref: TensorRef) -> np.ndarray:
        """The tensor at `ref`, as a view of the shared pages (writable)."""
        buf, dt = self._buf, _dtype(ref.dtype)
        n = math.prod(ref.shape) * dt.itemsize
        if buf is None:
            raise ValueError("the arena is released (its front end is gone)")
        if ref.offset < 0 or ref.offset + n > self.size:
            raise ValueError(f"tensor {ref} lies outside the arena ({self.size} bytes)")
        # one constructor, not a slice, a view and a reshape: a third of the cost per request
        return np.ndarray(ref.shape, dt, buf, ref.offset)

    def close(self) -> None:
        self._buf = None
        try:
            self.map.close()
        except BufferError:  # a view still exported: the mapping goes when the last view does
            pass
        os.close(self.fd)


class Arena(_Mapping):
    """The front end's side: the file, the mapping and the allocator (thread-safe: the event
    loop and the codec threads allocate and free)."""

    def __init__(self, size: int):
        size = _round_up(size)
        super().__init__(_anonymous_file(size), size)
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, size)]  # (offset, length), sorted by offset
        self._used: dict[int, int] = {}
        self.used_bytes = 0
        self.peak_bytes = 0
        self._high_water = 0

    def alloc(self, nbytes: int) -> int:
        """The offset of a fresh block of at least `nbytes` (TooLarge / ArenaFull if none)."""
        n = _round_up(nbytes)
        if n > self.size:
            raise TooLarge(f"{nbytes} bytes exceed the shared-memory arena of {self.size} bytes "
                           "(CONVSERVE_SHM_BYTES)")
        with self._lock:
            for i, (off, length) in enumerate(self._free):
                if length >= n:
                    if length == n:
                        del self._free[i]
                    else:
                        self._free[i] = (off + n, length - n)
                    self._used[off] = n
                    self.used_bytes += n
                    self.peak_bytes = max(self.peak_bytes, self.used_bytes)
                    self._high_water = max(self._high_water, off + n)
                    return off
        raise ArenaFull(f"no {n} free bytes in the shared-memory arena now ({self.used_bytes} of {self.size} in use)")

    def free(self, offset: int) -> None:
        with self._lock:
            n = self._used.pop(offset)
            self.used_bytes -= n
            insort(self._free, (offset, n))
            self._coalesce()
            idle = self.used_bytes == 0
        if idle:
            self.trim()

    def _coalesce(self) -> None:
        merged: list[tuple[int, int]] = []
        for off, length in self._free:
            if merged and merged[-1][0] + merged[-1][1] == off:
                merged[-1] = (merged[-1][0], merged[-1][1] + length)
            else:
                merged.append((off, length))
        self._free = merged

    def trim(self) -> None:
        """Give the pages above KEEP_RESIDENT_BYTES back to the system once a burst is over (the
        allocator fills from the bottom, so steady traffic lives below that line)."""
        with self._lock:
            if self.used_bytes or self._high_water <= KEEP_RESIDENT_BYTES:
                return
            start, stop = KEEP_RESIDENT_BYTES, self._high_water
            self._high_water = KEEP_RESIDENT_BYTES
        if sys.platform.startswith("linux") and hasattr(mmap, "MADV_REMOVE"):
            self.map.madvise(mmap.MADV_REMOVE, start, stop - start)

    def put(self, arr: np.ndarray) -> TensorRef:
        """A block holding a copy of `arr` (float64 and strided inputs are copied as they are)."""
        ref = self.reserve(arr.shape, arr.dtype)
        np.copyto(self.array(ref), arr, casting="no")
        return ref

    def reserve(self, shape, dtype) -> TensorRef:
        shape = tuple(int(s) for s in shape)
        dt = np.dtype(dtype)
        return TensorRef(self.alloc(math.prod(shape) * dt.itemsize), shape, dt.str)


class ArenaView(_Mapping):
    """A model worker's mapping of one front end's arena, from the descriptor it was sent (closed
    once mapped: the mapping holds the file)."""

    def __init__(self, fd: int, size: int):
        try:
            super().__init__(fd, size)
        finally:
            os.close(fd)
        self.fd = -1

    def release(self) -> None:
        """Its front end's link ended: unmap now, or at a `sweep()` once no array views it."""
        self._buf = None
        if not self._unmap():
            with _lingering_lock:
                _lingering.append(self)

    close = release

    def _unmap(self) -> bool:
        try:
            self.map.close()
            return True
        except BufferError:  # arrays still view it
            return False


#: released views that arrays still viewed (ArenaView.release), unmapped by sweep()
_lingering: list[ArenaView] = []
_lingering_lock = threading.Lock()


def sweep() -> None:
    """Unmap the released views no array views any more (a worker calls it as it goes about its
    work: each wake-up of its I/O thread, at least every half second)."""
    if _lingering:
        with _lingering_lock:
            _lingering[:] = [view for view in _lingering if not view._unmap()]
