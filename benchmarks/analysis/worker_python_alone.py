"""The model worker's own Python a request, timed alone: what each of its threads does for one
one-image request when nothing else runs beside it. Set against the same threads' CPU a request
under load (`benchmarks/service/service_throughput.py` prints it by thread), it tells how much of the worker's cost is
its Python and how much is running that Python beside other threads and processes.

    python benchmarks/analysis/worker_python_alone.py [--requests-per-message 5] [--messages 3000]

- links: a SubmitMany's decode and FrontendLink.handle (each Submit checked, its input block viewed,
  its work item made and queued), the queue a stand-in that keeps the items;
- deliver: FrontendLink.deliver of each finished item (its 768 float32 embedding written into its
  output block, its Done) and the DoneMany encoded;
- batcher: the real Batcher's threads with a model call that returns its input (queueing, batching,
  the split, the outcomes), the submitter keeping 256 requests in flight, 5 a message; the device
  thread's CPU a request (/proc), the stacking of the rows included (a GPU worker gathers them on the
  device instead).
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from service.ipc import worker_protocol as wp  # noqa: E402
from service.ipc.shm import Arena, ArenaView  # noqa: E402
from service.worker.batcher import Batcher  # noqa: E402
from service.worker.frontend_link import FrontendLink  # noqa: E402
from service.worker.work_item import WorkItem  # noqa: E402

EMBED = 768


class _Queue:
    """The batcher's place: keeps what it is given."""

    def __init__(self):
        self.items = []

    def submit_many(self, items):
        self.items.extend(items)


def _host():
    def call_for(hm, op, options):
        call = lambda x: x  # noqa: E731 - carries an attribute, as the worker's calls do
        call.device_input = False
        return call

    return type("Host", (), {"tally": type("T", (), {"count": lambda self, n: None})(), "batcher": _Queue(),
                             "models": {"m": object()}, "call_for": staticmethod(call_for), "jpeg_stage": None})()


def _link(arena: Arena) -> FrontendLink:
    link = FrontendLink.__new__(FrontendLink)  # no connection: messages are handed in directly
    link.host, link.view, link.items, link.streams = _host(), ArenaView(os.dup(arena.fd), arena.size), {}, {}
    link.base = link.view.address
    link.closed, link.leader, link._send_lock = False, False, threading.Lock()
    link.conn = type("Conn", (), {"send_bytes": lambda self, b: None})()
    return link


def _thread_cpu(tid: int) -> float:
    fields = Path(f"/proc/self/task/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def batcher_cpu(requests: int, per_message: int, in_flight: int = 256) -> float:
    """The device thread's CPU a request, us, running a model call that returns its input."""
    room, done, count = threading.Semaphore(in_flight), threading.Event(), [0]

    def on_done(batch):
        count[0] += len(batch)
        for _ in batch:
            room.release()
        if count[0] >= requests:
            done.set()

    b = Batcher(max_batch=32, max_queue_delay_ms=2, on_done=on_done, on_start=lambda batch: None)
    x = np.zeros((1, EMBED), np.float32)
    items = [WorkItem("m", "k", x, lambda inputs: inputs) for _ in range(requests)]
    before = _thread_cpu(b.thread.native_id)
    for i in range(0, requests, per_message):
        for _ in range(per_message):
            room.acquire()
        b.submit_many(items[i:i + per_message])
    assert done.wait(300), "the batcher did not finish"
    spent = _thread_cpu(b.thread.native_id) - before
    b.stop()
    return spent / requests * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests-per-message", type=int, default=5)
    ap.add_argument("--messages", type=int, default=3000)
    args = ap.parse_args()
    k, n = args.requests_per_message, args.messages
    arena = Arena(64 << 20)
    link = _link(arena)
    subs = [wp.Submit(rid, "m", "encode", wp.Options(), arena.reserve((1, 224, 224, 3), np.uint8),
                      {"embedding": arena.reserve((1, EMBED), np.float32)}) for rid in range(k)]
    frame = wp.encode(wp.SubmitMany(subs))
    t0 = time.thread_time()
    for _ in range(n):
        link.handle(wp.decode(frame))
        link.items.clear()
        link.host.batcher.items.clear()
    links_us = (time.thread_time() - t0) / (n * k) * 1e6
    link.handle(wp.decode(frame))
    items, rows = list(link.host.batcher.items), np.random.default_rng(0).random((k, EMBED), dtype=np.float32)
    for i, item in enumerate(items):
        item.outcome.set({"embedding": rows[i:i + 1]})
    t0 = time.thread_time()
    for _ in range(n):
        wp.encode(wp.DoneMany([link.deliver(item) for item in items], []))
    deliver_us = (time.thread_time() - t0) / (n * k) * 1e6
    from benchmarks.machine import describe_machine
    print(f"machine: {describe_machine()}")
    print(f"{k} requests a message, one 224x224 uint8 image each, {n} messages; CPU a request, us, alone:")
    print(f"links {links_us:.2f}; deliver {deliver_us:.2f}; batcher (device thread, no model) "
          f"{batcher_cpu(max(n * k, 20000), k):.2f}")


if __name__ == "__main__":
    main()
