"""A model worker: the one process that owns a device (one GPU, or the CPU) and the models on it.

HTTP front ends (service/engine.py) connect to its Unix socket; the supervisor
(service/supervisor.py) starts it, and starts it again when it dies or hangs. What it does:

- loads the backend and every configured model once, warms them up, then says it is ready;
- takes requests from any number of front ends: each front end sends the descriptor of its
  shared-memory arena once (service/shm.py), then messages naming tensors in it, never the data;
- runs them through one Batcher (requests of every front end batch together) and writes each
  result into the output block its front end allocated, then answers `done`;
- keeps the stateful part of streamed decodes (the causal decoder's generator) between steps;
- beats (service/heartbeat.py): front ends and the supervisor tell it hung from busy by that.

The wire protocol, front end -> worker (tuples, pickled by multiprocessing.connection):
  ("hello", frontend_pid, arena_size) followed by the arena's descriptor (SCM_RIGHTS)
  ("submit", rid, model, op, options, input_ref, {output name: ref})
      op: decode | encode | vae_encode (batched; decode's option shards=N: a shard group's, led
      here, service/shard_leader.py); shard_join, shard_decode (a shard leader's, to its
      followers); stream_open (a streamed decode of input_ref's
      latents; answers its stream id), stream_next (options {"stream": id}: its next frame group)
  ("cancel", rid)
  ("stream_close", stream_id)
  ("shard_stream_close", stream)             a shard leader's (service/shard_leader.py)
  ("query", rid, what)                       what: "kernels" | "stats"
worker -> front end:
  ("status", description)                    on connect and whenever it changes
  ("started", [rid, ...])                    a model call began with these requests
  ("done", rid, error | None, payload)       error: (kind, message, error_id)
  ("done_many", [(rid, error, payload), ...]) a batch's answers to one front end, in one message
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

from . import oom_recovery, shm
from .batcher import Cancelled, Closed
from .model_host import HostedModel
from .shm import ArenaView, TensorRef
from .shard_leader import ShardFailed
from .stream_steps import GeneratorSteps, StreamClosed
from .device_host import ModelHost, WorkerSpec
from .heartbeat import Beat, beat_path

log = logging.getLogger("convserve.worker")

#: how often the worker checks that the process that started it is still there
PARENT_POLL_S = 0.5


def error_info(exc: BaseException) -> tuple[str, str, str | None]:
    """An exception of a model call -> what crosses the process boundary (kind, message, id)."""
    if isinstance(exc, oom_recovery.DeviceOutOfMemory):
        return "device-oom", str(exc), None
    if isinstance(exc, Cancelled):
        return "cancelled", "withdrawn before it ran", None
    if isinstance(exc, Closed):
        return "closed", "the worker stopped before this request ran", None
    if isinstance(exc, StreamClosed):
        return "stream-closed", str(exc), None
    if isinstance(exc, ShardFailed):
        return "shard-failed", str(exc), None
    if isinstance(exc, ValueError):
        return "invalid-input", str(exc), None
    return "model-error", f"{exc.__class__.__name__}: {exc}", getattr(exc, "error_id", None)


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
    delivery thread (Worker._deliver), their answers gathered in `outbox` and sent together."""

    def __init__(self, host: ModelHost, conn: Connection):
        self.host, self.conn = host, conn
        self._send_lock = threading.Lock()
        self.view: ArenaView | None = None
        self.items: dict[int, Any] = {}
        self.streams: dict[int, tuple[HostedModel, GeneratorSteps, np.ndarray]] = {}
        self.closed = False
        self.outbox: list[tuple] = []
        self._outbox_lock = threading.Lock()

    def send(self, msg) -> None:
        if self.closed:
            return
        try:
            with self._send_lock:
                self.conn.send(msg)
        except (OSError, EOFError, ValueError):  # the front end went away: the I/O thread cleans up
            self.closed = True

    def answer(self, rid: int, error, payload) -> None:
        """A request's `done`, sent at once (from the I/O thread: a failure before it ran, a
        withdrawal, a stream opened)."""
        self.send(("done", rid, error, payload))

    def deliver(self, rid: int, out_refs: dict[str, TensorRef], future) -> None:
        """A finished request's outputs into its blocks, and its answer into the outbox (none
        once its front end has gone: its arena is released)."""
        exc = future.exception()
        if exc is None and not self.closed:
            try:
                _write_outputs(self.view, out_refs, future.result())
            except Exception as write_exc:
                if self.closed:  # gone meanwhile
                    return
                log.exception("writing the outputs of request %s failed", rid)
                exc = write_exc
        with self._outbox_lock:
            self.outbox.append((rid, None if exc is None else error_info(exc), None))

    def flush(self) -> None:
        with self._outbox_lock:
            answers, self.outbox = self.outbox, []
        if answers:
            self.send(("done_many", answers))

    def handshake(self) -> None:
        """The front end's hello and its arena's descriptor (on the accepting thread)."""
        tag, _pid, size = self.conn.recv()
        if tag != "hello":
            raise ValueError(f"expected hello, got {tag!r}")
        self.view = ArenaView(recv_handle(self.conn), size)
        self.send(("status", self.host.description()))

    def close(self) -> None:
        self.closed = True
        self._drop_all()
        self.host.shard_member.link_closed(self)
        self.conn.close()
        if self.view is not None:  # its pages leave this process with it (service/shm.py's rules)
            self.view.release()

    def handle(self, msg: tuple) -> None:
        op = msg[0]
        if op == "submit":
            self._submit(*msg[1:])
        elif op == "cancel":
            item = self.items.get(msg[1])
            if item is not None:
                self.host.batcher.cancel(item)
        elif op == "stream_close":
            entry = self.streams.pop(msg[1], None)
            if entry is not None:
                entry[1].close()
        elif op == "shard_stream_close":  # from a shard group's leader (service/shard_leader.py)
            self.host.shard_member.stream_close(self, msg[1])
        elif op == "query":
            rid, what = msg[1:]
            try:
                self.send(("done", rid, None, self.host.query(what)))
            except Exception as exc:
                self.send(("done", rid, error_info(exc), None))
        else:
            log.warning("unknown message %r", op)

    def _submit(self, rid, model, op, options, in_ref, out_refs):
        if op == "stream_open":
            return self._stream_open(rid, model, in_ref, options)
        host = self.host
        # a stream's next group and a shard group's steps run alone: nothing to batch with
        stream_step = op == "stream_next"
        solo = stream_step or op.startswith("shard_")
        try:
            hm = host.models[model]
            if stream_step:  # a stream's step runs on its latents (what the model-call faults inspect)
                _, steps, inputs = self._stream(options["stream"])
                call = steps.step
            else:
                call, inputs = host.call_for(hm, op, options, link=self), self.view.array(in_ref)
            key = (model, op, inputs.shape[1:], inputs.dtype.str, tuple(sorted(options.items())))
            item = host.batcher.submit(model, key, inputs, call, continuation=True, solo=solo, tag=(self, rid))
        except Exception as exc:
            self.answer(rid, error_info(exc), None)
            return
        self.items[rid] = item

        def finished(future) -> None:
            self.items.pop(rid, None)
            if threading.current_thread() is host.device_thread:
                host.deliveries.put((self, rid, out_refs, future))  # the device goes on meanwhile
            else:  # withdrawn or refused off the device thread: nothing to write
                self.deliver(rid, out_refs, future)
                self.flush()

        item.future.add_done_callback(finished)

    def _stream_open(self, rid, model, in_ref, options) -> None:
        try:
            hm = self.host.models[model]
            latents = np.array(self.view.array(in_ref))  # the decode outlives the request's input block
            uint8 = options.get("uint8", False)
            if options.get("shards", 1) > 1:  # led here over the first N devices (service/shard_leader.py)
                if self.host.shard_leader is None:
                    raise ValueError(f"{self.host.spec.device} does not lead shard groups")
                frames = self.host.shard_leader.frames(hm, latents, options["shards"], uint8)
            else:
                frames = oom_recovery.frames(hm, latents, options.get("tiled"), uint8)
            steps = GeneratorSteps(frames)
        except Exception as exc:
            self.answer(rid, error_info(exc), None)
            return
        self.streams[rid] = (hm, steps, latents)
        self.answer(rid, None, rid)

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
        """The delivery thread: finished requests' outputs into their front ends' blocks and one
        answer message per front end for all that finished together, off the device thread (a
        batch of float32 images is megabytes to copy; the device runs the next batch meanwhile)."""
        deliveries = self.host.deliveries
        while True:
            touched = set()
            work = deliveries.get()
            while work is not None:
                link, rid, out_refs, future = work
                link.deliver(rid, out_refs, future)
                touched.add(link)
                try:
                    work = deliveries.get_nowait()
                except queue.Empty:
                    work = None
            for link in touched:
                link.flush()

    def _broadcast(self) -> None:
        desc = self.host.description()
        with self._links_lock:
            links = [link for link in self.links if not link.closed]
            self.links = links
        for link in links:
            link.send(("status", desc))

    def _started(self, batch) -> None:
        by_link: dict[FrontendLink, list[int]] = {}
        for item in batch:
            if item.tag is not None:
                by_link.setdefault(item.tag[0], []).append(item.tag[1])
        for link, rids in by_link.items():
            link.send(("started", rids))

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
            with self._links_lock:
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
            for key, _ in sel.select(PARENT_POLL_S):
                link = key.data
                if link is None:
                    self._wake_r.recv_bytes()
                    continue
                conn = link.conn
                try:
                    link.handle(conn.recv())
                    while conn.poll():  # what else has arrived, in one go
                        link.handle(conn.recv())
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
        # first: the supervisor counts a worker silent past the hang limit as hung (service/heartbeat.py)
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

