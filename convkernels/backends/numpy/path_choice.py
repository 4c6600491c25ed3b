"""How the NumPy backend answers PathChooser for a large conv key it has not seen (paths.py memoises
the answer; smaller convs, under `min_macs`, take the static cost rule).

The answer, in order: a measured choice for the key's work (this process's, or the path store's
from an earlier one); else, by `mode`:
- "background" (the default): the cost model's choice (cost_model.py), and the key is queued for
  the background tuner (background.py), whose measured choice is persisted and replaces the
  estimate from the next call on; nothing is timed inside the request;
- "request": every valid path timed inside the request (best of three rounds), as before: the
  first call of a new shape costs several steady ones;
- "off": the cost model's choice only, never measured.
"""
from __future__ import annotations

import logging
import threading
from typing import Callable

from ...paths import ConvPath
from ...spec import ConvKey
from . import cost_model
from .autotune import work_key
from .background import Activity, BackgroundTuner
from .path_store import PathStore

log = logging.getLogger("convkernels.numpy.paths")

MODES = ("background", "request", "off")
#: a measured path replaces the cost model's only when it was at least this much faster: the
#: difference between near-equal paths is noise on a shared box, and flipping costs a re-choice
REPLACE_MARGIN = 0.85


class MeasuredChoices:
    """The `measure` hook of the NumPy backend's PathChooser."""

    def __init__(self, mode: str, min_macs: float, store: PathStore | None,
                 time_in_request: Callable[[ConvKey, list[ConvPath]], ConvPath],
                 rechoose: Callable[[Callable[[ConvKey], bool]], None], activity: Activity):
        if mode not in MODES:
            raise ValueError(f"numpy backend: autotune must be one of {MODES}, not {mode!r}")
        self.mode = mode
        self.min_macs = float(min_macs)
        self.store = store
        self.time_in_request = time_in_request
        self.rechoose = rechoose  # PathChooser.rechoose: memoised estimates replaced
        self._lock = threading.Lock()
        self.timed: dict[str, str] = store.load() if store else {}  # work key name -> measured path
        self.tuner = BackgroundTuner(activity, self._measured) if mode == "background" else None
        self.estimated = 0  # keys answered by the cost model

    def __call__(self, key: ConvKey, valid: list[ConvPath]) -> ConvPath:
        chosen = self._known(key, valid)
        if chosen is not None:
            return chosen
        work = work_key(key)
        name = PathStore.name(work)
        if self.mode == "request":
            chosen = self.time_in_request(key, valid)
            self._record(name, chosen.name)
            return chosen
        chosen = cost_model.model_choice(key, valid, cost_model.measure_rates())
        self.estimated += 1
        if self.tuner is not None:
            self.tuner.submit(work, key, valid)
        return chosen

    def estimate(self, key: ConvKey, valid: list[ConvPath]) -> ConvPath:
        """What __call__ would answer, with nothing timed or queued (a weight prepared at load)."""
        return self._known(key, valid) or cost_model.model_choice(key, valid, cost_model.measure_rates())

    def _known(self, key: ConvKey, valid: list[ConvPath]) -> ConvPath | None:
        """The static rule's choice under min_macs, else the measured one (this process's or the
        store's), else None."""
        if key.macs() < self.min_macs:
            return min(valid, key=lambda p: p.cost(key))
        timed = self.timed.get(PathStore.name(work_key(key)))
        return next((p for p in valid if p.name == timed), None)

    def _record(self, name: str, path_name: str) -> None:
        with self._lock:  # the tuner's thread and request threads both record
            if self.store:
                self.store.put(self.timed, name, path_name)
            else:
                self.timed[name] = path_name

    def _measured(self, key: ConvKey, valid: list[ConvPath], winner: ConvPath, timings: dict) -> None:
        """The tuner's result: kept unless the cost model's path (the one running) was about as fast."""
        estimate = cost_model.model_choice(key, valid, cost_model.measure_rates())
        if winner.name != estimate.name and timings[winner.name] > REPLACE_MARGIN * timings[estimate.name]:
            winner = estimate
        work = work_key(key)
        self._record(PathStore.name(work), winner.name)
        self.rechoose(lambda k: work_key(k) == work)
        log.info("path tuner: %s -> %s (%s)", key.describe()["input_shape"], winner.name,
                 ", ".join(f"{n} {t * 1e3:.1f} ms" for n, t in sorted(timings.items())))
