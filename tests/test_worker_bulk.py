"""Requests sent to a model worker in bulk (service/ipc/worker_protocol.py's SubmitMany): under
concurrent load a front end's requests travel several to a message, and each is still answered
with its own result; inside one bulk message a bad submission fails alone and a cancelled one is
withdrawn alone. Real processes throughout: a live server, and for the message-level cases a front
end of the test's own on that server's worker socket (its own arena, the real protocol)."""
from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import tempfile
import time
from multiprocessing.connection import Client
from multiprocessing.reduction import send_handle
from pathlib import Path

import httpx
import numpy as np
import pytest

from live_server import from_npy, metric_sum, npy, scrape, start_server
from service.hosted_model import HostedModel
from service.ipc import worker_protocol as wp
from service.ipc.shm import Arena

MODEL = "tiny-convnext"
HOLD = 4242.0  # an image holding this value keeps the worker busy until the release file exists
SIDE = 32


@pytest.fixture(scope="module")
def server():
    """One front end, one worker; its run directory (and so the worker's socket) under a short
    temporary folder of this module's (a Unix socket's path has at most ~107 bytes)."""
    tmp = Path(tempfile.mkdtemp(prefix="cvb-"))
    release = tmp / "release"
    srv = start_server(tmp, env_extra={"TMPDIR": str(tmp)}, models=MODEL, workers=1, max_batch=8,
                       max_queue_delay_ms=20, max_queue=256, fault_hold_value=HOLD, fault_hold_release_file=release)
    sockets = glob.glob(str(tmp / "convserve-run-*" / "worker-0.sock"))
    assert len(sockets) == 1, sockets
    yield srv, sockets[0], release
    srv.stop()
    shutil.rmtree(tmp, ignore_errors=True)


def images(n: int, seed: int) -> list[np.ndarray]:
    """Distinct float pixels in [0, 1], one image each (1,S,S,3)."""
    rng = np.random.default_rng(seed)
    return [rng.random((1, SIDE, SIDE, 3), dtype=np.float32) for _ in range(n)]


class OwnFrontEnd:
    """A front end of the test's own: an arena, a hello, then raw protocol messages."""

    def __init__(self, address: str):
        self.arena = Arena(64 << 20)
        self.conn = Client(address, family="AF_UNIX")
        wp.send(self.conn, wp.Hello(os.getpid(), self.arena.size))
        send_handle(self.conn, self.arena.fd, 0)
        status = wp.recv(self.conn)
        m = status.models[MODEL]
        self.hm = HostedModel(m.entry, m.view, m.load_seconds, m.warmup_seconds, dict(m.extra))
        self.rid = 1000
        self.outputs: dict[int, dict] = {}

    def submit(self, pixels: np.ndarray, *, model: str = MODEL, op: str = "encode", in_ref=None) -> wp.Submit:
        self.rid += 1
        if in_ref is None:
            in_ref = self.arena.reserve(pixels.shape, pixels.dtype)
            self.arena.array(in_ref)[...] = pixels
        outs = {name: self.arena.reserve(shape, dtype) for name, (shape, dtype) in self.hm.encoder_outputs(1).items()}
        self.outputs[self.rid] = outs
        return wp.Submit(self.rid, model, op, wp.Options(), in_ref, outs)

    def answers(self, rids: set[int], timeout: float = 60.0) -> dict[int, wp.Done]:
        """Each rid's Done (Status and Started messages passed over)."""
        got: dict[int, wp.Done] = {}
        deadline = time.monotonic() + timeout
        while rids - set(got):
            assert self.conn.poll(max(0.0, deadline - time.monotonic())), f"no answer for {rids - set(got)}"
            msg = wp.recv(self.conn)
            for done in msg.answers if isinstance(msg, wp.DoneMany) else [msg] if isinstance(msg, wp.Done) else []:
                got[done.rid] = done
        return got

    def embedding(self, rid: int) -> np.ndarray:
        return np.array(self.arena.array(self.outputs[rid]["embedding"]))

    def alone(self, pixels: np.ndarray) -> np.ndarray:
        """The embedding of one image sent alone: the reference a bulk's answer must match."""
        sub = self.submit(pixels)
        wp.send(self.conn, sub)
        assert self.answers({sub.rid})[sub.rid].error is None
        return self.embedding(sub.rid)

    def close(self) -> None:
        self.conn.close()


