"""A model worker's answers to small batched calls (service/worker/model_worker.py `_done`): on a
device that runs ahead, a call whose outputs are small is answered by the device thread itself,
its Started riding with its answers; larger outputs, a worker that does not run ahead, and
DELIVER_INLINE_BYTES=0 hand the call to the delivery thread. Either way each request is said
started exactly once and never after its Done, also with one call begun before the previous one's
answers (run-ahead). The worker's own methods, driven as its batcher drives them; its front ends
are recorders."""
from __future__ import annotations

import os

import numpy as np

from service.ipc import worker_protocol as wp
from service.ipc.shm import TensorRef
from service.settings import Settings
from service.worker.model_host import WorkerSpec
from service.worker.model_worker import Worker, _StartedBatch
from service.worker.work_item import WorkItem

EMBED = TensorRef(0, (1, 768), "float32")  # 3 KB a request
IMAGE = TensorRef(0, (1, 512, 512, 3), "float32")  # 3 MB a request


class FrontEnd:
    """A link's two calls the worker makes: deliver (its outputs written: here, its Done) and send."""

    def __init__(self):
        self.sent: list = []

    def deliver(self, item):
        return wp.Done(item.tag[1])

    def send(self, msg):
        self.sent.append(msg)


def worker(runs_ahead: bool = True, **settings) -> Worker:
    w = Worker(WorkerSpec("cuda:0", None, "/nonexistent.sock", Settings(**settings), os.getpid()))
    w.host.backend = type("Backend", (), {"runs_ahead": runs_ahead})()
    return w


def batch(link: FrontEnd, rids, out=EMBED) -> list[WorkItem]:
    items = [WorkItem("m", "key", np.zeros((1, 3), np.uint8), None, tag=(link, rid, {"embedding": out})) for rid in rids]
    for it in items:
        it.started = True
    return items


def said(link: FrontEnd) -> list[tuple[str, int]]:
    """The order in which a front end heard of each rid: started, then done."""
    out = []
    for msg in link.sent:
        out += [("started", rid) for rid in (msg.rids if isinstance(msg, wp.Started) else msg.started)]
        out += [("done", d.rid) for d in getattr(msg, "answers", [])]
    return out


def queued(w: Worker) -> list:
    out = []
    while not w.host.deliveries.empty():
        out.append(w.host.deliveries.get_nowait())
    return out


def test_small_calls_run_ahead_are_answered_from_the_device_thread_each_started_first():
    w, fe = worker(), FrontEnd()
    first, second = batch(fe, [1, 2, 3]), batch(fe, [4, 5])
    w._started(first)
    w._started(second)  # run-ahead: the next call begins before the first's answers
    w._done(first)
    w._done(second)
    assert queued(w) == []  # nothing handed to the delivery thread
    assert [type(m) for m in fe.sent] == [wp.DoneMany, wp.DoneMany]  # one message a call
    order = said(fe)
    assert sorted(rid for kind, rid in order if kind == "started") == [1, 2, 3, 4, 5]  # each once
    for rid in range(1, 6):
        assert order.index(("started", rid)) < order.index(("done", rid))


def test_large_outputs_a_worker_that_does_not_run_ahead_and_zero_go_to_the_delivery_thread():
    for w, out in ((worker(), IMAGE), (worker(runs_ahead=False), EMBED), (worker(deliver_inline_bytes=0), EMBED)):
        fe = FrontEnd()
        items = batch(fe, [7, 8], out)
        w._started(items)
        w._done(items)
        assert fe.sent == []  # the device thread sent nothing
        entries = queued(w)
        assert isinstance(entries[0], _StartedBatch) and entries[1] is items
        w._answer(entries)  # what the delivery thread does with them
        assert said(fe) == [("started", 7), ("started", 8), ("done", 7), ("done", 8)]


def test_a_large_call_between_small_ones_keeps_every_request_started_before_done():
    w, fe = worker(), FrontEnd()
    small1, large, small2 = batch(fe, [1]), batch(fe, [2], IMAGE), batch(fe, [3])
    w._started(small1)
    w._started(large)
    w._done(small1)
    w._started(small2)
    w._done(large)
    w._done(small2)
    w._answer(queued(w))  # the delivery thread's share, sent last: the worst order for it
    order = said(fe)
    assert sorted(rid for kind, rid in order if kind == "started") == [1, 2, 3]
    for rid in (1, 2, 3):
        assert order.index(("started", rid)) < order.index(("done", rid))
