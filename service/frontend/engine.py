"""A front end's view of the model workers (one per device, service/worker/model_worker.py): the links
to them, which one runs a request, and the arena blocks a request's tensors travel in.

Each link is a Unix-socket connection to one worker, kept by a thread of its own: it connects (again,
after a worker restarts), hands over the arena's descriptor, then reads the worker's messages and
passes them to the event loop. The event loop does the rest: submitting, settling, bookkeeping.

Dispatch: a request goes to the ready worker serving its model with the fewest rows outstanding
from this front end (ties in turn); the worker batches what every front end sends it.

Bulk submission: the Submits one turn of the event loop makes for a worker wait in its link's
outbox and go as one message (a SubmitMany when there are several) from a callback queued with
`call_soon`: it runs at the end of that turn, so a lone request is never held back by a timer,
and under load the worker pays its per-message costs (a read, a decode, a wake-up of its device
thread) once for many requests. Any other message to that worker first sends the outbox, so a
Cancel or StreamClose never overtakes the Submit it concerns. `bulk=False` sends each Submit alone
(CONVSERVE_BULK_SUBMIT=0: a switch for measuring the difference).

Block lifetime (the rule of service/ipc/shm.py): service/frontend/submission.py; a request answered before
its worker (timeout, client gone, worker unresponsive) keeps its blocks until the worker answers.

Liveness (service/ipc/heartbeat.py): every CHECK_S the event loop reads each worker's heartbeat; a
worker silent past CONVSERVE_WORKER_HEARTBEAT_S is unresponsive: its link is not ready (no new
work; another device's worker takes the model's requests, else they get 503
`worker-unresponsive`), and its requests in flight are answered so at once and withdrawn. It is
ready again when it beats again; one hung past the hang limit is the supervisor's to kill."""
from __future__ import annotations

import asyncio
import itertools
import logging
import os
import threading
import time
from multiprocessing.connection import Client, Connection
from multiprocessing.reduction import send_handle
from typing import Any

from .. import threads
from ..hosted_model import HostedModel
from ..ipc import worker_protocol as wp
from ..ipc.heartbeat import BeatReader, beat_path
from ..ipc.readable import Readable
from ..ipc.shm import Arena, TensorRef
from .submission import Lease, NoWorker, Submission, WorkerFailure

__all__ = ["Engine", "Lease", "Link", "NoWorker", "Submission", "WorkerFailure"]

log = logging.getLogger("convserve.engine")

#: how often a link to a worker that is not (yet, or no longer) there tries again
RECONNECT_S = 0.1
#: how often the event loop reads the workers' heartbeats
CHECK_S = 0.25


class Link:
    """The front end's connection to one worker."""

    def __init__(self, device: str, address: str):
        self.device, self.address = device, address
        self.beat = BeatReader(beat_path(address))
        #: why the worker counts as unresponsive (its heartbeat is late), or None
        self.unresponsive: str | None = None
        self.conn: Connection | None = None
        self.desc = wp.Status(device, "connecting")  # its worker's last Status
        self.pending: dict[int, Submission] = {}
        #: Submits of this turn of the event loop, sent together at its end (Engine._flush)
        self.outbox: list[tuple[Submission, wp.Submit]] = []
        self.rows = 0
        self.row_seconds = 0.0

    @property
    def ready(self) -> bool:
        return self.conn is not None and self.desc.state == "ready" and not self.unresponsive

    def serves(self, model: str) -> bool:
        return self.ready and model in self.desc.models


