"""The sender of video answers (service/frontend/routes/frame_stream_response.py) with several
encoder jobs at once, and the MP4 writer's encoders taking groups in turn (service/codecs/fmp4.py):

- groups leave in group order whatever order their jobs end in, never more jobs run than the
  encoder allows, and every group's block is let go exactly once;
- a client gone mid-answer lets each running job's block go only after that job has ended;
- a job that fails, or a decode step that fails, cuts the answer after the groups before it;
- a clip encoded by 2 or 3 x264 contexts side by side, in any order their locks allow, is byte for
  byte the clip the same writer gives one group at a time, plays, and holds every frame in order.
"""
from __future__ import annotations

import asyncio
import io
import random
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest

from service.frontend.routes.frame_stream_response import FrameStreamResponse


class Lease:
    def __init__(self, k: int, log: list):
        self.k, self.log, self.closed = k, log, 0

    def close(self):
        self.closed += 1
        self.log.append(("closed", self.k))


class SlowEncoder:
    """Jobs that take longer for earlier groups (so later ones end first), recording overlap."""
    media_type, trailer = "application/x-test", b"END"

    def __init__(self, parallel: int, log: list, hold: threading.Event | None = None):
        self.parallel, self.log, self.hold = parallel, log, hold
        self.running = self.most = 0
        self.lock = threading.Lock()

    def job(self, group, last):
        k = int(group[0, 0])
        self.log.append(("started", k))

        def run():
            self.log.append(("running", k))  # in the pool's thread: the job has begun
            with self.lock:
                self.running += 1
                self.most = max(self.most, self.running)
            try:
                if self.hold is not None and k > 0:
                    self.hold.wait(5)
                time.sleep(0.03 if k % 2 == 0 else 0.005)
                self.log.append(("ended", k))
                return f"<{k}>".encode()
            finally:
                with self.lock:
                    self.running -= 1
        return run


class Groups:
    """FrameGroups' part the sender uses: `total` groups, group k a (1, k) array, each its own lease."""

    def __init__(self, total: int, log: list, pool):
        self.total, self.log, self.decoded = total, log, 0
        self.svc = SimpleNamespace(backend_name="numpy", codec_pool=pool,
                                   settings=SimpleNamespace(request_timeout_s=10.0))
        self.hm = SimpleNamespace(name="sender-test")
        self.leases = []
        self.closed = False

    def group(self, k: int):
        lease = Lease(k, self.log)
        self.leases.append(lease)
        return np.full((1, 1), k), lease

    async def pump(self, buffer: asyncio.Queue, start: int) -> None:
        for k in range(start, self.total):
            await asyncio.sleep(0.001)
            self.decoded += 1
            group = self.group(k)
            try:
                await buffer.put(group)
            except asyncio.CancelledError:  # as FrameGroups.pump: a group never handed over goes back
                group[1].close()
                raise

    def close(self):
        self.closed = True


class Tracking:
    def __init__(self):
        self.exited = None

    async def __aexit__(self, *exc):
        self.exited = exc


async def answer(groups: Groups, encoder, *, disconnect_after: int | None = None, settle: bool = False):
    """The response run as uvicorn would; the body parts sent, and the tracking it ended."""
    tracking = Tracking()
    response = FrameStreamResponse(groups, groups.group(0), encoder, headers={}, tracking=tracking,
                                   started=time.perf_counter(), stream_metrics=False)
    body, gone = [], asyncio.Event()

    async def send(message):
        if message["type"] == "http.response.body":
            body.append(message["body"])
            if disconnect_after is not None and len(body) == disconnect_after:
                gone.set()

    async def receive():
        await gone.wait()
        return {"type": "http.disconnect"}

    await response({"type": "http"}, receive, send)
    # settle: a cut answer gives a running job's block back on the event loop once the job ends
    # (_Running.give_up); a server's loop keeps running, but asyncio.run closes this one and drops that callback
    deadline = time.monotonic() + (5.0 if settle else 0.0)
    while any(not lease.closed for lease in groups.leases) and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    return body, tracking


