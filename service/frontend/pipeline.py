"""The one request path every protocol adapter goes through, in each HTTP front-end process:
admission (ready, draining, queue full; the request metrics around it), then validated tensor ->
shared-memory arena -> a model worker (the batcher and the model, in the process that owns the
device) -> result rows in the arena, waited for with the timeout and the client's presence.
Adapters only parse their wire format into tensors and format the rows that come back."""
from __future__ import annotations

import asyncio
import logging
import math
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any, Awaitable, Callable

import numpy as np

from .. import metrics
from ..hosted_model import HostedModel
from ..ipc import worker_errors
from ..ipc import worker_protocol as wp
from ..ipc.shm import Arena, ArenaFull, TensorRef, TooLarge
from ..model_stats import ModelStats, ns
from ..problems import Problem
from ..settings import Settings
from . import validation
from .compute_cap import ComputeCap
from .decode_request import DecodeRequest
from .engine import Engine, Lease, NoWorker, Submission, WorkerFailure
from .http.uploads import Uploads
from .memory_budget import MemoryBudget, auto_budget_bytes
from .request_state import CURRENT, AdmittedRequest

log = logging.getLogger("convserve")

DisconnectCheck = Callable[[], Awaitable[bool]]

#: how often a waiting request checks whether its client went away
DISCONNECT_POLL_S = 0.1
#: how often a further front end, starting, looks whether it can serve yet
SETTLE_POLL_S = 0.02
#: bodies and arrays up to this size are parsed, checked and copied on the event loop (Service.offload)
INLINE_BYTES = 64 << 10
#: the options of the ops that take none (encode, vae_encode)
NO_OPTIONS = wp.Options()


def start_all_workers(pool: ThreadPoolExecutor, workers: int, timeout_s: float = 10.0) -> None:
    """ThreadPoolExecutor starts a thread only when a task finds none idle, so under load its
    thread count creeps up one burst at a time. Starting every worker now keeps the first loaded
    request from paying for a thread start and the count fixed, which the leak check relies on."""
    barrier = threading.Barrier(workers)
    for future in [pool.submit(barrier.wait, timeout_s) for _ in range(workers)]:
        future.result()


