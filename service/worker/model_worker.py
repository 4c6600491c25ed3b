"""A model worker: the one process that owns a device (one GPU, or the CPU) and the models on it.

HTTP front ends (service/frontend/engine.py) connect to its Unix socket; the supervisor
(service/supervisor.py) starts it, and starts it again when it dies or hangs. What it does:

- loads the backend and every configured model once, warms them up, then says it is ready;
- takes requests from any number of front ends: each front end sends the descriptor of its
  shared-memory arena once (service/ipc/shm.py), then messages naming tensors in it, never the data;
- runs them through one Batcher (requests of every front end batch together) and writes each
  result into the output block its front end allocated, then answers `Done`;
- pays what it can per message or per model call, not per request: a front end's SubmitMany is
  read, decoded and queued at once (one wake-up of the device thread), a model call's requests
  go to the delivery thread in one hand-off and its answers to each front end in one DoneMany;
- keeps the stateful part of streamed decodes (the causal decoder's generator) between steps;
- beats (service/ipc/heartbeat.py): front ends and the supervisor tell it hung from busy by that.

The messages (one type each, and their encoding) are service/ipc/worker_protocol.py's; a shard
group's leader (service/worker/shard_leader.py) connects as a front end does, with its own hello and ops.
"""
from __future__ import annotations

import faulthandler
import logging
import os
import queue
import selectors
import signal
import sys
import threading
from multiprocessing import Pipe
from multiprocessing.connection import Connection, Listener
from multiprocessing.reduction import recv_handle
from typing import Any

import numpy as np

from ..hosted_model import HostedModel
from ..ipc import shm
from ..ipc import worker_protocol as wp
from ..ipc.heartbeat import Beat, beat_path
from ..ipc.shm import ArenaView, TensorRef
from ..ipc.worker_errors import error_info
from . import oom_recovery
from .batcher import WorkItem
from .model_host import ModelHost, WorkerSpec
from .stream_steps import GeneratorSteps, StreamClosed

log = logging.getLogger("convserve.worker")

