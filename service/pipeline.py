"""The one request path every protocol adapter goes through:
validated tensor -> batcher -> model (worker thread) -> result rows; plus the admission rules
(ready, draining, queue full, timeout, client gone) and the request metrics around it.
Adapters (v1 REST, KServe v2, and later diffusers remote_decode, streaming video) only parse
their wire format into tensors and format the rows that come back."""
from __future__ import annotations

import asyncio
import contextvars
import logging
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

import numpy as np

from . import fault_injection, metrics, oom_recovery
from .batcher import Batcher, Closed, QueueFull
from .model_host import IMAGE_DECODER, IMAGE_ENCODER, VIDEO_DECODER, HostedModel, load_entry, warm_up
from .model_stats import ModelStats, ns
from .problems import Problem
from .settings import Settings

log = logging.getLogger("convserve")

DisconnectCheck = Callable[[], Awaitable[bool]]

#: how often a waiting request checks whether its client went away
DISCONNECT_POLL_S = 0.05


class _Reservation:
    """The queue place a request was admitted with (Service.track), until its first model call."""
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
        self.faults: fault_injection.FaultSettings | None = None
        #: Triton-style per-model counts and ns (GET /v2/models/{name}/stats)
        self.stats = ModelStats()
        self._loader: threading.Thread | None = None

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, background: bool = True) -> None:
        """Load and warm up the models; /readyz turns true when done. In the background by
        default so /healthz answers while a large model loads."""
        if background:
            self._loader = threading.Thread(target=self._load, name="convserve-loader", daemon=True)
            self._loader.start()
        else:
            self._load()

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
            # after warm-up: injected faults never stop a start
            self.faults = fault_injection.arm_if_configured(self.backend)
            self.batcher = Batcher(max_batch=s.max_batch, max_queue_delay_ms=s.max_queue_delay_ms,
                                   max_queue=s.max_queue, after_batch=self.backend.flush_timings,
                                   stats=self.stats)
            self.ready = True
            log.info("ready: %s", ", ".join(self.models))
        except Exception as exc:  # the server stays up (live, not ready) and says why
            self.load_error = f"{exc.__class__.__name__}: {exc}"
            log.exception("model loading failed")

    def wait_loaded(self, timeout: float | None = None) -> None:
        if self._loader is not None:
            self._loader.join(timeout)

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
            metrics.REJECTED.labels(model, "shutting_down").inc()
            raise Problem(503, "shutting-down", "the server is shutting down",
                          headers={"Retry-After": self.retry_after(), "Connection": "close"})
        if not self.ready or self.batcher is None:
            raise Problem(503, "not-ready", "models are still loading", headers={"Retry-After": "2"})
        try:
            self.batcher.reserve()
        except QueueFull:
            raise self._queue_full(model) from None
        except Closed:
            metrics.REJECTED.labels(model, "shutting_down").inc()
            raise Problem(503, "shutting-down", "the server is shutting down",
                          headers={"Retry-After": self.retry_after(), "Connection": "close"}) from None
        return _Reservation()

    def _queue_full(self, model: str) -> Problem:
        metrics.REJECTED.labels(model, "queue_full").inc()
        return Problem(429, "queue-full", f"the queue holds {self.settings.max_queue} requests; retry later",
                       headers={"Retry-After": self.retry_after()})

    @asynccontextmanager
    async def track(self, model: str, endpoint: str):
        """Count the request (status), time it and hold it in flight (the drain waits for it)."""
        t0 = time.perf_counter()
        self.inflight += 1
        metrics.INFLIGHT.labels(model).inc()
        status = 200
        reservation = None
        try:
            reservation = self._admit(model)
            _RESERVATION.set(reservation)
            yield
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
    async def _run(self, hm: HostedModel, key, inputs: np.ndarray, call, disconnected: DisconnectCheck | None,
                   *, continuation: bool = False, solo: bool = False):
        """continuation/solo: see Batcher.submit (the streaming adapter's later decode steps)."""
        call = fault_injection.with_call_faults(call, self.faults)
        reservation = _RESERVATION.get()
        reserved = reservation is not None and not reservation.used and not continuation
        try:
            item = self.batcher.submit(hm.name, key, inputs, call, continuation=continuation, solo=solo,
                                       reserved=reserved)
            if reserved:
                reservation.used = True
        except QueueFull:
            raise self._queue_full(hm.name) from None
        except Closed:
            metrics.REJECTED.labels(hm.name, "shutting_down").inc()
            raise Problem(503, "shutting-down", "the server is shutting down",
                          headers={"Retry-After": self.retry_after()}) from None
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

    def check_latents(self, hm: HostedModel, lat: np.ndarray) -> np.ndarray:
        s, m = self.settings, hm.model
        want = 4 if hm.kind == IMAGE_DECODER else 5
        layout = "N,C,H,W" if want == 4 else "N,C,T,H,W"
        if lat.dtype.kind != "f":
            raise Problem(415, "unsupported-dtype", f"latents dtype {lat.dtype} not accepted; send float32, float16, bfloat16 or float64")
        if lat.ndim == want - 1:
            lat = lat[None]
        if lat.ndim != want:
            raise Problem(422, "bad-shape", f"{hm.name} wants latents {layout}, got shape {list(lat.shape)}")
        if lat.shape[1] != m.latent_channels:
            raise Problem(422, "wrong-channels",
                          f"{hm.name} wants {m.latent_channels} latent channels, got {lat.shape[1]} (shape {list(lat.shape)})")
        if min(lat.shape) < 1:
            raise Problem(422, "bad-shape", f"empty latents: shape {list(lat.shape)}")
        if lat.shape[0] > s.max_batch:
            raise Problem(422, "batch-too-large", f"{lat.shape[0]} latents in one request; the limit is {s.max_batch}")
        f = m.spatial_factor
        out_px = lat.shape[-2] * f * lat.shape[-1] * f
        if out_px > s.max_pixels:
            raise Problem(422, "too-many-pixels",
                          f"output {lat.shape[-2] * f}x{lat.shape[-1] * f} = {out_px} pixels exceeds the limit of {s.max_pixels}")
        if hm.kind == VIDEO_DECODER:
            frames = 1 + m.temporal_factor * (lat.shape[2] - 1)
            if frames > s.max_frames:
                raise Problem(422, "too-many-frames", f"{frames} output frames exceed the limit of {s.max_frames}")
        lat = np.ascontiguousarray(lat, dtype=np.float32)
        if not np.isfinite(lat).all():
            raise Problem(422, "non-finite-latents", "latents contain NaN or Inf")
        return lat

    async def decode(self, name: str, latents: np.ndarray, *, tiled: bool | None = None,
                     clamp: bool = True, disconnected: DisconnectCheck | None = None) -> np.ndarray:
        """Latents -> float32 images N,H,W,3 (image decoder) or videos N,F,H,W,3, in [0,1].
        clamp=False (image decoders): x/2 + 0.5 of the unclamped decoder output (remote_decode `pt`)."""
        hm = self.model(name)
        if not hm.is_decoder:
            raise Problem(409, "wrong-model-kind", f"{name} is an {hm.kind}; decode needs a decoder")
        lat = await self.in_pool(self.check_latents, hm, latents)  # NaN scan of a large body: off the loop
        if hm.kind == IMAGE_DECODER:
            run = lambda x, t: hm.model.decode(x, tiled=t, clamp=clamp)  # noqa: E731
        else:  # video decoders always clamp (as diffusers' AutoencoderKLWan does)
            run = lambda x, t: hm.model.decode(x, tiled=t)  # noqa: E731
        call = lambda x: oom_recovery.decode_with_oom_retry(hm.name, hm.model, run, x, tiled)  # noqa: E731
        return await self._run(hm, ("decode", lat.shape[1:], tiled, clamp), lat, call, disconnected)

    async def vae_encode(self, name: str, images: np.ndarray, *,
                         disconnected: DisconnectCheck | None = None) -> np.ndarray:
        """Images N,H,W,3 in [0,1] -> scaled latents N,C,H/8,W/8 through an image VAE's encoder."""
        hm = self.model(name)
        if hm.kind != IMAGE_DECODER or not hm.model.has_encoder:
            raise Problem(409, "no-vae-encoder", f"{name} ({hm.kind}) has no VAE encoder weights to encode with")
        s = self.settings
        if images.ndim != 4 or images.shape[-1] != 3 or min(images.shape) < 1:
            raise Problem(422, "bad-shape", f"images must be N,H,W,3, got {list(images.shape)}")
        if images.shape[0] > s.max_batch:
            raise Problem(422, "batch-too-large", f"{images.shape[0]} images in one request; the limit is {s.max_batch}")
        if images.shape[1] * images.shape[2] > s.max_pixels:
            raise Problem(413, "image-too-large",
                          f"{images.shape[2]}x{images.shape[1]} pixels exceed the limit of {s.max_pixels}")
        px = np.ascontiguousarray(images, dtype=np.float32)
        if not np.isfinite(px).all():
            raise Problem(422, "non-finite-pixels", "pixels contain NaN or Inf")
        return await self._run(hm, ("vae_encode", px.shape[1:]), px, hm.model.encode, disconnected)

    def check_pixels(self, hm: HostedModel, px: np.ndarray) -> np.ndarray:
        if px.ndim == 3:
            px = px[None]
        size = int(hm.model.input_size)
        if px.ndim != 4 or px.shape[1:] != (size, size, 3):
            raise Problem(422, "bad-shape", f"{hm.name} wants pixels N,{size},{size},3, got {list(px.shape)}")
        if px.shape[0] > self.settings.max_batch:
            raise Problem(422, "batch-too-large",
                          f"{px.shape[0]} images in one request; the limit is {self.settings.max_batch}")
        px = np.ascontiguousarray(px, dtype=np.float32)
        if not np.isfinite(px).all():
            raise Problem(422, "non-finite-pixels", "pixels contain NaN or Inf")
        return px

    async def encode(self, name: str, pixels: np.ndarray, *,
                     disconnected: DisconnectCheck | None = None) -> dict[str, Any]:
        """Pixels N,S,S,3 in [0,1] at the model's input size -> {embedding (N,D), logits (N,K)|None}."""
        hm = self.encoder(name)
        px = await self.in_pool(self.check_pixels, hm, pixels)
        return await self._run(hm, ("encode", px.shape[1:]), px, hm.model.encode, disconnected)

    def encoder(self, name: str) -> HostedModel:
        hm = self.model(name)
        if hm.kind != IMAGE_ENCODER:
            raise Problem(409, "wrong-model-kind", f"{name} is an {hm.kind}; encode needs an image encoder")
        return hm


def top_k(logits: np.ndarray, k: int, labels: list[str] | None) -> list[list[dict]]:
    """Per row, the k largest softmax probabilities with their class index and label."""
    z = logits - logits.max(axis=1, keepdims=True)
    p = np.exp(z)
    p /= p.sum(axis=1, keepdims=True)
    k = min(k, p.shape[1])
    out = []
    for row in p:
        idx = np.argsort(-row, kind="stable")[:k]
        out.append([{"index": int(i), "label": labels[i] if labels and i < len(labels) else None,
                     "score": float(row[i])} for i in idx])
    return out