class Service:
    """One HTTP front end's request path: admission, the codec thread pool and the links to the
    model workers (service/frontend/engine.py), which own the devices and the models."""

    def __init__(self, settings: Settings, endpoints: list[tuple[str, str]] = ()):
        """endpoints: (device, Unix socket address) of every model worker (the supervisor's)."""
        self.settings = settings
        self.arena = Arena(settings.shm_bytes)
        self.engine = Engine(list(endpoints), self.arena, settings.worker_heartbeat_s, bulk=settings.bulk_submit)
        self.codec_pool = ThreadPoolExecutor(settings.codec_threads, thread_name_prefix="convserve-codec")
        self.budget = MemoryBudget(settings.memory_budget_bytes or auto_budget_bytes(1), self.retry_after)
        metrics.MEMORY_BUDGET_LIMIT.inc(self.budget.limit)
        self.draining = False
        self.inflight = 0
        #: admitted requests still reading their bodies (the rest of the queue is engine.waiting)
        self.reserved = 0
        self.uploads = Uploads()
        #: Triton-style per-model counts and ns (GET /v2/models/{name}/stats): the request half;
        #: the workers keep the batch half
        self.stats = ModelStats()
        #: the compute cap: pixels per request, and new shapes' path measurement (service/frontend/compute_cap.py)
        self.cap = ComputeCap(settings, lambda: self.backend_name)

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self) -> None:
        """Connect to the model workers (in the background: /healthz answers at once, /readyz
        once a worker is ready)."""
        start_all_workers(self.codec_pool, self.settings.codec_threads)
        self.engine.start(asyncio.get_running_loop())

    @property
    def ready(self) -> bool:
        return self.engine.ready

    async def until_settled(self) -> None:
        """Until ready, a load error, a drain, or the supervisor gone (startup only: polled)."""
        parent = os.getppid()
        while not (self.ready or self.load_error or self.draining or os.getppid() != parent):
            await asyncio.sleep(SETTLE_POLL_S)

    @property
    def models(self) -> dict[str, HostedModel]:
        return self.engine.models if self.ready else {}

    @property
    def failed(self) -> dict[str, str]:
        return self.engine.failed

    @property
    def load_error(self) -> str | None:
        return self.engine.load_error

    @property
    def backend_name(self) -> str:
        return self.engine.backend_name or self.settings.backend

    def card(self, hm: HostedModel) -> dict:
        """The model's card with the devices serving it."""
        return {**hm.card(), "devices": self.engine.devices(hm.name)}

    def begin_drain(self) -> None:
        """SIGTERM: stop admitting (readyz false, new requests 503); admitted work still runs."""
        if not self.draining:
            log.info("draining: %d request(s) in flight", self.inflight)
        self.draining = True

    def idle(self) -> bool:
        return self.inflight == 0

    def stop(self) -> None:
        self.engine.close()
        self.codec_pool.shutdown(wait=False, cancel_futures=True)

    # ---- admission -----------------------------------------------------------------------------
    def queued(self) -> int:
        return self.reserved + self.engine.waiting

    def retry_after(self) -> str:
        """Seconds (at least 1) until the queue should have room: its requests at the recent speed."""
        return str(max(1, math.ceil(self.queued() * self.engine.row_seconds())))

    def model(self, name: str) -> HostedModel:
        hm = self.models.get(name)
        if hm is None:
            if not self.ready and not self.draining:
                raise Problem(503, *self.engine.unready(), headers={"Retry-After": "2"})
            raise Problem(404, "unknown-model", f"no model named {name!r}; served: {sorted(self.models)}")
        return hm

    def _admit(self, model: str) -> AdmittedRequest:
        """Admission before any work: decided from the request line and the queue's state (the
        queue counts the places of admitted requests still reading their bodies), so a full
        queue costs a rejected client no body upload, parsing or NaN scan on the server."""
        if self.draining:
            raise self._refused(model, full=False, close=True)
        if not self.ready:
            raise Problem(503, *self.engine.unready(), headers={"Retry-After": "2"})
        if self.queued() >= self.settings.max_queue and not self.uploads.evict_slowest(self.settings.min_body_rate):
            raise self._refused(model, full=True)
        self.reserved += 1
        return AdmittedRequest(self, model, Lease(self.arena))

    def _refused(self, model: str, *, full: bool, close: bool = False) -> Problem:
        """A request the queue did not take: full (429) or refused by a drain (503)."""
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
        flight (the drain waits for it) until the block ends; then its arena blocks go."""
        hm = self.model(model)
        t0 = time.perf_counter()
        self.inflight += 1
        inflight, seconds = metrics.request_children(model, endpoint)
        inflight.inc()
        status = 200
        req = None
        try:
            req = self._admit(model)
            CURRENT.set(req)
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
            if req is not None:
                CURRENT.set(None)
                self._unreserve(req)
                req.lease.close()
            self.inflight -= 1
            inflight.dec()
            elapsed = time.perf_counter() - t0
            metrics.request_counter(model, endpoint, status).inc()
            seconds.observe(elapsed)
            self.stats.request_done(model, status == 200, ns(elapsed))

    def hand_over_lease(self) -> Lease:
        """The current request's arena blocks, for a response that sends straight from them
        (routes/arena_response.py closes the lease once every byte has left); the request's own end no longer
        frees them."""
        req = CURRENT.get()
        lease, req.lease = req.lease, Lease(self.arena)
        return lease

    def check_work(self, hm: HostedModel, pixels: int, what: str) -> None:
        """The compute cap: a request whose work (output pixels over frames and batch; input
        pixels for an encoder) is past the backend's cap is refused before it takes a device."""
        self.cap.check(hm, pixels, what)

    def take_memory(self, model: str, lease: Lease, nbytes: int, what: str, *, held: int = 0,
                    force: bool = False) -> None:
        """`nbytes` of the memory budget for as long as `lease` lives (its response is out), for a
        request already holding `held`."""
        try:
            self.budget.take(nbytes, what, held=held, force=force)
        except Problem as p:
            metrics.REJECTED.labels(model, "memory_budget").inc()
            raise p from None
        metrics.MEMORY_BUDGET_USED.inc(nbytes)
        lease.on_close.append(lambda: self._give_memory(nbytes))

    def _give_memory(self, nbytes: int) -> None:
        metrics.MEMORY_BUDGET_USED.dec(nbytes)
        if self.budget.give(nbytes):  # a burst ended: hand its freed heap back to the system
            self.codec_pool.submit(self.budget.trim)

    def _unreserve(self, req: AdmittedRequest) -> None:
        if req.reserved:
            req.reserved = False
            self.reserved -= 1

    async def in_pool(self, fn, *args):
        """Codec work (image/video encode, image decode) off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.codec_pool, fn, *args)

    async def offload(self, nbytes: int, fn, *args):
        """fn(*args) off the event loop when it handles more than INLINE_BYTES, else right here:
        for a small body a hop to the codec pool and back costs more than the work."""
        if nbytes <= INLINE_BYTES:
            return fn(*args)
        return await self.in_pool(fn, *args)

    # ---- the request path ------------------------------------------------------------------------
    async def run(self, hm: HostedModel, op: str, options: wp.Options, inputs: np.ndarray | None,
                  outputs: dict[str, tuple[tuple[int, ...], str]], disconnected: DisconnectCheck | None,
                  *, lease: Lease | None = None, link=None, continuation: bool = False) -> Submission:
        """`op` on a model worker (batched there with equal work from every front end), its
        inputs and outputs in this front end's arena; waits with the request's timeout and drops
        the work when the client goes. The answer's arrays (`Submission.arrays()`) stay valid
        until the request's lease is closed (the end of Service.admit's block, or `lease`).
        continuation: a later step of an admitted request (a streamed group): its memory is
        counted but never refused."""
        req = CURRENT.get()
        if req is not None:
            self._unreserve(req)  # the place passes to the engine's count of waiting requests
        lease = lease or req.lease
        in_ref = None
        arrays = (inputs.nbytes if inputs is not None else 0) + sum(
            math.prod(shape) * np.dtype(dtype).itemsize for shape, dtype in outputs.values())
        self.take_memory(hm.name, lease, arrays, f"{op} on {hm.name} (its input and output arrays)",
                         held=req.taken if req is not None else 0, force=continuation)
        if req is not None:
            req.taken += arrays
        try:
            if inputs is not None:
                in_ref = await self._stage(inputs)
            sub = self.engine.submit(lease, hm.name, op, options, in_ref,
                                     int(inputs.shape[0]) if inputs is not None else 1, outputs, link=link)
        except TooLarge as exc:
            if in_ref is not None:
                self.arena.free(in_ref.offset)
            raise Problem(413, "too-large-for-shared-memory", str(exc)) from None
        except ArenaFull as exc:
            if in_ref is not None:
                self.arena.free(in_ref.offset)
            raise Problem(503, "shared-memory-full", str(exc), headers={"Retry-After": self.retry_after()}) from None
        except NoWorker as exc:  # none up, or its worker unresponsive (service/ipc/heartbeat.py)
            if in_ref is not None:
                self.arena.free(in_ref.offset)
            raise Problem(503, exc.kind, f"{hm.name}: {exc.detail}", headers={"Retry-After": "2"}) from None
        deadline = time.perf_counter() + self.settings.request_timeout_s
        try:
            while True:
                left = deadline - time.perf_counter()
                if left <= 0:
                    self.engine.cancel(sub)
                    metrics.REJECTED.labels(hm.name, "timeout").inc()
                    raise Problem(504, "timeout", f"no result within {self.settings.request_timeout_s:g}s")
                done, _ = await asyncio.wait({sub.future}, timeout=min(DISCONNECT_POLL_S, left))
                if done:
                    break
                if disconnected is not None and await disconnected():
                    # queued: withdrawn; running: its batch stops at the next tile or frame group
                    # once every requester in it has gone (models/nn/interrupt.py)
                    self.engine.cancel(sub)
                    metrics.REJECTED.labels(hm.name, "client_gone").inc()
                    log.info("client gone: dropped a %s %s request", "running" if sub.started else "queued", hm.name)
                    raise Problem(499, "client-gone", "the client disconnected before its result")
        except asyncio.CancelledError:
            self.engine.cancel(sub)
            raise
        try:
            sub.future.result()
        except WorkerFailure as exc:
            raise worker_errors.problem(hm.name, exc.kind, exc.message, exc.error_id, self.retry_after) from None
        return sub

    async def _stage(self, inputs: np.ndarray) -> TensorRef:
        """`inputs` copied into a fresh arena block (a large copy in the codec pool). A request
        cancelled meanwhile frees the block only once the copy into it has finished."""
        ref = self.arena.reserve(inputs.shape, inputs.dtype)
        if inputs.nbytes <= (1 << 20):
            np.copyto(self.arena.array(ref), inputs, casting="no")
            return ref
        copy = asyncio.get_running_loop().run_in_executor(self.codec_pool, np.copyto, self.arena.array(ref), inputs)
        try:
            await asyncio.shield(copy)
        except BaseException:
            copy.add_done_callback(lambda _: self.arena.free(ref.offset))
            raise
        return ref

    async def decode(self, req: DecodeRequest, *, disconnected: DisconnectCheck | None = None) -> np.ndarray:
        """A decode as its route decided it (service/frontend/decode_request.py) -> float32 images
        N,H,W,3 (image decoder; req.alpha: RGBA N,H,W,4) or videos N,F,H,W,3, in [0,1]; with req.uint8,
        uint8 pixels converted on the device (a quarter of the bytes to move, and nothing left to
        convert for a file).
        req.shards > 1 decodes untiled on the first N devices together."""
        hm, out_shape = req.hm, req.out_shape
        pixels = math.prod(out_shape[:-1])
        self.check_work(hm, pixels, f"decoding to {'x'.join(map(str, out_shape[:-1]))} pixels")
        link = req.link(self.engine)  # None: any worker
        with self.cap.first_run(hm, req.first_run_key, pixels):
            sub = await self.run(hm, "decode", req.worker_options(), req.latents,
                                 {"out": (out_shape, "uint8" if req.uint8 else "float32")}, disconnected, link=link)
        return sub.arrays()["out"]

    async def vae_encode(self, hm: HostedModel, images: np.ndarray, *,
                         disconnected: DisconnectCheck | None = None) -> np.ndarray:
        """Images N,H,W,3 in [0,1] -> scaled latents N,C,H/8,W/8 through an image VAE's encoder; a
        video VAE's frames N,F,H,W,3 -> its latents N,C,T,h,w (hm.encoded_shape). The compute cap
        counts every frame's pixels."""
        check = validation.vae_frames if hm.is_video else validation.vae_images
        px = await self.offload(images.nbytes, check, hm, images, self.settings)  # NaN scan
        self.check_work(hm, math.prod(px.shape[:-1]), f"encoding {'x'.join(map(str, px.shape[:-1]))} pixels")
        with self.cap.first_run(hm, ("vae_encode", px.shape), math.prod(px.shape[:-1])):
            sub = await self.run(hm, "vae_encode", NO_OPTIONS, px, {"out": (hm.encoded_shape(px.shape), "float32")},
                                 disconnected)
        return sub.arrays()["out"]

    async def encode(self, hm: HostedModel, pixels: np.ndarray, *,
                     disconnected: DisconnectCheck | None = None) -> dict[str, Any]:
        """Pixels N,S,S,3 at the model's input size (float in [0,1], or uint8: a quarter of the bytes
        to move, converted on the device) -> {embedding (N,D), logits (N,K)|None}."""
        px = await self.offload(pixels.nbytes, validation.encoder_pixels, hm, pixels, self.settings)  # uint8 stays
        self.check_work(hm, math.prod(px.shape[:-1]), f"encoding {'x'.join(map(str, px.shape[:-1]))} pixels")
        sub = await self.run(hm, "encode", NO_OPTIONS, px, hm.encoder_outputs(px.shape[0]), disconnected)
        out = sub.arrays()
        return {"embedding": out["embedding"], "logits": out.get("logits")}

    async def encode_jpeg(self, hm: HostedModel, body: bytes, link, *,
                          disconnected: DisconnectCheck | None = None) -> dict[str, Any]:
        """A JPEG file of the model's input size (service/codecs/jpeg_header.py passed it) -> what
        encode returns, the file decoded by `link`'s worker (Engine.jpeg_link): op encode_jpeg."""
        size = int(hm.model.input_size)
        self.check_work(hm, size * size, f"encoding {size}x{size} pixels")
        data = np.frombuffer(body, np.uint8)[None]
        sub = await self.run(hm, "encode_jpeg", NO_OPTIONS, data, hm.encoder_outputs(1), disconnected, link=link)
        out = sub.arrays()
        return {"embedding": out["embedding"], "logits": out.get("logits")}