class Engine:
    def __init__(self, endpoints: list[tuple[str, str]], arena: Arena, heartbeat_s: float = 3.0, bulk: bool = True):
        self.arena, self.heartbeat_s, self.bulk = arena, heartbeat_s, bulk
        self.links = [Link(device, address) for device, address in endpoints]
        self._rid = itertools.count(1)
        self._turn = itertools.count()
        self._closing = threading.Event()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.models: dict[str, HostedModel] = {}
        #: admitted requests whose rows have not started on a device (the queue admission bounds)
        self.waiting = 0
        self._ready = False

    # ---- lifecycle -------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        for link in self.links:
            threads.start(self._keep, f"convserve-link-{link.device}", (link,))
        self._check_beats()

    def close(self) -> None:
        self._closing.set()
        for link in self.links:
            if link.conn is not None:
                try:
                    link.conn.close()
                except OSError:
                    pass

    # ---- the state the routes read ----------------------------------------------------------------
    @property
    def ready(self) -> bool:
        """A ready worker for the service, and one for every model any worker serves (worked
        out when a worker's state changes: every request asks)."""
        return self._ready

    def unready(self) -> tuple[str, str]:
        """Why the service is not ready: (problem kind, detail)."""
        late = [link.unresponsive for link in self.links if link.unresponsive]
        return ("worker-unresponsive", "; ".join(late)) if late else ("not-ready", "models are still loading")

    def _update_ready(self) -> None:
        self._ready = any(link.ready for link in self.links) and all(
            any(link.serves(name) for link in self.links) for name in self.models)

    @property
    def load_error(self) -> str | None:
        errors = [f"{link.device}: {link.desc.load_error}" for link in self.links if link.desc.load_error]
        return "; ".join(errors) or None

    @property
    def failed(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for link in self.links:
            out.update(link.desc.failed)
        return out

    @property
    def backend_name(self) -> str | None:
        for link in self.links:
            if link.desc.backend:
                return link.desc.backend
        return None

    @property
    def shard_offered(self) -> str:
        """The families a sharded decode is offered for, as the workers say (models.sharding.OFFERED)."""
        return next((link.desc.shard_offered for link in self.links if link.desc.shard_offered), "")

    def devices(self, model: str | None = None) -> list[dict]:
        """Every device and its worker's state (the card and /v1/models show it)."""
        return [{"device": link.device, "state": "down" if link.conn is None else
                 "unresponsive" if link.unresponsive else link.desc.state,
                 "gpu": link.desc.gpu, "pid": link.desc.pid, "rows_outstanding": link.rows}
                for link in self.links if model is None or model in link.desc.models]

    def row_seconds(self) -> float:
        speeds = [link.row_seconds for link in self.links if link.ready and link.row_seconds > 0]
        return min(speeds) / len(speeds) if speeds else 0.0

    # ---- requests ----------------------------------------------------------------------------------
    @property
    def device_count(self) -> int:
        return len(self.links)

    def shard_leader(self, model: str, shards: int) -> Link:
        """The link a `shards`-device decode goes to: the first device's worker, which leads the
        first `shards` devices (service/worker/shard_leader.py); NoWorker unless all of them are ready."""
        group = self.links[:shards]
        if len(group) < shards or not all(link.serves(model) for link in group):
            raise NoWorker()
        return group[0]

    def _pick(self, model: str) -> Link:
        live = [link for link in self.links if link.serves(model)]
        if not live:
            late = [link.unresponsive for link in self.links if link.unresponsive and model in link.desc.models]
            raise NoWorker("worker-unresponsive", "; ".join(late)) if late else NoWorker()
        least = min(link.rows for link in live)
        ties = [link for link in live if link.rows == least]
        return ties[next(self._turn) % len(ties)]

    def jpeg_link(self, model: str) -> Link | None:
        """The worker an encode's JPEG file goes to undecoded (its Status lists the model in jpeg_models),
        picked as submit picks; None: the front end decodes it (or no worker is up, as submit will say)."""
        link = self._pick(model) if any(link.serves(model) for link in self.links) else None
        return link if link is not None and model in link.desc.jpeg_models else None

    def _send(self, link: Link, sub: Submission | None, msg: wp.Message) -> None:
        if sub is not None:
            link.pending[sub.rid] = sub
            link.rows += sub.rows
        if link.outbox:  # what this turn submitted goes first: a Cancel never overtakes its Submit
            self._flush(link)
        self._write(link, [sub] if sub is not None else [], msg)

    def _post(self, link: Link, sub: Submission, msg: wp.Submit) -> None:
        """A Submit into the link's outbox, sent with the rest of this turn's at its end."""
        if not self.bulk:
            return self._send(link, sub, msg)
        link.pending[sub.rid] = sub
        link.rows += sub.rows
        link.outbox.append((sub, msg))
        if len(link.outbox) == 1:
            self.loop.call_soon(self._flush, link)

    def _flush(self, link: Link) -> None:
        batch, link.outbox = link.outbox, []
        if len(batch) == 1:
            self._write(link, [batch[0][0]], batch[0][1])
        elif batch:
            self._write(link, [sub for sub, _ in batch], wp.SubmitMany([msg for _, msg in batch]))

    def _write(self, link: Link, subs: list[Submission], msg: wp.Message) -> None:
        try:
            wp.send(link.conn, msg)
        except (OSError, AttributeError, ValueError) as exc:
            for sub in subs:
                self._forget(link, sub)
                sub.settle(wp.WorkerError("worker-died", f"the worker of {link.device} is gone ({exc})"))

    def _forget(self, link: Link, sub: Submission) -> None:
        if link.pending.pop(sub.rid, None) is not None:
            link.rows -= sub.rows
            if not sub.started:
                self.waiting -= 1

    def submit(self, lease: Lease, model: str, op: str, options: wp.Options, in_ref: TensorRef | None, rows: int,
               outputs: dict[str, tuple[tuple[int, ...], Any]], *, link: Link | None = None) -> Submission:
        """Reserve the `outputs` (name -> (shape, dtype)) and send the request, whose inputs are
        the arena block `in_ref`, to a worker; the submission (in `lease`, which now owns the
        blocks) resolves when the worker answers. Raises NoWorker, or shm.ArenaFull / TooLarge,
        with nothing held then but `in_ref` (the caller's)."""
        link = link or self._pick(model)
        if link.unresponsive:  # a stream's or shard group's own worker
            raise NoWorker("worker-unresponsive", link.unresponsive)
        out_refs: dict[str, TensorRef] = {}
        try:
            for name, (shape, dtype) in outputs.items():
                out_refs[name] = self.arena.reserve(shape, dtype)
        except BaseException:
            for ref in out_refs.values():
                self.arena.free(ref.offset)
            raise
        offsets = ([in_ref.offset] if in_ref is not None else []) + [r.offset for r in out_refs.values()]
        sub = Submission(self.arena, link, next(self._rid), rows, offsets, out_refs)
        lease.submissions.append(sub)
        self.waiting += 1
        self._post(link, sub, wp.Submit(sub.rid, model, op, options, in_ref, out_refs))
        return sub

    def cancel(self, sub: Submission) -> None:
        if not sub.settled and sub.link.conn is not None:
            self._send(sub.link, None, wp.Cancel(sub.rid))

    def request(self, link: Link, what: str) -> Submission:
        """A query: its answer names no blocks."""
        sub = Submission(self.arena, link, next(self._rid), 0, [], {})
        sub.started = True
        sub.released = True
        self._send(link, sub, wp.Query(sub.rid, what))
        return sub

    def close_stream(self, link: Link, stream_id: int) -> None:
        """End a streamed decode (no answer; lost with its worker, which ends its streams itself)."""
        self._send(link, None, wp.StreamClose(stream_id))

    async def query(self, what: str) -> list[tuple[Link, Any]]:
        """`what` from every ready worker, in device order (a worker that fails is left out)."""
        subs = [(link, self.request(link, what)) for link in self.links if link.ready]
        out = []
        for link, sub in subs:
            try:
                out.append((link, await asyncio.wait_for(sub.future, 30)))
            except (WorkerFailure, asyncio.TimeoutError) as exc:
                log.warning("query %s of %s failed: %s", what, link.device, exc)
        return out

    # ---- messages from the workers (on the event loop) ------------------------------------------
    def _on_messages(self, link: Link, msgs: list[wp.Message]) -> None:
        for msg in msgs:
            match msg:
                case wp.DoneMany(answers, started):  # a batch's answers to this front end
                    self._started(link, started)  # the calls begun meanwhile
                    for done in answers:
                        self._done(link, done.rid, done.error, done.stream)
                case wp.Done(rid, error, stream):
                    self._done(link, rid, error, stream)
                case wp.Started(rids):
                    self._started(link, rids)
                case wp.Status():
                    self._on_status(link, msg)
                case wp.KernelsAnswer(rid, doc):
                    self._done(link, rid, None, doc)
                case wp.StatsAnswer(rid, records):
                    self._done(link, rid, None, records)
                case _:
                    log.warning("worker %s sent a %s, which no front end expects", link.device, type(msg).__name__)

    def _started(self, link: Link, rids: list[int]) -> None:
        for sub in filter(None, map(link.pending.get, rids)):  # their calls began: no longer waiting
            if not sub.started:
                sub.started, self.waiting = True, self.waiting - 1

    def _done(self, link: Link, rid: int, error: wp.WorkerError | None, payload) -> None:
        sub = link.pending.get(rid)
        if sub is not None:
            self._forget(link, sub)
            sub.settle(error, payload)

    def _on_status(self, link: Link, status: wp.Status) -> None:
        link.desc = status
        link.row_seconds = status.row_seconds
        for name, m in status.models.items():
            if name not in self.models:
                self.models[name] = HostedModel(m.entry, m.view, m.load_seconds, m.warmup_seconds, dict(m.extra))
        self._update_ready()
        log.info("worker %s (pid %s): %s", link.device, status.pid, status.state)

    def _check_beats(self) -> None:
        """Each worker's heartbeat (on the event loop, every CHECK_S): unresponsive or back."""
        if self._closing.is_set():
            return
        now = time.monotonic()
        for link in self.links:
            # only a ready worker is judged: one loading its models is not ready anyway, and
            # its warm-up's compiles may hold the interpreter lock for seconds
            judged = link.conn is not None and link.desc.state == "ready"
            silent = link.beat.unresponsive(now, self.heartbeat_s) if judged else 0.0
            if silent > self.heartbeat_s and not link.unresponsive:
                self._went_silent(link, silent)
            elif not silent and link.unresponsive:
                log.warning("worker %s answers again", link.device)
                link.unresponsive = None
                self._update_ready()
        self.loop.call_later(CHECK_S, self._check_beats)

    def _went_silent(self, link: Link, silent: float) -> None:
        link.unresponsive = (f"the model worker of {link.device} is unresponsive (no heartbeat for {silent:.1f}s); "
                             "it is restarted if it stays hung")
        self._update_ready()
        log.warning("%s, %d request(s) in flight", link.unresponsive, len(link.pending))
        for sub in list(link.pending.values()):
            if not sub.started:  # no longer waiting: out of the queue admission bounds
                sub.started = True
                self.waiting -= 1
            sub.fail(wp.WorkerError("worker-unresponsive", link.unresponsive))
            self.cancel(sub)  # should it wake, it drops the work; its answer then frees the blocks

    def _on_lost(self, link: Link, why: str) -> None:
        link.conn = None
        link.outbox = []  # its submissions are in `pending`, answered below
        link.unresponsive = None
        link.desc = link.desc.down()
        self._update_ready()
        lost = list(link.pending.values())
        for sub in lost:
            self._forget(link, sub)
            sub.settle(wp.WorkerError("worker-died",
                                      f"the model worker of {link.device} stopped ({why}); it is being restarted"))
        if lost:
            log.warning("worker %s lost with %d request(s) in flight: %s", link.device, len(lost), why)

    # ---- the link's thread ----------------------------------------------------------------------
    def _keep(self, link: Link) -> None:
        while not self._closing.is_set():
            try:
                conn = Client(link.address, family="AF_UNIX")
            except (FileNotFoundError, ConnectionRefusedError, OSError):
                time.sleep(RECONNECT_S)
                continue
            why = "connection closed"
            try:
                wp.send(conn, wp.Hello(os.getpid(), self.arena.size))
                send_handle(conn, self.arena.fd, 0)
                first = wp.recv(conn)
                self.loop.call_soon_threadsafe(self._connected, link, conn, first)
                more = Readable(conn)
                while True:
                    msgs = [wp.recv(conn)]
                    while more():  # hand over what has arrived in one go
                        msgs.append(wp.recv(conn))
                    self.loop.call_soon_threadsafe(self._on_messages, link, msgs)
            except (EOFError, OSError, wp.ProtocolError) as exc:  # a message that breaks the protocol: reconnect
                why = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
            except RuntimeError:  # the event loop closed under us: the server is stopping
                return
            finally:
                conn.close()
            if self._closing.is_set():
                return
            try:
                self.loop.call_soon_threadsafe(self._on_lost, link, why)
            except RuntimeError:
                return
            time.sleep(RECONNECT_S)

    def _connected(self, link: Link, conn: Connection, status: wp.Message) -> None:
        link.conn = conn
        self._on_messages(link, [status])  # its status message updates readiness
