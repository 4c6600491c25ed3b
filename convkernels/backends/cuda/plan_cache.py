"""The CUDA conv plan cache: an LRU of built cuDNN plans keyed by
everything a plan depends on, with a FALLBACK marker for keys cuDNN has no plan for, and
optional persistence of built plans to a directory keyed by GPU name + cuDNN version.

Pure Python on purpose: the builder, the serializer and the plan objects are supplied by the
caller (cudnn.py), so the cache logic is tested without a GPU.

Events (`convkernels_plan_cache_events_total{backend="cuda",event}`), per lookup:
  hit / miss   exactly one of the two for every lookup;
  fallback     additionally, whenever the entry found or built is the FALLBACK marker
               (so a refused key counts one fallback per call it served);
  evict        each entry dropped by the LRU to stay within capacity.
Build time (cuDNN build, autotune, or a load from disk) goes to `convkernels_plan_build_seconds`.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
import time
from collections import OrderedDict
from dataclasses import astuple, dataclass, field
from typing import Any, Callable

from ...metrics import PLAN_BUILD_SECONDS, PLAN_CACHE_EVENTS

log = logging.getLogger("convkernels.cuda")

DEFAULT_CAPACITY = 128
FILE_MAGIC = b"CONVSERVE-PLAN\x00\x01"


@dataclass(frozen=True)
class PlanKey:
    """Everything a cuDNN conv plan depends on (MLX conv.cpp's ConvCacheKey, plus the epilogue)."""

    device: int
    dtype: str
    kind: str                       # "fprop" or "dgrad" (transposed conv)
    x_shape: tuple[int, ...]
    w_shape: tuple[int, ...]
    y_shape: tuple[int, ...]
    stride: tuple[int, ...]
    pad_lo: tuple[int, ...]
    pad_hi: tuple[int, ...]
    dilation: tuple[int, ...]
    groups: int
    transpose: bool
    epilogue: tuple[bool, bool, str | None]   # (bias, residual, activation)
    aligned16: tuple[bool, ...]     # x, w, y, bias, residual pointers 16-byte aligned

    def digest(self) -> str:
        return hashlib.sha256(repr(astuple(self)).encode()).hexdigest()[:40]


@dataclass
class PlanEntry:
    """A built plan. `plan` is opaque to the cache; `meta` is JSON-able (persisted beside it)."""

    plan: Any
    meta: dict = field(default_factory=dict)


class NoPlan(Exception):
    """Raised by a builder when cuDNN has no plan for the key (not supported / bad param)."""


@dataclass(frozen=True)
class Fallback:
    """The cached 'no cuDNN plan' answer: the next call goes straight to gemm_fallback."""

    reason: str


class PlanSerializer:
    """How built plans go to and come back from bytes (cudnn.py supplies the real one)."""

    def dumps(self, entry: PlanEntry) -> bytes | None:  # None: this plan is not persisted
        return None

    def loads(self, key: PlanKey, blob: bytes, meta: dict) -> PlanEntry:
        raise NotImplementedError


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("_") or "unknown"


class PlanStore:
    """Built plans on disk, one file per key, under <dir>/<gpu>-cudnn<version>/.

    A file holds a magic, a JSON header (gpu, cudnn version, the full key, plan meta, sha256 of
    the blob) and the serialized plan. A corrupt file, a file for another GPU / cuDNN version / key, or a blob
    the serializer cannot load is ignored (logged) and the plan is rebuilt; never fatal."""

    def __init__(self, root: str, gpu_name: str, cudnn_version: str):
        self.gpu_name = gpu_name
        self.cudnn_version = str(cudnn_version)
        self.dir = os.path.join(root, _slug(f"{gpu_name}-cudnn{self.cudnn_version}"))
        os.makedirs(self.dir, exist_ok=True)
        self.loaded = 0
        self.rejected = 0
        self.saved = 0

    def path(self, key: PlanKey) -> str:
        return os.path.join(self.dir, key.digest() + ".plan")

    def _header(self, key: PlanKey, meta: dict) -> dict:
        return {"gpu": self.gpu_name, "cudnn": self.cudnn_version, "key": repr(astuple(key)), "meta": meta}

    def save(self, key: PlanKey, blob: bytes, meta: dict) -> None:
        # the checksum keeps a damaged blob away from cuDNN's deserializer altogether
        header = json.dumps({**self._header(key, meta), "sha256": hashlib.sha256(blob).hexdigest()}).encode()
        data = FILE_MAGIC + len(header).to_bytes(4, "little") + header + blob
        fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.path(key))  # atomic: a reader never sees half a file
            self.saved += 1
        except OSError as exc:
            log.warning("plan cache: could not save %s: %s", self.path(key), exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass

    def load(self, key: PlanKey) -> tuple[bytes, dict] | None:
        """(blob, meta) of a valid file for `key`, or None (missing, corrupt or foreign)."""
        path = self.path(key)
        try:
            with open(path, "rb") as f:
                data = f.read()
        except FileNotFoundError:
            return None
        except OSError as exc:
            log.warning("plan cache: cannot read %s (%s); rebuilding", path, exc)
            return None
        why = None
        header = {}
        if not data.startswith(FILE_MAGIC) or len(data) < len(FILE_MAGIC) + 4:
            why = "not a plan file"
        else:
            n = int.from_bytes(data[len(FILE_MAGIC):len(FILE_MAGIC) + 4], "little")
            start = len(FILE_MAGIC) + 4
            try:
                header = json.loads(data[start:start + n].decode())
            except (UnicodeDecodeError, ValueError):
                why = "corrupt header"
            else:
                expect = self._header(key, header.get("meta", {}) if isinstance(header, dict) else {})
                if not isinstance(header, dict) or any(header.get(k) != expect[k] for k in ("gpu", "cudnn", "key")):
                    why = "written for another GPU, cuDNN version or key"
                elif hashlib.sha256(data[start + n:]).hexdigest() != header.get("sha256"):
                    why = "checksum mismatch (damaged plan)"
                else:
                    return data[start + n:], dict(header.get("meta", {}))
        self.rejected += 1
        log.warning("plan cache: ignoring %s (%s); rebuilding", path, why)
        return None


class PlanCache:
    """LRU conv key -> PlanEntry | Fallback, with metrics, a refusal hook and persistence."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, backend_name: str = "cuda",
                 store: PlanStore | None = None, serializer: PlanSerializer | None = None):
        if capacity < 1:
            raise ValueError(f"plan cache capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self.backend_name = backend_name
        self.store = store
        self.serializer = serializer or PlanSerializer()
        #: test / fault-injection hook: a predicate on PlanKey; True makes cuDNN "refuse" the key
        self.refuse: Callable[[PlanKey], bool] | None = None
        self._entries: OrderedDict[PlanKey, PlanEntry | Fallback] = OrderedDict()
        self._lock = threading.Lock()
        self.counts = {"hit": 0, "miss": 0, "evict": 0, "fallback": 0}
        self._children: dict = {}

    def _event(self, event: str) -> None:
        self.counts[event] += 1
        child = self._children.get(event)
        if child is None:
            child = self._children[event] = PLAN_CACHE_EVENTS.labels(self.backend_name, event)
        child.inc()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: PlanKey) -> bool:
        return key in self._entries

    def peek(self, key: PlanKey):
        return self._entries.get(key)

    def get(self, key: PlanKey, build: Callable[[], PlanEntry]) -> PlanEntry | Fallback:
        """The entry for `key`, building (or loading) it on a miss. `build` raises NoPlan when
        cuDNN has no plan; that answer is cached as a Fallback. Other exceptions propagate and
        cache nothing."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None:
                self._entries.move_to_end(key)
        if entry is not None:
            self._event("hit")
        else:
            self._event("miss")
            entry = self._resolve(key, build)
            self._insert(key, entry)
        if isinstance(entry, Fallback):
            self._event("fallback")
        return entry

    def _resolve(self, key: PlanKey, build) -> PlanEntry | Fallback:
        t0 = time.perf_counter()
        try:
            if self.refuse is not None and self.refuse(key):
                return Fallback("refused by the test hook")
            loaded = self._load(key)
            if loaded is not None:
                return loaded
            try:
                entry = build()
            except NoPlan as exc:
                log.info("cuDNN has no plan for %s: %s; using gemm_fallback", key, exc)
                return Fallback(str(exc))
            self._save(key, entry)
            return entry
        finally:
            PLAN_BUILD_SECONDS.labels(self.backend_name).observe(time.perf_counter() - t0)

    def _load(self, key: PlanKey) -> PlanEntry | None:
        if self.store is None:
            return None
        found = self.store.load(key)
        if found is None:
            return None
        blob, meta = found
        try:
            entry = self.serializer.loads(key, blob, meta)
        except Exception as exc:  # a blob cuDNN rejects is as good as corrupt: rebuild
            self.store.rejected += 1
            log.warning("plan cache: stored plan for %s did not load (%s); rebuilding", key, exc)
            return None
        self.store.loaded += 1
        return entry

    def _save(self, key: PlanKey, entry: PlanEntry) -> None:
        if self.store is None:
            return
        try:
            blob = self.serializer.dumps(entry)
        except Exception as exc:
            log.warning("plan cache: could not serialize the plan for %s: %s", key, exc)
            return
        if blob is not None:
            self.store.save(key, blob, entry.meta)

    def _insert(self, key: PlanKey, entry) -> None:
        evicted = 0
        with self._lock:
            self._entries[key] = entry
            self._entries.move_to_end(key)
            while len(self._entries) > self.capacity:
                self._entries.popitem(last=False)
                evicted += 1
        for _ in range(evicted):
            self._event("evict")

    def demote(self, key: PlanKey, reason: str) -> Fallback:
        """A freshly built plan failed its first execution (e.g. cuDNN's misaligned-pointer
        answer): replace it by the FALLBACK marker, as if cuDNN had refused the key."""
        fb = Fallback(reason)
        with self._lock:
            if key in self._entries:
                self._entries[key] = fb
        self._event("fallback")
        return fb

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()

    def stats(self) -> dict:
        with self._lock:
            entries = list(self._entries.values())
        out = {
            "capacity": self.capacity,
            "size": len(entries),
            "plans": sum(1 for e in entries if isinstance(e, PlanEntry)),
            "fallbacks": sum(1 for e in entries if isinstance(e, Fallback)),
            **self.counts,
        }
        if self.store is not None:
            out.update(store_dir=self.store.dir, store_loaded=self.store.loaded,
                       store_rejected=self.store.rejected, store_saved=self.store.saved)
        return out
