"""The compute cap: how much work one request may ask of a model worker, decided in the front end
before the request takes a device (service/frontend/pipeline.py calls it).

- Pixels. Output pixels (frames x height x width, over the batch; input pixels for encoders)
  past the backend's cap are refused with 413 `too-much-work` (CONVSERVE_MAX_REQUEST_PIXELS).
- New shapes. The first request of an input shape may pay for choosing the conv paths of every
  conv it runs: with CONVSERVE_NUMPY_AUTOTUNE=request the NumPy backend times them inside it (on a
  2-core CPU a tiny-vae 512x512 decode took 11.6 s the first time and 1.0-1.7 s after); by default
  (background) a cost model answers and the first call costs 1-3 later ones (weight transforms,
  first-touch memory). The charge stays the worst case, whatever the setting: such a first run is
  charged NEW_SHAPE_FACTOR times its pixels. Where that still fits the cap, nothing
  changes: even measured, the request is no more work than one the cap lets through. Where it
  does not (a *large* new shape), the request is admitted only when no other large new shape is
  running in this front end and only while its new-shape time credit lasts: the credit starts
  at CONVSERVE_NEW_SHAPE_BURST_S seconds, each large first run spends its duration, and it
  refills at NEW_SHAPE_SHARE seconds a second. Past that: 429 `new-shape-limit` with Retry-After.
  A client changing the width by one each time thus gets at most that share of the worker for
  measuring, however it paces; the same shape again is never held back.

Why not refuse by the charge (a 413 for pixels x factor over the cap): the shape would never be
measured, so the refusal would be for good, for a request the cap allows once measured. Why the
front end and not the worker: admission is decided here, before the body is read and queued,
and a refusal with Retry-After is the front end's to give. What it knows: the shapes it has seen
finish (KNOWN_SHAPES of them, least recently used dropped). A worker restarted since measures
those again unpaced, and each front end (--workers) keeps its own account, so F front ends allow
F large first runs at a time; on GPUs, where path choice is quick, this rarely matters. A shape
here includes the request's batch size (each is a conv shape of its own), but a batch the worker's
batcher forms from several requests of one shape (2, 4 or 8 rows) is measured the first time it
runs, uncharged: at most three such per shape. The sizes in CONVSERVE_WARMUP_SIZES are measured
before the server is ready instead, at every batch size."""
from __future__ import annotations

import math
import time
from collections import OrderedDict
from contextlib import contextmanager
from typing import Callable, Hashable, Iterator

from .. import metrics
from ..hosted_model import HostedModel
from ..problems import Problem
from ..settings import Settings

#: the cap per request where CONVSERVE_MAX_REQUEST_PIXELS is 0, by backend: 1024x1024 on the CPU,
#: where a full SD-VAE decodes 512x512 in ~9 s on 2 cores, so the cap's ~35 s stays inside the
#: default request timeout (a 2048x2048 decode of even the tiny test VAE outlasted it:
#: docs/reliability.md); GPUs go much further
AUTO_REQUEST_PIXELS = {"numpy": 1024 * 1024, "mlx": 64 << 20, "cuda": 512 << 20}
#: what a new shape's first run costs against a later one's, measured (the module docstring):
#: 11.6 s against 1.0-1.7 s for tiny-vae 512x512 on a 2-core CPU
NEW_SHAPE_FACTOR = 8
#: the share of the time that large new shapes' first runs may take once the burst credit is spent
NEW_SHAPE_SHARE = 0.5
#: input shapes a front end remembers as run, per model and op
KNOWN_SHAPES = 1024


class ComputeCap:
    """One front end's compute cap: `check` (pixels) and `first_run` (new shapes)."""

    def __init__(self, settings: Settings, backend_name: Callable[[], str],
                 clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self._backend_name = backend_name  # known once a worker has said which backend it made
        self._clock = clock
        self._known: OrderedDict[Hashable, None] = OrderedDict()
        self._running: dict[Hashable, float] = {}  # large first runs in flight: their start times
        self._credit = settings.new_shape_burst_s
        self._stamp = clock()

    def limit(self) -> int:
        return self.settings.max_request_pixels or AUTO_REQUEST_PIXELS.get(self._backend_name(),
                                                                           AUTO_REQUEST_PIXELS["cuda"])

    def check(self, hm: HostedModel, pixels: int, what: str) -> None:
        """413 when the request's pixels of work are past the cap."""
        cap = self.limit()
        if pixels > cap:
            metrics.REJECTED.labels(hm.name, "too_much_work").inc()
            raise Problem(413, "too-much-work",
                          f"{what} on {hm.name} is {pixels} pixels of work; the {self._backend_name()} backend takes "
                          f"at most {cap} per request (CONVSERVE_MAX_REQUEST_PIXELS): send a smaller or "
                          "shorter request, fewer at a time, or stream a video")

    @contextmanager
    def first_run(self, hm: HostedModel, shape: Hashable, pixels: int) -> Iterator[None]:
        """Around a request's run on a worker: a large new shape is admitted (or refused 429) and
        its duration charged; `shape` is what decides the conv shapes (op, input shape, options)."""
        key = (hm.name, shape)
        if key in self._known:
            self._known.move_to_end(key)
            yield
            return
        if pixels * NEW_SHAPE_FACTOR <= self.limit() or key in self._running:
            # within the cap even when measured; or the same shape is being measured: this one
            # waits behind it in the worker's queue and runs on the paths it chose
            yield
            return
        self._admit(hm, key)
        started = self._clock()
        self._running[key] = started
        done = False
        try:
            yield
            done = True
        finally:
            del self._running[key]
            self._refill()
            self._credit -= self._clock() - started
            if done:  # a failed or withdrawn run may have measured only part: not known yet
                self._known[key] = None
                if len(self._known) > KNOWN_SHAPES:
                    self._known.popitem(last=False)

    def _refill(self) -> None:
        now = self._clock()
        self._credit = min(self.settings.new_shape_burst_s, self._credit + NEW_SHAPE_SHARE * (now - self._stamp))
        self._stamp = now

    def _admit(self, hm: HostedModel, key) -> None:
        self._refill()
        if self._running:  # one at a time: its time so far is the guess at what is left
            wait = self._clock() - min(self._running.values())
        elif self._credit < 0:
            wait = -self._credit / NEW_SHAPE_SHARE
        else:
            return
        metrics.REJECTED.labels(hm.name, "new_shape_limit").inc()
        raise Problem(429, "new-shape-limit",
                      f"{hm.name} has not run this input shape yet: its first run measures the conv paths "
                      f"(about {NEW_SHAPE_FACTOR}x the work of a later one), and large new shapes run one at a "
                      f"time, in at most {NEW_SHAPE_SHARE:.0%} of the server's time; retry later, or list the size "
                      "in CONVSERVE_WARMUP_SIZES to measure it at start",
                      headers={"Retry-After": str(max(1, math.ceil(wait)))})