@pytest.mark.parametrize("parallel", [1, 2, 3])
def test_groups_leave_in_order_with_jobs_side_by_side(parallel):
    log: list = []
    with ThreadPoolExecutor(4) as pool:
        groups = Groups(9, log, pool)
        encoder = SlowEncoder(parallel, log)
        body, tracking = asyncio.run(answer(groups, encoder))
    assert body == [f"<{k}>".encode() for k in range(9)] + [b"END"]
    assert encoder.most == parallel, encoder.most  # as many as allowed, never more
    assert [lease.closed for lease in groups.leases] == [1] * 9
    assert tracking.exited == (None, None, None) and groups.closed
    if parallel > 1:  # a later, faster job ended before an earlier one: the order is the sender's
        ended = [k for what, k in log if what == "ended"]
        assert ended != sorted(ended), ended


def test_a_client_gone_lets_running_jobs_blocks_go_only_after_they_end():
    log: list = []
    hold = threading.Event()  # the jobs after the first wait for it in their threads
    with ThreadPoolExecutor(4) as pool:
        groups = Groups(9, log, pool)
        encoder = SlowEncoder(3, log, hold)
        body, tracking = asyncio.run(answer(groups, encoder, disconnect_after=1))
        # jobs begun in their threads and not ended keep their blocks: the threads may still read them
        # (a job still queued in the pool is withdrawn, and its block goes back at once)
        running = [lease.k for lease in groups.leases if ("running", lease.k) in log and ("ended", lease.k) not in log]
        given = [lease.k for lease in groups.leases if lease.closed == 0]
        assert running and given == running, (running, given, log)
        hold.set()
        deadline = time.monotonic() + 5
        while any(lease.closed == 0 for lease in groups.leases) and time.monotonic() < deadline:
            time.sleep(0.01)
    assert body == [b"<0>"]
    for k in running:  # each block went back after its job ended
        assert log.index(("ended", k)) < log.index(("closed", k)), log
    assert all(lease.closed == 1 for lease in groups.leases), [x.closed for x in groups.leases]
    assert tracking.exited[0] is not None and groups.closed


class FailingEncoder(SlowEncoder):
    """Group `bad`'s job raises, as an encoder would on data it cannot take."""

    def __init__(self, parallel: int, log: list, bad: int):
        super().__init__(parallel, log)
        self.bad = bad

    def job(self, group, last):
        run = super().job(group, last)
        if int(group[0, 0]) != self.bad:
            return run

        def fail():
            run()
            raise ValueError("the encoder choked")
        return fail


class FailingGroups(Groups):
    """The decode fails at group `bad` (a Problem from the worker, handed on by the pump)."""

    def __init__(self, total, log, pool, bad: int):
        super().__init__(total, log, pool)
        self.bad = bad

    async def pump(self, buffer, start):
        from service.problems import Problem

        for k in range(start, self.total):
            await asyncio.sleep(0.001)
            if k == self.bad:
                await buffer.put((Problem(503, "device-out-of-memory", "the decode failed"), None))
                return
            await buffer.put(self.group(k))


@pytest.mark.parametrize("parallel", [1, 3])
def test_a_failed_job_or_decode_cuts_the_answer_and_every_block_goes_back_once(parallel):
    scenarios = [  # (the groups, the encoder, the groups sent before the cut)
        (lambda log, pool: Groups(9, log, pool), lambda log: FailingEncoder(parallel, log, 4), 4),
        (lambda log, pool: FailingGroups(9, log, pool, 5), lambda log: SlowEncoder(parallel, log), 5)]
    for make_groups, encoder_for, before in scenarios:
        log: list = []
        with ThreadPoolExecutor(4) as pool:
            groups = make_groups(log, pool)
            body, tracking = asyncio.run(answer(groups, encoder_for(log), settle=True))
        sent = [part for part in body if part]
        assert b"END" not in body and sent == [f"<{k}>".encode() for k in range(len(sent))], body  # in order, then cut
        assert len(sent) == before, body  # every group before the one that failed
        assert [lease.closed for lease in groups.leases] == [1] * len(groups.leases)
        assert tracking.exited[0] is not None and groups.closed


