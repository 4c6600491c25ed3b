"""Where a request's input lies, read once (service/worker/frontend_link.py, WorkItem.host_address)
and used by the CUDA backend's gather (convkernels/backends/cuda/transfer.py gather_rows) instead
of `ndarray.ctypes` a row: a front end's real hello and arena over a real socket pair, and the
gather's DMAs recorded by a stand-in for CuPy's runtime (the DMAs themselves are checked on a GPU:
tests/gpu/test_convnext_started_gpu.py and the service's GPU tests)."""
from __future__ import annotations

import io
import os
import threading
from multiprocessing import Pipe
from multiprocessing.reduction import send_handle
from types import SimpleNamespace

import numpy as np

from convkernels.backends.cuda.transfer import PinnedRegion, gather_rows
from service.ipc import worker_protocol as wp
from service.ipc.shm import Arena
from service.worker.frontend_link import FrontendLink
from service.worker.work_item import WorkItem


class Queue:
    """The batcher's place: keeps what it is given."""

    def __init__(self):
        self.items = []

    def submit_many(self, items):
        self.items.extend(items)

    def cancel(self, item):
        return True


def host() -> SimpleNamespace:
    def call_for(hm, op, options):
        return lambda x: x

    return SimpleNamespace(tally=SimpleNamespace(count=lambda n: None), batcher=Queue(), models={"m": object()},
                           call_for=call_for, jpeg_stage=None, shard_member=SimpleNamespace(link_closed=lambda link: None))


def linked(arena: Arena) -> FrontendLink:
    """A worker's link to a front end, through the real hello and descriptor passing."""
    worker_end, frontend_end = Pipe()
    link = FrontendLink(host(), worker_end)
    wp.send(frontend_end, wp.Hello(os.getpid(), arena.size))
    send_handle(frontend_end, arena.fd, os.getpid())
    link.handshake()
    frontend_end.close()
    return link


def test_an_items_input_address_is_its_blocks_own():
    arena = Arena(8 << 20)
    link = linked(arena)
    try:
        refs = [arena.reserve((1, 37, 29, 3), np.uint8) for _ in range(5)]  # odd sizes: blocks at odd offsets
        subs = [wp.Submit(rid, "m", "encode", wp.Options(), ref, {"embedding": arena.reserve((1, 7), np.float32)})
                for rid, ref in enumerate(refs)]
        link.handle(wp.decode(wp.encode(wp.SubmitMany(subs))))
        items = link.host.batcher.items
        assert len(items) == 5 and len({it.host_address for it in items}) == 5
        for item in items:
            assert item.host_address == item.inputs.ctypes.data != 0
    finally:
        link.close()
        arena.close()


class Runtime:
    """CuPy's runtime as gather_rows and PinnedRegion use it; the DMAs queued are recorded."""
    memcpyHostToDevice = 1

    def __init__(self):
        self.copies = []

    def hostRegister(self, address, nbytes, flags):
        pass

    def hostUnregister(self, address):
        pass

    def memcpyAsync(self, dst, src, n, kind, stream):
        self.copies.append((dst, src, n))


def fake_cupy(runtime: Runtime) -> SimpleNamespace:
    class Event:
        def __init__(self, **_):
            pass

        def record(self, stream):
            pass

        def synchronize(self):
            pass

    def empty(shape, dtype):
        return SimpleNamespace(shape=shape, data=SimpleNamespace(ptr=1 << 40))

    cuda = SimpleNamespace(runtime=runtime, Event=Event, get_current_stream=lambda: SimpleNamespace(ptr=0))
    return SimpleNamespace(cuda=cuda, empty=empty)


def test_the_gather_reads_each_part_from_the_address_given_else_from_the_array():
    pool = np.zeros(1 << 16, np.uint8)
    base = pool.ctypes.data
    parts = [pool[o:o + 3 * 5 * 7].reshape(1, 3, 5, 7) for o in (64, 1024, 4096 + 3)]
    runtime = Runtime()
    cp = fake_cupy(runtime)
    region = PinnedRegion(cp, base, pool.nbytes)
    regions = [region] * 3
    # given (the first two) or not known (0: read from the array)
    dev = gather_rows(cp, parts, regions, [base + 64, base + 1024, 0])
    assert dev.shape == (3, 3, 5, 7)
    assert [c[1:] for c in runtime.copies] == [(base + 64, 105), (base + 1024, 105), (base + 4096 + 3, 105)]
    assert [c[0] for c in runtime.copies] == [(1 << 40) + 105 * i for i in range(3)]  # one after another
    # no addresses at all: each read from its array
    runtime.copies.clear()
    gather_rows(cp, parts, regions)
    assert [c[1] for c in runtime.copies] == [p.ctypes.data for p in parts]
    # a given address is checked against the region like a read one: outside it, nothing is queued
    runtime.copies.clear()
    assert gather_rows(cp, parts, regions, [base + 64, base + pool.nbytes, 0]) is None and not runtime.copies


def test_a_swapped_input_forgets_its_address():
    """The JPEG stage swaps a file's row for its decoded pixels (JPEG_DECODE=worker without hardware
    engines: PIL's, on the host): the address the file's block had is not the pixels'."""
    from PIL import Image

    from service.worker.jpeg_bodies import JpegBodies
    from service.worker.jpeg_stage import JpegStage

    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (16, 16, 3), np.uint8)).save(buf, "JPEG")
    body = np.frombuffer(buf.getvalue(), np.uint8)[None]
    item = WorkItem("m", ("m", "encode_jpeg", (), "|u1", wp.Options()), body, None, host_address=body.ctypes.data)
    item.call = SimpleNamespace(jpeg_size=16, decoded=lambda x: x)
    got, done = [], threading.Event()

    def submit(items):
        got.extend(items)
        done.set()

    stage = JpegStage(JpegBodies(None, "cpu"), submit=submit, deliver=lambda items: done.set(), max_batch=4, name="t")
    try:
        stage.submit([item])
        assert done.wait(30) and got == [item], item.outcome.done() and item.outcome.exception()
        assert isinstance(item.inputs, np.ndarray) and item.inputs.shape == (1, 16, 16, 3)
        assert item.host_address == 0
    finally:
        stage.stop()
