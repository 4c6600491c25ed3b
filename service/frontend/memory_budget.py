"""The front end's bound on request memory: the bytes of admitted bodies and of the arrays made
from them are counted against CONVSERVE_MEMORY_BUDGET_BYTES, so no mix of valid requests can
grow a front end past it (the queue bounds how many requests wait; this bounds their bytes).

A body's declared Content-Length is taken before its first byte is read (a chunked body is taken
as it arrives); the arrays a request stages for the model worker and the outputs it gets back are
taken before they are made. Beyond the budget the request gets 503 with Retry-After; a single
request larger than the whole budget gets 413, as it could never fit. Everything a request took
goes back when its response is out (engine.Lease carries the release).

Freed memory is given back to the system after a burst (`malloc_trim`): CPython's allocator and
glibc's arenas otherwise keep the high-water mark of a burst of large bodies for the life of the
process."""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import time
from typing import Callable

from ..problems import Problem

log = logging.getLogger("convserve")

#: the auto budget: this share of the container's (or machine's) memory, within these bounds,
#: shared by the front ends. The rest is for the model workers (weights, activations, the
#: shared-memory blocks in flight) and the system.
AUTO_SHARE = 1 / 16
AUTO_MIN = 256 << 20
AUTO_MAX = 4 << 30
#: trim after a burst only when it held this much, and at most this often
TRIM_AFTER_BYTES = 64 << 20
TRIM_EVERY_S = 1.0


def memory_limit_bytes() -> int:
    """The container's memory limit (cgroup v2 memory.max, v1 limit_in_bytes) where one is set,
    else the machine's memory."""
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            raw = open(path).read().strip()
        except OSError:
            continue
        if raw.isdigit() and int(raw) < (1 << 60):  # v1 writes a huge number for "no limit"
            return int(raw)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def auto_budget_bytes(frontends: int) -> int:
    """Each front end's share of the auto budget."""
    total = min(AUTO_MAX, max(AUTO_MIN, int(memory_limit_bytes() * AUTO_SHARE)))
    return max(AUTO_MIN // 4, total // max(1, frontends))


def _malloc_trim():
    name = ctypes.util.find_library("c")
    try:
        return ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc (musl, macOS): nothing to trim
        return None


class MemoryBudget:
    """Bytes taken and given back on the event loop's thread (no lock needed)."""

    def __init__(self, limit: int, retry_after: Callable[[], str] = lambda: "1"):
        self.limit = limit
        self.used = 0
        self.peak_since_trim = 0
        self.retry_after = retry_after
        self._trim = _malloc_trim()
        self._last_trim = 0.0

    def take(self, nbytes: int, what: str, *, held: int = 0, force: bool = False) -> None:
        """Count `nbytes` more for a request already holding `held`, or refuse: 413 when the
        request could never fit, 503 when it does not fit now. force: count it without refusing
        (a later step of a request admitted earlier, which a refusal would cut off halfway)."""
        if nbytes <= 0:
            return
        if not force and held + nbytes > self.limit:
            raise Problem(413, "over-memory-budget",
                          f"{what} needs {nbytes} bytes{f' beside the {held} its request holds' if held else ''}; "
                          f"this server's memory budget per front end is {self.limit} bytes "
                          "(CONVSERVE_MEMORY_BUDGET_BYTES)")
        if not force and self.used + nbytes > self.limit:
            raise Problem(503, "memory-budget-full",
                          f"{what} needs {nbytes} bytes and {self.limit - self.used} of the memory budget "
                          "are free; retry later", headers={"Retry-After": self.retry_after()})
        self.used += nbytes
        self.peak_since_trim = max(self.peak_since_trim, self.used)

    def give(self, nbytes: int) -> bool:
        """Return `nbytes`; True when a burst has just ended and memory should go back to the system."""
        self.used -= nbytes
        if self.used or self.peak_since_trim < TRIM_AFTER_BYTES or self._trim is None:
            return False
        now = time.monotonic()
        if now - self._last_trim < TRIM_EVERY_S:
            return False
        self._last_trim, self.peak_since_trim = now, 0
        return True

    def trim(self) -> None:
        """Give freed heap memory back to the system (run off the event loop: it walks the heap)."""
        if self._trim is not None:
            self._trim(0)
