"""The model worker's end of one front end's connection (service/worker/model_worker.py owns the
links): the front end's arena, mapped once from the descriptor its hello passes, and its requests
in this worker. The worker's one I/O thread hands each message to `handle`; the delivery thread
(or the device thread, for small outputs) writes each finished request's rows into the blocks the
front end allocated (`deliver`) and sends the answers; any thread may `send`, one message at a time."""
from __future__ import annotations

import logging
import threading
from multiprocessing.connection import Connection
from multiprocessing.reduction import recv_handle
from typing import Any

import numpy as np

from ..hosted_model import HostedModel
from ..ipc import worker_protocol as wp
from ..ipc.readable import Readable
from ..ipc.shm import ArenaView, TensorRef
from ..ipc.worker_errors import error_info
from . import oom_recovery
from .work_item import WorkItem
from .model_host import ModelHost
from .stream_steps import GeneratorSteps, StreamClosed

log = logging.getLogger("convserve.worker")


def _write_outputs(view: ArenaView, refs: dict[str, TensorRef], out: Any) -> None:
    """A model call's rows for one request -> the blocks its front end allocated for them."""
    parts = out if isinstance(out, dict) else {"out": out}
    for name, ref in refs.items():
        part = parts.get(name)
        if part is None:
            raise RuntimeError(f"the model gave no {name!r} output")
        dest = view.array(ref)
        if tuple(part.shape) != dest.shape:
            raise RuntimeError(f"output {name!r} has shape {tuple(part.shape)}, not the {dest.shape} expected")
        np.copyto(dest, part, casting="same_kind")