def test_a_bad_submission_in_a_bulk_message_fails_alone(server):
    _, address, _ = server
    fe = OwnFrontEnd(address)
    try:
        good = images(3, seed=1)
        want = [fe.alone(x) for x in good]
        outside = wp.TensorRef(fe.arena.size - 16, (1, SIDE, SIDE, 3), "<f4")  # past the arena's end
        subs = [fe.submit(good[0]), fe.submit(good[0], model="no-such-model"), fe.submit(good[0], in_ref=outside),
                fe.submit(good[1]), fe.submit(good[0], op="no-such-op"), fe.submit(good[2])]
        wp.send(fe.conn, wp.SubmitMany(subs))
        got = fe.answers({s.rid for s in subs})
        for bad in (subs[1], subs[2], subs[4]):
            assert got[bad.rid].error is not None, bad
        for sub, ref in zip((subs[0], subs[3], subs[5]), want):
            assert got[sub.rid].error is None, got[sub.rid]
            np.testing.assert_allclose(fe.embedding(sub.rid), ref, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(fe.alone(good[1]), want[1], rtol=1e-4, atol=1e-5)  # the link still serves
    finally:
        fe.close()


def test_a_request_cancelled_inside_a_bulk_message_is_withdrawn_alone(server):
    _, address, release = server
    holding = release.with_name(release.name + ".holding")
    fe = OwnFrontEnd(address)
    try:
        good = images(3, seed=2)
        want = [fe.alone(x) for x in good]
        held = good[0].copy()
        held[0, 0, 0, 0] = HOLD
        first = fe.submit(held)
        wp.send(fe.conn, first)
        deadline = time.monotonic() + 60
        while not holding.exists():  # the worker is in the held model call: what follows queues
            assert time.monotonic() < deadline, "the held call never started"
            time.sleep(0.01)
        bulk = [fe.submit(x) for x in good]
        wp.send(fe.conn, wp.SubmitMany(bulk))
        wp.send(fe.conn, wp.Cancel(bulk[1].rid))
        time.sleep(0.2)  # the worker reads the cancel while the held call still runs
        release.touch()
        got = fe.answers({first.rid} | {s.rid for s in bulk})
        assert got[first.rid].error is None
        assert got[bulk[1].rid].error is not None and got[bulk[1].rid].error.kind == "cancelled"
        for i in (0, 2):
            assert got[bulk[i].rid].error is None, got[bulk[i].rid]
            np.testing.assert_allclose(fe.embedding(bulk[i].rid), want[i], rtol=1e-4, atol=1e-5)
    finally:
        fe.close()
        release.unlink(missing_ok=True)
        holding.unlink(missing_ok=True)


def test_every_request_is_said_started_before_it_is_answered(server):
    """Started (the front end's queue count: a started request no longer waits) goes out from the
    worker's delivery thread, queued ahead of the batch's own answers, alone or as a DoneMany's
    `started` (read before its answers): under a bulk of requests batched together, each rid is
    said started exactly once, and never after its Done."""
    _, address, _ = server
    fe = OwnFrontEnd(address)
    try:
        subs = [fe.submit(x) for x in images(20, seed=3)]
        wp.send(fe.conn, wp.SubmitMany(subs))
        started: list[int] = []
        order: list[tuple[str, int]] = []
        deadline = time.monotonic() + 60
        while sum(kind == "done" for kind, _ in order) < len(subs):
            assert fe.conn.poll(max(0.0, deadline - time.monotonic())), "answers missing"
            msg = wp.recv(fe.conn)
            rids = msg.rids if isinstance(msg, wp.Started) else msg.started if isinstance(msg, wp.DoneMany) else []
            started += rids
            order += [("started", rid) for rid in rids]
            if isinstance(msg, (wp.DoneMany, wp.Done)):
                for done in msg.answers if isinstance(msg, wp.DoneMany) else [msg]:
                    assert done.error is None, done
                    order.append(("done", done.rid))
        assert sorted(started) == sorted(s.rid for s in subs)  # each once
        for sub in subs:
            assert order.index(("started", sub.rid)) < order.index(("done", sub.rid)), sub.rid
    finally:
        fe.close()



def test_a_front_end_counts_a_request_started_once_from_either_message():
    """The front end's side (service/frontend/engine.py): a rid said started in a DoneMany's
    `started` leaves the queue count like one in a Started, once, also when the same DoneMany
    answers it; a rid it no longer holds, or says twice, changes nothing."""
    import asyncio

    from service.frontend.engine import Engine
    from service.frontend.submission import Submission

    async def run():
        arena = Arena(1 << 20)
        engine = Engine([("cpu", "/nonexistent")], arena)
        link = engine.links[0]
        subs = [Submission(arena, link, rid, 1, [], {}) for rid in (1, 2, 3, 4)]
        link.pending = {sub.rid: sub for sub in subs}
        link.rows = engine.waiting = len(subs)
        engine._on_messages(link, [wp.DoneMany([], [1, 99])])
        assert (engine.waiting, [s.started for s in subs]) == (3, [True, False, False, False])
        engine._on_messages(link, [wp.Started([1, 2])])
        assert (engine.waiting, [s.started for s in subs]) == (2, [True, True, False, False])
        engine._on_messages(link, [wp.DoneMany([wp.Done(3)], [3]), wp.DoneMany([wp.Done(1), wp.Done(4)])])
        assert engine.waiting == 0 and subs[2].started and not subs[3].started  # 4 answered unstarted: counted out once
        assert set(link.pending) == {2} and all(s.future.done() for s in (subs[0], subs[2], subs[3]))
        engine._on_messages(link, [wp.DoneMany([wp.Done(2)], [2])])
        assert engine.waiting == 0 and not link.pending
        arena.close()

    asyncio.run(run())

def encode(url: str, pixels: np.ndarray) -> np.ndarray:
    r = httpx.post(f"{url}/v1/models/{MODEL}/encode", content=npy(pixels), params={"format": "npy"},
                   headers={"content-type": "application/x-npy"}, timeout=120)
    assert r.status_code == 200, r.text
    return from_npy(r.content)


def counts(url: str) -> tuple[float, float]:
    """(requests, messages) the worker read, once settled: it publishes its counts every 50 ms
    while messages come and when idle (its I/O thread's half-second wait); bounded polling."""
    last = None
    for _ in range(50):
        snap = scrape(url)
        now = (metric_sum(snap, "convserve_worker_submits_total"),
               metric_sum(snap, "convserve_worker_submit_messages_total"))
        if now == last:
            return now
        last = now
        time.sleep(0.6)
    pytest.fail("the worker's message counts never settled")


def raw_encode_requests(port: int, xs: list[np.ndarray]) -> list[bytes]:
    """Prepared HTTP/1.1 requests, one per image (sent on raw sockets: all at one moment)."""
    out = []
    for x in xs:
        body = npy(x)
        out.append((f"POST /v1/models/{MODEL}/encode?format=npy HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                    f"Content-Type: application/x-npy\r\nContent-Length: {len(body)}\r\n\r\n").encode() + body)
    return out


def read_response(sock: socket.socket) -> tuple[int, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = sock.recv(65536)
        assert chunk, "connection closed before the answer"
        buf += chunk
    head, body = buf.split(b"\r\n\r\n", 1)
    length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n") if line.startswith(b"content-length:"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "connection closed mid-answer"
        body += chunk
    return int(head[9:12]), body


def test_concurrent_requests_travel_in_bulk_each_answered_with_its_own_result(server):
    """Requests that reach the front end at one moment: its event loop, stopped while they
    arrive (SIGSTOP: as a loop busy with other work), finds them all ready in one turn."""
    srv, _, _ = server
    xs = images(24, seed=3)
    want = [encode(srv.url, x) for x in xs]  # one at a time: the references
    socks = [socket.create_connection(("127.0.0.1", srv.port), timeout=120) for _ in xs]
    try:
        for sock, req in zip(socks, raw_encode_requests(srv.port, xs[:1] * len(xs))):
            sock.sendall(req)  # each connection accepted and kept alive before the burst
            assert read_response(sock)[0] == 200
        submits0, messages0 = counts(srv.url)
        os.kill(srv.proc.pid, signal.SIGSTOP)  # the front end (one: workers=1)
        try:
            for sock, req in zip(socks, raw_encode_requests(srv.port, xs)):
                sock.sendall(req)
        finally:
            os.kill(srv.proc.pid, signal.SIGCONT)
        answers = [read_response(sock) for sock in socks]
    finally:
        for sock in socks:
            sock.close()
    assert [status for status, _ in answers] == [200] * len(xs), answers[0]
    got = [from_npy(body) for _, body in answers]
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-5)
    assert len({g.tobytes() for g in got}) == len(xs)  # distinct inputs, distinct answers
    submits, messages = (now - before for now, before in zip(counts(srv.url), (submits0, messages0)))
    assert submits == len(xs), submits
    assert messages < submits, f"{messages} messages carried {submits} requests: none went in bulk"

