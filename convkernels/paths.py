"""Path choice: each backend lists its paths (name, guard, cost rule, runner); a chooser picks
one per conv key, memoises it and counts the choice. One place per backend, no ad-hoc ifs."""
from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable

from .metrics import PLAN_BUILD_SECONDS, PLAN_CACHE_EVENTS
from .spec import ConvKey


@dataclass(frozen=True)
class ConvPath:
    name: str
    guard: Callable[[ConvKey], bool]
    cost: Callable[[ConvKey], float]
    run: Callable[..., Any]
    #: prepare(w, key): the weight transform this path runs on its first call (the NumPy backend's
    #: Winograd panels, gemm.c's packed weights), done at load instead (BackendBase.prepare_conv)
    prepare: Callable[[Any, ConvKey], None] | None = None


class PathChooser:
    """Memoised conv key -> path. `forced` (a path name) overrides the cost rule wherever that
    path's guard allows it, so tests can make every path run."""

    def __init__(self, backend_name: str, catalogue: list[ConvPath],
                 measure: Callable[[ConvKey, list[ConvPath]], ConvPath] | None = None,
                 cache_metrics: bool = True):
        self.backend_name = backend_name
        # False where a backend's own plan cache emits the plan-cache events (cuda): one event
        # stream per backend, not two counting different things
        self.cache_metrics = cache_metrics
        self.catalogue = catalogue
        self.measure = measure
        self.forced: str | None = None
        self._memo: dict[ConvKey, ConvPath] = {}
        self._calls: dict[ConvKey, int] = {}
        self._lock = threading.Lock()

    def by_name(self, name: str) -> ConvPath:
        for p in self.catalogue:
            if p.name == name:
                return p
        raise ValueError(f"backend {self.backend_name} has no path {name!r}; it has "
                         f"{[p.name for p in self.catalogue]}")

    def candidates(self, key: ConvKey) -> list[ConvPath]:
        return [p for p in self.catalogue if p.guard(key)]

    def choose(self, key: ConvKey) -> ConvPath:
        with self._lock:
            path = self._memo.get(key)
            self._calls[key] = self._calls.get(key, 0) + 1
        if path is not None:
            if self.cache_metrics:
                PLAN_CACHE_EVENTS.labels(self.backend_name, "hit").inc()
            return path
        if self.cache_metrics:
            PLAN_CACHE_EVENTS.labels(self.backend_name, "miss").inc()
        t0 = time.perf_counter()
        path = self._decide(key, self.measure)
        if self.cache_metrics:
            PLAN_BUILD_SECONDS.labels(self.backend_name).observe(time.perf_counter() - t0)
        with self._lock:
            self._memo[key] = path
        return path

    def _decide(self, key: ConvKey, measure: Callable[[ConvKey, list[ConvPath]], ConvPath] | None) -> ConvPath:
        valid = self.candidates(key)
        if not valid:
            raise ValueError(f"{self.backend_name}: no kernel path accepts {key.describe()}")
        forced = [p for p in valid if p.name == self.forced] if self.forced else []
        if forced:
            return forced[0]
        if measure is not None and len(valid) > 1:
            return measure(key, valid)
        return min(valid, key=lambda p: p.cost(key))

    def estimate(self, key: ConvKey) -> ConvPath | None:
        """The path `key` would take now, without memoising it, counting it or timing anything (the
        measure hook's `estimate`, where it has one, else the cost rule); None: no path accepts it."""
        if not self.candidates(key):
            return None
        return self._decide(key, getattr(self.measure, "estimate", None))

    def rechoose(self, match: Callable[[ConvKey], bool]) -> None:
        """Decide again for the memoised keys `match` accepts (call counts stay), e.g. once a
        background measurement has replaced an estimate the measure hook gave."""
        with self._lock:
            keys = [k for k in self._memo if match(k)]
        for key in keys:
            path = self._decide(key, self.measure)
            with self._lock:
                self._memo[key] = path

    def clear(self) -> None:
        with self._lock:
            self._memo.clear()
            self._calls.clear()

    def choices(self) -> list[dict]:
        with self._lock:
            items = list(self._memo.items())
            calls = dict(self._calls)
        return [{**key.describe(), "backend": self.backend_name, "path": path.name, "calls": calls.get(key, 0)}
                for key, path in items]