class FrontendLink:
    """One connected front end: its arena and its requests in this worker. Its messages are read
    by the worker's one I/O thread (Worker._serve_links); finished requests are delivered by the
    delivery thread (Worker._deliver) or the device thread (Worker._done), a model call's answers
    to this front end in one message."""

    def __init__(self, host: ModelHost, conn: Connection):
        self.host, self.conn = host, conn
        self._send_lock = threading.Lock()
        self.view: ArenaView | None = None
        self.base = 0  # where the arena's mapping starts here (handshake)
        self.items: dict[int, Any] = {}
        self.streams: dict[int, tuple[HostedModel, GeneratorSteps, np.ndarray]] = {}
        self.closed = False
        self.leader = False  # a shard group's leader (LeaderHello), not a front end
        #: another message (or the end of the connection) is there to read now
        self.has_more = Readable(conn)
        #: the arena's low pages pinned for the GPU (pinned_region), made and dropped under the lock
        self._region = None
        self._region_tried = False
        self._region_lock = threading.Lock()

    def pinned_region(self, backend, nbytes: int):
        """The arena's lowest `nbytes` pinned in place for the backend's DMAs (its gather_rows), made
        on first use (by the device thread); None where the backend does not offer it, pinning
        failed, or the link has ended. Unpinned by close(), before the mapping goes."""
        if self._region_tried:
            return self._region
        with self._region_lock:
            if not self._region_tried and not self.closed and self.view is not None:
                self._region_tried = True
                try:
                    self._region = backend.pin_host_region(self.view.address, min(nbytes, self.view.size))
                except Exception as exc:  # the ordinary stacking serves this link's batches
                    log.warning("pinning a front end's arena failed (%s: %s); its batches are stacked on the "
                                "host", exc.__class__.__name__, exc)
            return self._region

    def send(self, msg: wp.Message) -> None:
        if self.closed:
            return
        try:
            with self._send_lock:
                wp.send(self.conn, msg)
        except (OSError, EOFError, ValueError):  # the front end went away: the I/O thread cleans up
            self.closed = True

    def answer(self, rid: int, error: wp.WorkerError | None, stream: int | None = None) -> None:
        """A request's Done, sent at once (from the I/O thread: a failure before it ran, a
        withdrawal, a stream opened)."""
        self.send(wp.Done(rid, error, stream))

    def deliver(self, item: WorkItem) -> wp.Done | None:
        """A finished request's outputs into its blocks, and its answer (None once its front end
        has gone: its arena is released)."""
        _, rid, out_refs = item.tag
        self.items.pop(rid, None)
        exc = item.outcome.exception()
        if exc is None and not self.closed:
            try:
                _write_outputs(self.view, out_refs, item.outcome.result())
            except Exception as write_exc:
                if self.closed:  # gone meanwhile
                    return None
                log.exception("writing the outputs of request %s failed", rid)
                exc = write_exc
        return wp.Done(rid, None if exc is None else error_info(exc))

    def handshake(self) -> None:
        """The front end's (or shard leader's) hello and its arena's descriptor (on the accepting thread)."""
        hello = wp.recv(self.conn)
        if not isinstance(hello, (wp.Hello, wp.LeaderHello)):
            raise ValueError(f"expected a hello, got a {type(hello).__name__}")
        self.leader = isinstance(hello, wp.LeaderHello)
        self.view = ArenaView(recv_handle(self.conn), hello.arena_size)
        self.base = self.view.address  # read once: the arena's blocks' addresses are base + offset

    def close(self) -> None:
        self.closed = True
        self._drop_all()
        self.host.shard_member.link_closed(self)
        self.conn.close()
        with self._region_lock:  # unpinned (its last DMAs waited for) before the mapping may go
            self._region_tried = True
            region, self._region = self._region, None
        if region is not None:
            region.release()
        if self.view is not None:  # its pages leave this process with it (service/ipc/shm.py's rules)
            self.view.release()

    def handle(self, msg: wp.Message) -> None:
        match msg:
            case wp.SubmitMany(subs):
                self.host.tally.count(len(subs))
                self._admit([item for item in map(self._item, subs) if item is not None])
            case wp.Submit():
                self.host.tally.count(1)
                item = self._item(msg)
                if item is not None:
                    self._admit([item])
            case wp.Cancel(rid):
                item = self.items.get(rid)
                if item is not None and self.host.batcher.cancel(item):  # withdrawn before it ran
                    self.items.pop(rid, None)
                    self.answer(rid, error_info(item.outcome.exception()))
            case wp.StreamClose(stream):
                entry = self.streams.pop(stream, None)
                if entry is not None:
                    entry[1].close()
            case wp.Query(rid, what):
                try:
                    self.send(self.host.query(rid, what))
                except Exception as exc:
                    self.answer(rid, error_info(exc))
            case wp.ShardStreamClose(stream) if self.leader:  # service/worker/shard_leader.py's
                self.host.shard_member.stream_close(self, stream)
            case wp.ShardJoin() | wp.ShardDecode() | wp.ShardStreamOpen() | wp.ShardStreamNext() if self.leader:
                self._band(msg)
            case _:
                log.warning("a %s from a %s, which this worker does not take", type(msg).__name__,
                            "shard leader" if self.leader else "front end")

    def _item(self, msg: wp.Submit) -> WorkItem | None:
        """A submit's work for the batcher; None when it is answered already (a failure: it fails
        alone, whatever else came in its message; a stream opened)."""
        if msg.op == "stream_open":
            return self._stream_open(msg)
        host, rid, options = self.host, msg.rid, msg.options
        stream_step = msg.op == "stream_next"  # runs alone: nothing to batch with
        try:
            hm = host.models[msg.model]
            if stream_step:  # a stream's step runs on its latents (what the model-call faults inspect)
                _, steps, inputs = self._stream(options.stream)
                call, address = steps.step, 0
            else:  # the input's block in this front end's arena
                call, inputs = host.call_for(hm, msg.op, options), self.view.array(msg.input)
                address = self.base + msg.input.offset
            row_shape = inputs.shape[1:]
            if msg.op == "encode_jpeg":  # one file a request, of any length: they batch together
                if inputs.dtype != np.uint8 or inputs.ndim != 2 or inputs.shape[0] != 1:
                    raise ValueError(f"encode_jpeg takes one file's bytes, 1 x n uint8; got {inputs.dtype} {inputs.shape}")
                row_shape = ()
            key = (msg.model, msg.op, row_shape, inputs.dtype.str, options)
            return WorkItem(msg.model, key, inputs, call, solo=stream_step, tag=(self, rid, msg.outputs),
                            host_address=address)
        except Exception as exc:
            self.answer(rid, error_info(exc))
            return None

    def _band(self, msg) -> None:
        """A shard group leader's band (service/worker/shard_member.py): a solo item, like a stream's step."""
        try:
            inputs, call, out_refs = self.host.shard_member.call_for(self, msg, self.host.models, self.view)
            self._admit([WorkItem(msg.model, (msg.model, type(msg).__name__), inputs, call, solo=True,
                                  tag=(self, msg.rid, out_refs))])
        except Exception as exc:
            self.answer(msg.rid, error_info(exc))

    def _admit(self, items: list[WorkItem]) -> None:
        """Requests into the batcher together; each is answered when its model call is done
        (the batcher's on_done, then Worker._deliver) or when it is withdrawn (Cancel)."""
        for item in items:  # before the batcher has them: a finished item is popped from here
            self.items[item.tag[1]] = item
        files = [item for item in items if hasattr(item.call, "jpeg_size")]
        if files:  # JPEG files: decoded first, on the decode stage's thread (service/worker/jpeg_stage.py)
            self.host.jpeg_stage.submit(files)
            items = [item for item in items if not hasattr(item.call, "jpeg_size")]
        try:
            self.host.batcher.submit_many(items)
        except Exception as exc:  # a stopped worker: nothing of them runs
            for item in items:
                self.items.pop(item.tag[1], None)
                self.answer(item.tag[1], error_info(exc))

    def _stream_open(self, msg: wp.Submit) -> None:  # answered here: no model call to queue
        options = msg.options
        try:
            hm = self.host.models[msg.model]
            latents = np.array(self.view.array(msg.input))  # the decode outlives the request's input block
            if options.shards > 1:  # led here over the first N devices (service/worker/shard_leader.py)
                if self.host.shard_leader is None:
                    raise ValueError(f"{self.host.spec.device} does not lead shard groups")
                frames = self.host.shard_leader.frames(hm, latents, options.shards, options.uint8)
            else:
                frames = oom_recovery.frames(hm, latents, options.tiled, options.uint8)
            steps = GeneratorSteps(frames)
        except Exception as exc:
            self.answer(msg.rid, error_info(exc))
            return
        self.streams[msg.rid] = (hm, steps, latents)
        self.answer(msg.rid, None, msg.rid)

    def _stream(self, stream_id) -> tuple:
        """A stream's (model, steps, latents); each step runs as a solo item (nothing to batch with)."""
        entry = self.streams.get(stream_id)
        if entry is None:
            raise StreamClosed("no such stream")
        return entry

    def _drop_all(self) -> None:
        """The front end is gone: withdraw its queued work and end its streams."""
        batcher = self.host.batcher
        for item in list(self.items.values()):
            if batcher is not None:
                batcher.cancel(item)
        for _, steps, _ in self.streams.values():
            steps.close()
        self.streams.clear()
