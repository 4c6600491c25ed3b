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
  go to the delivery thread in one hand-off and its answers to each front end in one DoneMany,
  which also names the requests whose calls began meanwhile (else a Started alone); a call with
  small outputs on a device that runs ahead is answered by the device thread itself (`_done`);
- keeps the stateful part of streamed decodes (the causal decoder's generator) between steps;
- beats (service/ipc/heartbeat.py): front ends and the supervisor tell it hung from busy by that.

Each front end's link (its arena, its requests) is service/worker/frontend_link.py's. The messages
(one type each, and their encoding) are service/ipc/worker_protocol.py's; a shard
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
from multiprocessing.connection import Listener


from .. import gc_pauses, threads
from ..ipc import shm
from ..ipc import worker_protocol as wp
from ..ipc.heartbeat import Beat, beat_path
from .frontend_link import FrontendLink
from .model_host import ModelHost, WorkerSpec

log = logging.getLogger("convserve.worker")


class _StartedBatch:
    """A batch whose model call began, on the delivery queue ahead of its results."""

    __slots__ = ("items",)

    def __init__(self, items):
        self.items = items


#: how often the worker checks that the process that started it is still there
PARENT_POLL_S = 0.5


class Worker:
    def __init__(self, spec: WorkerSpec):
        self.spec = spec
        self.host = ModelHost(spec)
        self.links: list[FrontendLink] = []
        self._links_lock = threading.Lock()
        self.stop = threading.Event()
        self.host.on_change = self._broadcast
        self.host.on_start = self._started
        self.host.on_done = self._done
        #: the device thread's own: the begun batches whose Started rides with their answers (_done)
        self._begun: list[_StartedBatch] = []
        # a new link wakes the I/O thread's wait with a byte here
        self._wake_r, self._wake_w = Pipe(duplex=False)

    def _deliver(self) -> None:
        """The delivery thread: what the device thread hands over (_done, _started), answered as
        soon as it is there; a drain of the queue answers all it found at once (_answer)."""
        deliveries = self.host.deliveries
        while True:
            entries = [deliveries.get()]
            while True:
                try:
                    entries.append(deliveries.get_nowait())
                except queue.Empty:
                    break
            self._answer(entries)

    def _answer(self, entries: list) -> None:
        """Finished model calls' outputs into their front ends' blocks, and one message per front
        end for all of `entries`: the answers of the calls that finished (DoneMany), and the
        requests whose calls began (its `started`, or a Started alone where nothing finished). A
        send is a syscall and a wake-up of the front end: with run-ahead, one call's start and the
        previous call's end meet in most drains. `entries`: batches of finished items and
        _StartedBatch-es, a batch's begun one ahead of its answers."""
        answers: dict[FrontendLink, list[wp.Done]] = {}
        started: dict[FrontendLink, list[int]] = {}
        for entry in entries:
            if isinstance(entry, _StartedBatch):
                for item in entry.items:
                    if item.tag is not None:
                        started.setdefault(item.tag[0], []).append(item.tag[1])
                continue
            for item in entry:
                link = item.tag[0]
                done = link.deliver(item)
                if done is not None:
                    answers.setdefault(link, []).append(done)
        for link, rids in started.items():
            if link not in answers:
                link.send(wp.Started(rids))
        for link, dones in answers.items():
            link.send(wp.DoneMany(dones, started.get(link, [])))

    def _inline(self, batch) -> bool:
        """A batched model call whose outputs are small (DELIVER_INLINE_BYTES), on a device that
        runs ahead: its answers are written and sent by the device thread itself, its Started with
        them. Only where the device runs ahead: there the call's answers follow its start by one
        short call (an encoder's); on a CPU a call takes the whole call's time, and its requests
        would count as waiting (the front end's queue admission) until they are answered."""
        first, settings = batch[0], self.host.settings
        if not settings.deliver_inline_bytes or first.solo or first.tag is None or not first.tag[2]:
            return False
        if not (settings.run_ahead and self.host.backend.runs_ahead):
            return False
        return sum(ref.nbytes for ref in first.tag[2].values()) * len(batch) <= settings.deliver_inline_bytes

    def _done(self, batch) -> None:
        """A model call's items, all resolved (the batcher's on_done, on the device thread).

        Large outputs (decoded images, frame groups) are copied by the delivery thread while the
        device runs the next batch. Small ones (an embedding a request) are answered here, with
        the Started of the calls begun since: handing them over cost more than the work (one H200,
        ConvNeXt-T one image a request, 2026-11-30: the delivery thread took 22-28 us of CPU a
        request for 2.5-3.6 us of its Python timed alone, benchmarks/analysis/worker_python_alone.py;
        its hand-offs and wake-ups, not its code). Started and Done of one request leave in that
        order either way: its batch's Started is held back only when its answers go from here too."""
        if self._inline(batch):
            begun, self._begun = self._begun, []
            self._answer([*begun, batch])
        else:
            self.host.deliveries.put(batch)

    def _broadcast(self) -> None:
        with self._links_lock:  # the state read and sent as one step against a link joining (_accept)
            desc = self.host.description()
            links = [link for link in self.links if not link.closed]
            self.links = links
            for link in links:
                link.send(desc)

    def _started(self, batch) -> None:
        """A model call began (the batcher's on_start, on the device thread): each front end's
        Started goes out from the delivery thread, behind no device work (sent from here, one per
        front end a batch, they took 16 % of the device thread's samples under one-image requests;
        one H200, 2026-11-29, py-spy), or with the next answers this thread sends itself (_done),
        where this call's answers go that way too."""
        if self._inline(batch):
            self._begun.append(_StartedBatch(batch))
        else:
            self.host.deliveries.put(_StartedBatch(batch))

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
        joined = True  # links join only in _accept, which then wakes this wait: looked for only then
        while not self.stop.is_set():
            if joined:
                with self._links_lock:
                    links = [link for link in self.links if not link.closed]
                for link in set(links) - watched:
                    sel.register(link.conn, selectors.EVENT_READ, link)
                    watched.add(link)
                joined = False
            shm.sweep()  # released arenas that a batch still viewed, once it is done
            ready = sel.select(PARENT_POLL_S)
            self.host.tally.publish(force=not ready)  # now and then, and when idle
            for key, _ in ready:
                link = key.data
                if link is None:
                    self._wake_r.recv_bytes()
                    joined = True
                    continue
                conn = link.conn
                try:
                    link.handle(wp.recv(conn))
                    while link.has_more():  # what else has arrived, in one go
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
        threads.start(self._accept, "convserve-accept", (listener,))
        threads.start(self._serve_links, "convserve-links")
        threads.start(self._deliver, "convserve-deliver")
        threads.start(self.host.load, "convserve-loader")
        try:
            while not self.stop.wait(PARENT_POLL_S):
                if os.getppid() != self.spec.parent_pid:  # orphaned: the server is gone
                    log.warning("%s: the server process is gone; exiting", self.spec.device)
                    break
        finally:
            listener.close()
            if self.host.jpeg_stage is not None:  # its queued files are not decoded: the process ends
                self.host.jpeg_stage.stop()
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
    # its own core (PIN_WORKERS), before its threads start: each takes its creator's CPUs
    pinned = bool(spec.cpus) and threads.pin_process(spec.cpus)
    logging.basicConfig(level=spec.settings.log_level.upper(),
                        format=f"%(asctime)s %(levelname)s %(name)s[{spec.device}]: %(message)s")
    if spec.cpus and not pinned:
        log.warning("%s: could not pin to cores %s; running unpinned", spec.device, spec.cpus)
    # the device thread and the I/O thread share the interpreter lock: a short switch interval
    # keeps the device thread from waiting up to 5 ms to launch the next batch
    sys.setswitchinterval(0.001)
    gc_pauses.watch("worker")  # the start-up heap is frozen once the models are loaded (ModelHost.load)
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

