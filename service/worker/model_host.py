"""What a model worker holds for its device: the backend, the models loaded and warmed up on it,
and the one batcher every front end's requests go through (service/worker/model_worker.py serves the
front ends around it)."""
from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from .. import gc_pauses, metrics
from ..hosted_model import HostedModel
from ..ipc import worker_protocol as wp
from ..ipc.batch_sizes import batch_sizes
from ..model_stats import ModelStats
from ..settings import Settings
from . import fault_injection, oom_recovery
from .batcher import Batcher, Later
from .jpeg_bodies import JpegBodies
from .jpeg_stage import JpegStage
from .loading import load_entry, shard_offered, view_of, warm_up
from .shard_leader import DEADLINE_S, ShardLeader, comm_class
from .shard_member import ShardMember

log = logging.getLogger("convserve.worker")


@dataclass(frozen=True)
class WorkerSpec:
    """What the supervisor tells a worker it starts."""
    device: str               # "cpu", "cuda:0", ...: the metrics' and cards' device label
    cuda_visible: str | None  # the physical GPU: its CUDA_VISIBLE_DEVICES entry (narrowed to it here)
    address: str              # the Unix socket front ends connect to
    settings: Settings
    parent_pid: int
    #: every worker's address in device order: shards=N groups the first N (service/worker/shard_leader.py)
    group: tuple[str, ...] = ()
    #: the first start's: a connection on which the initial load's outcome goes to the supervisor
    #: (None, or why it failed), which ends start-up on a failure; None on a restart, whose load
    #: failure is served as 503s instead (service/supervisor.py)
    report: Any = None
    #: the cores this worker runs on (service/process_plan.py `pins`); () where it is not pinned
    cpus: tuple[int, ...] = ()


class SubmitTally:
    """The Submit and SubmitMany messages a worker read and the requests they carried (its I/O
    thread's counts, plain integers), published to the metrics at most every PUBLISH_S: a
    multiprocess counter's write is a locked store in a shared file, too dear once a request."""
    PUBLISH_S = 0.05

    def __init__(self, device: str):
        self.device = device
        self.messages = self.submits = 0
        self._published = (0, 0, 0.0)

    def count(self, submits: int) -> None:
        self.messages += 1
        self.submits += submits

    def publish(self, force: bool = False) -> None:
        messages, submits, at = self._published
        now = time.monotonic()
        if self.messages != messages and (force or now - at >= self.PUBLISH_S):
            metrics.WORKER_SUBMIT_MESSAGES.labels(self.device).inc(self.messages - messages)
            metrics.WORKER_SUBMITS.labels(self.device).inc(self.submits - submits)
            self._published = (self.messages, self.submits, now)


