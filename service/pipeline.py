"""The one request path every protocol adapter goes through: admission (ready, draining, queue
full; the request metrics around it), then validated tensor -> batcher -> model (worker thread) ->
result rows, waited for with the timeout and the client's presence. Adapters only parse their wire
format into tensors and format the rows that come back."""
from __future__ import annotations

import asyncio
import contextvars
import functools
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

import numpy as np

from . import fault_injection, metrics, oom_recovery, validation
from .batcher import Batcher, Closed, QueueFull
from .model_host import HostedModel, load_entry, warm_up
from .model_stats import ModelStats, ns
from .problems import Problem
from .settings import Settings

log = logging.getLogger("convserve")

DisconnectCheck = Callable[[], Awaitable[bool]]

#: how often a waiting request checks whether its client went away
DISCONNECT_POLL_S = 0.05


class _Reservation:
    """The queue place a request was admitted with (Service.admit), until its first model call."""
    used = False


_RESERVATION: contextvars.ContextVar[_Reservation | None] = contextvars.ContextVar("convserve_reservation",
                                                                                   default=None)


def start_all_workers(pool: ThreadPoolExecutor, workers: int, timeout_s: float = 10.0) -> None:
    """ThreadPoolExecutor starts a thread only when a task finds none idle, so under load its
    thread count creeps up one burst at a time. Starting every worker now keeps the first loaded
    request from paying for a thread start and the count fixed, which the leak check relies on."""
    barrier = threading.Barrier(workers)
    for future in [pool.submit(barrier.wait, timeout_s) for _ in range(workers)]:
        future.result()