def clip(frames: int, h: int = 48, w: int = 64) -> np.ndarray:
    y, x = np.mgrid[0:h, 0:w]
    return np.stack([np.stack([(x * 3 + t * 29) % 256, (y * 4 + 13 * t) % 256, (x + y + 41 * t) % 256], -1)
                     for t in range(frames)]).astype(np.float32) / 255


@pytest.mark.parametrize("encoders", [2, 3])
def test_encoders_in_turn_give_the_same_clip_side_by_side_as_one_at_a_time(encoders):
    av = pytest.importorskip("av")
    from service.codecs.fmp4 import FragmentedMP4Writer, top_level_boxes

    frames = clip(1 + 4 * 6)
    spans = [(0, 1)] + [(1 + 4 * i, 5 + 4 * i) for i in range(6)]

    def writer():
        return FragmentedMP4Writer(64, 48, 8.0, 90, preset="ultrafast", threads=1, encoders=encoders)

    one_by_one = writer()
    expected = [one_by_one.add_group(frames[a:b], last=b == len(frames)) for a, b in spans]
    side_by_side = writer()
    jobs = [side_by_side.group_job(frames[a:b], last=b == len(frames)) for a, b in spans]  # places fixed in order
    contexts = list(range(encoders))
    random.Random(encoders).shuffle(contexts)
    got = [None] * len(jobs)

    def run_context(c):  # each context's groups in order, the contexts side by side
        for i in range(c, len(jobs), encoders):
            time.sleep(0.002 * random.random())
            got[i] = jobs[i]()

    with ThreadPoolExecutor(encoders) as pool:
        list(pool.map(run_context, contexts))
    assert got == expected
    misordered = writer()
    jobs = [misordered.group_job(frames[a:b]) for a, b in spans[:1 + encoders]]
    with pytest.raises(RuntimeError, match="reached its encoder before"):
        jobs[encoders]()  # group K on context 0 before group 0
    data = b"".join(got)
    assert [k for k, _ in top_level_boxes(data)] == ["ftyp", "moov"] + ["moof", "mdat"] * len(spans)
    with av.open(io.BytesIO(data)) as container:
        decoded = list(container.decode(video=0))
    assert [f.pts for f in decoded] == sorted(f.pts for f in decoded) and len(decoded) == len(frames)
    rgb = np.stack([f.to_ndarray(format="rgb24") for f in decoded]).astype(np.float64)
    assert np.abs(rgb - frames * 255).mean() < 6
    # each frame is its own: a clip shifted by one frame is far off
    assert np.abs(rgb[1:] - frames[:-1] * 255).mean() > 3 * np.abs(rgb - frames * 255).mean()


def test_the_last_group_is_encoded_with_every_contexts_threads():
    """The last group's encode overlaps no decode: it goes to a context of its own with the
    threads of all K contexts (opened ahead, while the second group is encoded); one context
    alone, or x264's own thread count, keeps the groups' contexts as they are."""
    pytest.importorskip("av")
    from service.codecs.fmp4 import FragmentedMP4Writer

    frames = clip(1 + 4 * 3)
    spans = [(0, 1), (1, 5), (5, 9), (9, 13)]
    writer = FragmentedMP4Writer(64, 48, 8.0, 90, preset="ultrafast", threads=2, encoders=3)
    tail = writer._tail
    assert tail is not None and tail.codec.options["threads"] == "6"
    assert all(c.codec.options["threads"] == "2" for c in writer._contexts)
    for i, (a, b) in enumerate(spans):
        writer.add_group(frames[a:b], last=b == len(frames))
        assert tail.codec.is_open == (i >= 1)
    assert tail.next_index == len(spans) - 1 + writer.encoders  # it took the last group, and only it
    assert [c.next_index for c in writer._contexts] == [3, 4, 5]  # groups 0, 1, 2 on contexts 0, 1, 2
    assert FragmentedMP4Writer(64, 48, 8.0, threads=2, encoders=1)._tail is None
    assert FragmentedMP4Writer(64, 48, 8.0, threads=0, encoders=2)._tail is None