#: how often the worker checks that the process that started it is still there
PARENT_POLL_S = 0.5


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
    delivery thread (Worker._deliver), a model call's answers to this front end in one message."""

    def __init__(self, host: ModelHost, conn: Connection):
        self.host, self.conn = host, conn
        self._send_lock = threading.Lock()
        self.view: ArenaView | None = None
        self.items: dict[int, Any] = {}
        self.streams: dict[int, tuple[HostedModel, GeneratorSteps, np.ndarray]] = {}
        self.closed = False
        self.leader = False  # a shard group's leader (LeaderHello), not a front end

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
        exc = item.future.exception()
        if exc is None and not self.closed:
            try:
                _write_outputs(self.view, out_refs, item.future.result())
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

    def close(self) -> None:
        self.closed = True
        self._drop_all()
        self.host.shard_member.link_closed(self)
        self.conn.close()
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
                    self.answer(rid, error_info(item.future.exception()))
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
                call = steps.step
            else:
                call, inputs = host.call_for(hm, msg.op, options), self.view.array(msg.input)
            key = (msg.model, msg.op, inputs.shape[1:], inputs.dtype.str, options)
            return WorkItem(msg.model, key, inputs, call, solo=stream_step, tag=(self, rid, msg.outputs))
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


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.host = ModelHost(spec)
        self.links: list[FrontendLink] = []
        self._links_lock = threading.Lock()
        self.stop = threading.Event()
        self.host.on_change = self._broadcast
        self.host.on_start = self._started
        # a new link wakes the I/O thread's wait with a byte here
        self._wake_r, self._wake_w = Pipe(duplex=False)

    def _deliver(self) -> None:
        """The delivery thread: finished model calls' outputs into their front ends' blocks and
        one answer message per front end for all that finished together, off the device thread (a
        batch of float32 images is megabytes to copy; the device runs the next batch meanwhile).
        The device thread hands over a whole batch at once (the batcher's on_done)."""
        deliveries = self.host.deliveries
        while True:
            answers: dict[FrontendLink, list[wp.Done]] = {}
            batch = deliveries.get()
            while batch is not None:
                for item in batch:
                    link = item.tag[0]
                    done = link.deliver(item)
                    if done is not None:
                        answers.setdefault(link, []).append(done)
                try:
                    batch = deliveries.get_nowait()
                except queue.Empty:
                    batch = None
            for link, dones in answers.items():
                link.send(wp.DoneMany(dones))

    def _broadcast(self) -> None:
        with self._links_lock:  # the state read and sent as one step against a link joining (_accept)
            desc = self.host.description()
            links = [link for link in self.links if not link.closed]
            self.links = links
            for link in links:
                link.send(desc)

    def _started(self, batch) -> None:
        by_link: dict[FrontendLink, list[int]] = {}
        for item in batch:
            if item.tag is not None:
                by_link.setdefault(item.tag[0], []).append(item.tag[1])
        for link, rids in by_link.items():
            link.send(wp.Started(rids))

    def _accept(self, listener: Listener) -> None:
        while not self.stop.is_set():
            try:
                conn = listener.accept()
                link = FrontendLink(self.host, conn)
                link.handshake()
            except Exception as exc:  # one bad connection never stops the accepting
                if self.stop.is_set():
                    return
                log.warning("a front end's connection failed its handshake: %s: %s", exc.__class__.__name__, exc)
                continue
            # its first Status and its place among the links in one step, under the lock a
            # broadcast takes too: a change in between (the load failing) would otherwise reach
            # every link but this one, which would show "loading" for good
            with self._links_lock:
                link.send(self.host.description())
                self.links.append(link)
            self._wake_w.send_bytes(b"+")

    def _serve_links(self) -> None:
        """The one thread that reads every front end's messages: a thread per link would pass
        the interpreter lock between them, and the device thread waits behind that hand-off."""
        sel = selectors.DefaultSelector()  # kept: registering every link on each wait cost ~5 %
        sel.register(self._wake_r, selectors.EVENT_READ, None)
        watched: set[FrontendLink] = set()
        while not self.stop.is_set():
            with self._links_lock:
                links = [link for link in self.links if not link.closed]
            for link in set(links) - watched:
                sel.register(link.conn, selectors.EVENT_READ, link)
                watched.add(link)
            shm.sweep()  # released arenas that a batch still viewed, once it is done
            ready = sel.select(PARENT_POLL_S)
            self.host.tally.publish(force=not ready)  # now and then, and when idle
            for key, _ in ready:
                link = key.data
                if link is None:
                    self._wake_r.recv_bytes()
                    continue
                conn = link.conn
                try:
                    link.handle(wp.recv(conn))
                    while conn.poll():  # what else has arrived, in one go
                        link.handle(wp.recv(conn))
                except (EOFError, OSError) as exc:
                    self._unwatch(sel, watched, link, exc)
                except Exception as exc:
                    log.exception("front-end link failed")
                    self._unwatch(sel, watched, link, exc)

    def _unwatch(self, sel, watched: set, link: FrontendLink, why: BaseException) -> None:
        """The front end is gone (or broke the protocol): its work, streams and arena go."""
        sel.unregister(link.conn)
        watched.discard(link)
        with self._links_lock:
            self.links = [other for other in self.links if other is not link]
        link.close()

    def run(self) -> None:
        # first: the supervisor counts a worker silent past the hang limit as hung (service/ipc/heartbeat.py)
        self.host.on_busy = Beat(beat_path(self.spec.address), self.spec.settings.worker_heartbeat_s).call
        if os.path.exists(self.spec.address):
            os.unlink(self.spec.address)
        listener = Listener(self.spec.address, family="AF_UNIX", backlog=128)
        threading.Thread(target=self._accept, args=(listener,), name="convserve-accept", daemon=True).start()
        threading.Thread(target=self._serve_links, name="convserve-links", daemon=True).start()
        threading.Thread(target=self._deliver, name="convserve-deliver", daemon=True).start()
        threading.Thread(target=self.host.load, name="convserve-loader", daemon=True).start()
        try:
            while not self.stop.wait(PARENT_POLL_S):
                if os.getppid() != self.spec.parent_pid:  # orphaned: the server is gone
                    log.warning("%s: the server process is gone; exiting", self.spec.device)
                    break
        finally:
            listener.close()
            if self.host.batcher is not None:
                self.host.batcher.stop()


#: how the supervisor stops a worker (SIGTERM is ignored while the supervisor lives, see main)
STOP_SIGNAL = signal.SIGUSR2


def _term(worker: Worker, spec: WorkerSpec) -> None:
    """SIGTERM: stop only when no supervisor is there to stop this worker after the drain."""
    if os.getppid() != spec.parent_pid:
        worker.stop.set()


def main(spec: WorkerSpec) -> None:
    """The worker process's entry point (multiprocessing, spawn)."""
    if spec.cuda_visible is not None:  # before anything initialises CUDA: this GPU is device 0 here
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible
    logging.basicConfig(level=spec.settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[{spec.device}]: %(message)s")
    # the device thread and the I/O thread share the interpreter lock: a short switch interval
    # keeps the device thread from waiting up to 5 ms to launch the next batch
    sys.setswitchinterval(0.001)
    worker = Worker(spec)
    # `kill -USR1 <worker pid>` writes every thread's stack to the log: where a stuck device thread waits
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    # Ctrl-C, and a SIGTERM sent to the whole process group (`timeout`, systemd's default KillMode),
    # reach the workers too: the front ends drain first and need their workers meanwhile, so a
    # worker ignores both while its supervisor lives. The supervisor stops it with STOP_SIGNAL.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, lambda *_: _term(worker, spec))
    signal.signal(STOP_SIGNAL, lambda *_: worker.stop.set())
    worker.run()