class Service:
    """Owns the backend, the models, the batcher and the codec thread pool."""

    def __init__(self, settings: Settings):
        self.settings = settings
        self.backend = None
        self.models: dict[str, HostedModel] = {}
        self.failed: dict[str, str] = {}
        self.batcher: Batcher | None = None
        self.codec_pool = ThreadPoolExecutor(settings.codec_threads, thread_name_prefix="convserve-codec")
        self.ready = False
        self.draining = False
        self.load_error: str | None = None
        self.inflight = 0
        #: Triton-style per-model counts and ns (GET /v2/models/{name}/stats)
        self.stats = ModelStats()

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Load and warm up the models; /readyz turns true when done. In the background, so
        /healthz answers while a large model loads."""
        threading.Thread(target=self._load, name="convserve-loader", daemon=True).start()

    def _load(self) -> None:
        try:
            from convkernels import get_backend

            s = self.settings
            start_all_workers(self.codec_pool, s.codec_threads)
            self.backend = get_backend(s.backend, **s.backend_options())
            log.info("backend: %s", self.backend.describe())
            for entry in s.model_entries():
                try:
                    hm = load_entry(entry, self.backend, s.tile_size)
                    warm_up(hm, s.warmup_shapes(), calls_per_size=self.backend.calls_to_warm)
                except Exception as exc:
                    metrics.count_fault(entry.name, "load_error", "failed")
                    if not entry.optional:
                        raise
                    self.failed[entry.name] = f"{exc.__class__.__name__}: {exc}"
                    log.warning("optional model %s not served: %s", entry.name, self.failed[entry.name])
                    continue
                self.models[entry.name] = hm
            self.batcher = Batcher(max_batch=s.max_batch, max_queue_delay_ms=s.max_queue_delay_ms,
                                   max_queue=s.max_queue, after_batch=self.backend.flush_timings,
                                   stats=self.stats,
                                   # after warm-up: injected faults never stop a start
                                   before_call=fault_injection.arm_if_configured(self.backend))
            self.ready = True
            log.info("ready: %s", ", ".join(self.models))
        except Exception as exc:  # the server stays up (live, not ready) and says why
            self.load_error = f"{exc.__class__.__name__}: {exc}"
            log.exception("model loading failed")

    def begin_drain(self) -> None:
        """SIGTERM: stop admitting (readyz false, new requests 503); queued work still runs."""
        if not self.draining:
            log.info("draining: %d request(s) in flight", self.inflight)
        self.draining = True
        if self.batcher is not None:
            self.batcher.close()

    def idle(self) -> bool:
        return self.inflight == 0 and (self.batcher is None or not self.batcher.busy())

    def stop(self) -> None:
        if self.batcher is not None:
            self.batcher.stop()
        self.codec_pool.shutdown(wait=False, cancel_futures=True)

    # ---- admission -----------------------------------------------------------------------------
    def retry_after(self) -> str:
        """Seconds (at least 1) until the queue should have room: its rows at the recent speed."""
        backlog = self.batcher.backlog_seconds() if self.batcher is not None else 1.0
        return str(max(1, math.ceil(backlog)))

    def model(self, name: str) -> HostedModel:
        hm = self.models.get(name)
        if hm is None:
            if not self.ready and not self.draining:
                raise Problem(503, "not-ready", "models are still loading", headers={"Retry-After": "2"})
            raise Problem(404, "unknown-model", f"no model named {name!r}; served: {sorted(self.models)}")
        return hm

    def _admit(self, model: str) -> _Reservation:
        """Admission before any work: decided from the request line and the queue's state (the
        queue counts the places of admitted requests still reading their bodies), so a full
        queue costs a rejected client no body upload, parsing or NaN scan on the server."""
        if self.draining:
            raise self._refused(model, Closed(), close=True)
        if not self.ready or self.batcher is None:
            raise Problem(503, "not-ready", "models are still loading", headers={"Retry-After": "2"})
        try:
            self.batcher.reserve()
        except (QueueFull, Closed) as exc:
            raise self._refused(model, exc, close=True) from None
        return _Reservation()

    def _refused(self, model: str, why: QueueFull | Closed, *, close: bool = False) -> Problem:
        """A request the queue did not take: full (429) or closed by a drain (503)."""
        full = isinstance(why, QueueFull)
        metrics.REJECTED.labels(model, "queue_full" if full else "shutting_down").inc()
        headers = {"Retry-After": self.retry_after()}
        if full:
            return Problem(429, "queue-full", f"the queue holds {self.settings.max_queue} requests; retry later",
                           headers=headers)
        if close:  # refused before its body was read
            headers["Connection"] = "close"
        return Problem(503, "shutting-down", "the server is shutting down", headers=headers)

    @asynccontextmanager
    async def admit(self, model: str, endpoint: str):
        """What every adapter's route starts with: the hosted model (404 and not-ready are not
        counted: an unknown name is no metric label), a queue place (`_admit`) and whether
        `endpoint` runs that model (409). The request is counted (status), timed and held in
        flight (the drain waits for it) until the block ends."""
        hm = self.model(model)
        t0 = time.perf_counter()
        self.inflight += 1
        metrics.INFLIGHT.labels(model).inc()
        status = 200
        reservation = None
        try:
            reservation = self._admit(model)
            _RESERVATION.set(reservation)
            yield validation.model_for(hm, endpoint)
        except Problem as p:
            status = p.status
            raise
        except asyncio.CancelledError:
            status = 499
            raise
        except Exception:
            status = 500
            raise
        finally:
            if reservation is not None:
                _RESERVATION.set(None)
                if not reservation.used:
                    self.batcher.release()
            self.inflight -= 1
            metrics.INFLIGHT.labels(model).dec()
            elapsed = time.perf_counter() - t0
            metrics.REQUESTS.labels(model, endpoint, str(status)).inc()
            metrics.REQUEST_SECONDS.labels(model, endpoint).observe(elapsed)
            self.stats.request_done(model, status == 200, ns(elapsed))

    async def in_pool(self, fn, *args):
        """Codec work (image/video encode, image decode) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.codec_pool, fn, *args)

    # ---- the request path ------------------------------------------------------------------------
    async def run(self, hm: HostedModel, key, inputs: np.ndarray, call, disconnected: DisconnectCheck | None,
                  *, continuation: bool = False, solo: bool = False):
        """`call(inputs)` on the device worker, batched with work of an equal `key`; waits with the
        request's timeout and drops the work when the client goes. continuation/solo: see
        Batcher.submit (the streaming adapter's later decode steps)."""
        reservation = _RESERVATION.get()
        reserved = reservation is not None and not reservation.used and not continuation
        try:
            item = self.batcher.submit(hm.name, key, inputs, call, continuation=continuation, solo=solo,
                                       reserved=reserved)
            if reserved:
                reservation.used = True
        except (QueueFull, Closed) as exc:
            raise self._refused(hm.name, exc) from None
        deadline = time.perf_counter() + self.settings.request_timeout_s
        try:
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    item.cancel()
                    metrics.REJECTED.labels(hm.name, "timeout").inc()
                    raise Problem(504, "timeout", f"no result within {self.settings.request_timeout_s:g}s")
                done, _ = await asyncio.wait({item.future}, timeout=min(DISCONNECT_POLL_S, left))
                if done:
                    break
                if disconnected is not None and not item.started and await disconnected():
                    item.cancel()
                    metrics.REJECTED.labels(hm.name, "client_gone").inc()
                    log.info("client gone: dropped a queued %s request", hm.name)
                    raise Problem(499, "client-gone", "the client disconnected before its work ran")
        except asyncio.CancelledError:
            item.cancel()
            raise
        try:
            return item.future.result()
        except Problem:
            raise
        except Closed:
            raise Problem(503, "shutting-down", "the server stopped before this request ran") from None
        except oom_recovery.DeviceOutOfMemory as exc:
            raise Problem(503, "device-out-of-memory", str(exc), headers={"Retry-After": self.retry_after()}) from exc
        except ValueError as exc:
            raise Problem(422, "model-rejected-input", str(exc)) from exc
        except Exception as exc:
            error_id = getattr(exc, "error_id", None)
            metrics.count_fault(hm.name, "worker_exception", "failed")
            raise Problem(500, "model-error", f"{exc.__class__.__name__}: {exc} (error id {error_id}; "
                          "the server log has the traceback)", error_id=error_id) from exc

    async def decode(self, hm: HostedModel, latents: np.ndarray, *, tiled: bool | None = None,
                     clamp: bool = True, disconnected: DisconnectCheck | None = None) -> np.ndarray:
        """Latents -> float32 images N,H,W,3 (image decoder) or videos N,F,H,W,3, in [0,1].
        clamp=False (image decoders): x/2 + 0.5 of the unclamped decoder output (remote_decode `pt`)."""
        lat = await self.in_pool(validation.latents, hm, latents, self.settings)  # NaN scan: off the loop
        call = functools.partial(oom_recovery.decode, hm, tiled=tiled, clamp=clamp)
        return await self.run(hm, ("decode", lat.shape[1:], tiled, clamp), lat, call, disconnected)

    async def vae_encode(self, hm: HostedModel, images: np.ndarray, *,
                         disconnected: DisconnectCheck | None = None) -> np.ndarray:
        """Images N,H,W,3 in [0,1] -> scaled latents N,C,H/8,W/8 through an image VAE's encoder."""
        px = validation.vae_images(images, self.settings)
        return await self.run(hm, ("vae_encode", px.shape[1:]), px, hm.model.encode, disconnected)

    async def encode(self, hm: HostedModel, pixels: np.ndarray, *,
                     disconnected: DisconnectCheck | None = None) -> dict[str, Any]:
        """Pixels N,S,S,3 in [0,1] at the model's input size -> {embedding (N,D), logits (N,K)|None}."""
        px = await self.in_pool(validation.encoder_pixels, hm, pixels, self.settings)
        return await self.run(hm, ("encode", px.shape[1:]), px, hm.model.encode, disconnected)