class ModelHost:
    """The backend, the models and the batcher of one device."""

    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.settings = spec.settings
        self.backend = None
        self.models: dict[str, HostedModel] = {}
        self.failed: dict[str, str] = {}
        self.load_error: str | None = None
        self.ready = False
        self.batcher: Batcher | None = None
        self.stats = ModelStats()
        self.on_change = lambda: None
        self.on_start = lambda batch: None
        #: a model call's resolved items (the worker answers them; this default queues them for delivery)
        self.on_done = lambda batch: self.deliveries.put(batch)
        self.on_busy = lambda started: None  # the worker's heartbeat record (service/ipc/heartbeat.py)
        self.device_thread: threading.Thread | None = None
        #: finished model calls' items, from the device thread to the delivery thread (Worker._deliver)
        self.deliveries: queue.SimpleQueue = queue.SimpleQueue()
        self.tally = SubmitTally(spec.device)
        #: sharded decodes: led here on the first device's worker, followed on the others
        self.shard_leader: ShardLeader | None = None
        self.shard_member = ShardMember(fault_injection.shard_fault())
        #: the decoder of encode requests' JPEG files, where this worker decodes them (JPEG_DECODE)
        self.jpeg: JpegBodies | None = None
        self.jpeg_models: list[str] = []
        self.jpeg_stage: JpegStage | None = None  # its thread, where jpeg_models has any

    def load(self) -> None:
        try:
            from convkernels import get_backend

            s = self.settings
            self.backend = get_backend(s.backend, **s.backend_options())
            log.info("%s: backend %s", self.spec.device, self.backend.describe())
            self.shard_member.comm_cls = comm_class(self.backend, s)
            if self.spec.group and self.spec.group[0] == self.spec.address:
                self.shard_leader = ShardLeader(self.spec.group, self.shard_member.comm_cls, self.shard_member.fault,
                                                deadline_s=max(DEADLINE_S, 2 * s.request_timeout_s),
                                                on_gpu=self.backend.name == "cuda", shm_bytes=s.shm_bytes)
            for entry in s.model_entries():
                try:
                    hm = load_entry(entry, self.backend, s.tile_size, self.spec.device)
                    warm_up(hm, s.warmup_shapes(), calls_per_size=self.backend.calls_to_warm,
                            batches=tuple(batch_sizes(s.max_batch)))
                except Exception as exc:
                    metrics.count_fault(entry.name, "load_error", "failed")
                    if not entry.optional:
                        raise
                    self.failed[entry.name] = f"{exc.__class__.__name__}: {exc}"
                    log.warning("optional model %s not served: %s", entry.name, self.failed[entry.name])
                    continue
                self.models[entry.name] = hm
            self._take_jpeg_bodies()
            # The front ends bound what waits (admission happens there, before the body): the
            # worker's own queue holds what they admitted, however many they are.
            self.batcher = Batcher(max_batch=s.max_batch, max_queue_delay_ms=s.max_queue_delay_ms,
                                   after_batch=self.backend.flush_timings, stats=self.stats,
                                   name=self.spec.device, on_start=self.on_start, on_busy=self.on_busy,
                                   on_done=self.on_done, host_batch=self.backend.host_batch,
                                   gather=self._gather,
                                   # after warm-up: injected faults never stop a start
                                   before_call=fault_injection.arm_if_configured(self.backend))
            self.device_thread = self.batcher.thread
            if self.jpeg_models:
                self.jpeg_stage = JpegStage(self.jpeg, self.batcher.submit_many, self.deliveries.put, s.max_batch,
                                            self.spec.device)
            # the models are loaded and warmed: their objects (and the modules') are for good
            gc_pauses.freeze_startup_heap("worker", s.gc_freeze)
            self.ready = True
            log.info("%s ready: %s", self.spec.device, ", ".join(self.models))
        except Exception as exc:  # the worker stays up (live, not ready) and says why
            self.load_error = f"{exc.__class__.__name__}: {exc}"
            if self.spec.report is None:
                log.exception("model loading failed")
            else:  # start-up ends with this one line (the supervisor's); the traceback on demand
                log.debug("model loading failed", exc_info=True)
        finally:
            self.on_change()
            self._report()

    def _take_jpeg_bodies(self) -> None:
        """Which models' encodes take JPEG files here (op encode_jpeg): image encoders, and on the
        GPU's JPEG engines only those whose run-ahead call takes device pixels (call_for)."""
        self.jpeg = JpegBodies.for_backend(self.backend, self.settings.jpeg_decode, self.spec.device)
        if self.jpeg is None:
            return
        for name, hm in self.models.items():
            if getattr(hm.model, "input_size", None) is None or not hasattr(hm.model, "encode"):
                continue
            try:
                self.call_for(hm, "encode_jpeg", wp.Options())
            except ValueError:
                continue
            self.jpeg_models.append(name)

    def _report(self) -> None:
        """The first start's load outcome to the supervisor (WorkerSpec.report), once."""
        conn = self.spec.report
        if conn is None:
            return
        try:
            conn.send(self.load_error)
            conn.close()
        except OSError:  # the supervisor is gone or stopping: nothing waits for it
            pass

    def description(self) -> wp.Status:
        state = "ready" if self.ready else "failed" if self.load_error else "loading"
        return wp.Status(
            self.spec.device, state, gpu=self.spec.cuda_visible, pid=os.getpid(), load_error=self.load_error,
            failed=dict(self.failed), backend=self.backend.name if self.backend is not None else None,
            models={name: wp.ModelStatus(hm.entry, view_of(hm.model), hm.load_seconds, hm.warmup_seconds,
                                         dict(hm.extra)) for name, hm in self.models.items()},
            row_seconds=self.batcher.row_seconds if self.batcher is not None else 0.0,
            shard_offered=shard_offered(), jpeg_models=list(self.jpeg_models))

    def _gather(self, batch) -> Any:
        """A batch of uint8 pixels joined on the device from its requests' blocks in their front
        ends' arenas, each arena's low pages pinned in place (FrontendLink.pinned_region); None
        where that cannot be (the batcher stacks it on the host then). Rows of JPEG files decoded
        on the device are joined there. On the device thread."""
        if not isinstance(batch[0].inputs, np.ndarray):  # rows decoded on the device (service/worker/jpeg_stage.py)
            return self.jpeg.join([it.inputs for it in batch], [it.ready for it in batch])
        if batch[0].inputs.dtype != np.uint8 or not self.settings.cuda_pinned_arena_bytes:
            return None
        regions = [it.tag[0].pinned_region(self.backend, self.settings.cuda_pinned_arena_bytes)
                   if it.tag is not None else None for it in batch]
        return self.backend.gather_rows([it.inputs for it in batch], regions, [it.host_address for it in batch])

    def call_for(self, hm: HostedModel, op: str, options: wp.Options):
        """The model call an op names (the ops a front end may ask for; a shard leader's are
        ShardMember.call_for's)."""
        if op == "decode" and options.shards > 1:
            if self.shard_leader is None:
                raise ValueError(f"{self.spec.device} does not lead shard groups; the first device's worker does")
            return lambda x: self.shard_leader.decode(hm, x, options.shards, options.clamp, options.uint8,
                                                      options.alpha)
        if op == "decode":
            return lambda x: oom_recovery.decode(hm, x, tiled=options.tiled, clamp=options.clamp, uint8=options.uint8,
                                                 alpha=options.alpha)
        if (op == "encode" and self.backend.runs_ahead and self.settings.run_ahead
                and hasattr(hm.model, "encode_started")):
            # the device runs ahead: the batcher stacks and starts the next batch while this one's
            # embeddings are on their way back (batcher.Later)
            started = hm.model.encode_started
            call = lambda x: Later(started(x))  # noqa: E731 - it carries an attribute
            # uint8 pixels may arrive gathered on the device (ModelHost._gather)
            call.device_input = bool(getattr(hm.model, "takes_device_pixels", False))
            return call
        if op in ("encode", "vae_encode"):
            return hm.model.encode
        if op == "encode_jpeg":
            if self.jpeg is None or getattr(hm.model, "input_size", None) is None:
                raise ValueError(f"{self.spec.device} does not decode JPEG files for {hm.name}")
            base = self.call_for(hm, "encode", options)
            if self.jpeg.hardware is not None and not getattr(base, "device_input", False):
                raise ValueError(f"{hm.name}'s encode here takes no device pixels: it takes no JPEG files")

            def call(x):  # never called: the decode stage hands each request on with `decoded`
                raise RuntimeError("a JPEG file reached a model call undecoded")
            call.jpeg_size, call.decoded = int(hm.model.input_size), base
            return call
        raise ValueError(f"unknown op {op!r}")

    def query(self, rid: int, what: str) -> wp.KernelsAnswer | wp.StatsAnswer:
        if what == "kernels":
            be = self.backend
            if be is None:
                return wp.KernelsAnswer(rid, None)
            return wp.KernelsAnswer(rid, {"device": self.spec.device, "backend": be.describe(),
                                          "conv_choices": be.conv_choices(), "plan_cache": be.plan_cache_stats()})
        if what == "stats":
            return wp.StatsAnswer(rid, self.stats.records())
        raise ValueError(f"unknown query {what!r}")
