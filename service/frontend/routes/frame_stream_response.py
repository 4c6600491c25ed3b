"""The chunked answer of a video decode, sent frame group by frame group as the groups come back
from the worker (routes/streaming.py: the streaming route and /decode of one clip).

Three stages run side by side: the pump (frame_groups.py) asks the worker for the next groups,
the encoder's jobs (group_encoders.py) turn groups into bytes in the codec pool, up to its
`parallel` at once, and this sender sends the results in group order.

Rules:
- Each group's arena block (its lease) has one owner at a time: the buffer, the sender (a group
  at hand), a running job, or the sent-parts holder (HeldUntilSent).
- A job's block goes back only once the job has ended: a job given up (the client went, a later
  group failed, the server stops) lets its block go from the job's own end, never while its
  thread may still read it.
- Jobs are made in group order on the event loop and sent in that order. A failed decode step
  cuts the answer after the groups before it have been sent."""
from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

import numpy as np
from fastapi.responses import Response

from ... import metrics
from ...problems import Problem
from ..engine import Lease
from ..frame_groups import FrameGroups
from ..group_encoders import MP4_MEDIA, GroupEncoder
from ..http.sent import HeldUntilSent, Sent, sendable, sent_of

log = logging.getLogger("convserve.streaming")

#: decoded frame groups that may wait between the decode and the encoder's jobs
BUFFER_GROUPS = 1


class ClientGone(Exception):
    pass


class ReaderStalled(Exception):
    pass


def observe_stages(labels: tuple[str, str], started: float, ends: dict[str, float]) -> None:
    """Each stage's share of the time to the first frame: from the previous stage's end (the
    request's start for the first) to its own, in the order given."""
    last = started
    for stage, end in ends.items():
        metrics.STREAM_STAGE_SECONDS.labels(*labels, stage).observe(max(end - last, 0.0))
        last = end


class _Running:
    """One group's job in the codec pool, with the group's block."""

    def __init__(self, svc, encoder: GroupEncoder, group: np.ndarray, lease: Lease, last: bool, encode_seconds):
        job = encoder.job(group, last)  # here, in group order

        def timed():
            start = time.perf_counter()
            try:
                return job()
            finally:
                encode_seconds.observe(time.perf_counter() - start)

        self.group, self.lease, self.last = group, lease, last
        self.done = svc.codec_pool.submit(timed)
        self.result = asyncio.wrap_future(self.done)

    def give_up(self) -> None:
        """The block goes back once the job has ended (at once if it has), on the event loop."""
        loop = asyncio.get_running_loop()

        def ended(_):
            try:
                loop.call_soon_threadsafe(self.lease.close)
            except RuntimeError:  # the loop is closed: the process is ending
                self.lease.close()

        self.result.cancel()
        self.done.add_done_callback(ended)


class FrameStreamResponse(Response):
    """Chunked response of encoded frame groups; ends the Service.admit it was handed."""

    def __init__(self, groups: FrameGroups, first: tuple[np.ndarray, Lease], encoder: GroupEncoder, *,
                 headers: dict, tracking, started: float, stream_metrics: bool = True,
                 stages: dict[str, float] | None = None):
        """stream_metrics: observe time to first frame and frames/s (the streaming route's series;
        a whole clip sent progressively by /decode is not a stream to its client). stages: the
        perf_counter time at which each stage before the answer ended (body, open, first_group),
        observed with the send stage once the first group is sent."""
        self.stages = stages or {}
        self.stream_metrics = stream_metrics
        self.status_code = 200
        self.media_type = encoder.media_type
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.groups, self.first, self.encoder = groups, first, encoder
        self.tracking, self.started = tracking, started

    async def __call__(self, scope, receive, send) -> None:
        svc, g, encoder = self.groups.svc, self.groups, self.encoder
        labels = (g.hm.name, svc.backend_name)
        stage_seconds = {stage: metrics.STREAM_GROUP_SECONDS.labels(
            *labels, "mp4" if self.media_type == MP4_MEDIA else "npy", stage) for stage in ("wait", "encode", "send")}
        stall_s = svc.settings.request_timeout_s
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        gone_wait = asyncio.create_task(gone.wait())
        buffer: asyncio.Queue = asyncio.Queue(maxsize=BUFFER_GROUPS)
        pump = asyncio.create_task(g.pump(buffer, start=1))
        outcome: BaseException | None = None
        sent_groups = frames = started_groups = 0
        sent = sent_of(scope)
        held = HeldUntilSent(sent or Sent(None))  # without `sent`, parts are copies: nothing waits
        at_hand, self.first = self.first, None  # a decoded group no job has yet
        running: deque[_Running] = deque()  # jobs started, in group order
        getter: asyncio.Task | None = None  # the next group from the buffer
        idle = 0.0  # seconds with no job running, waiting for the next group: the decode is behind
        failure: BaseException | None = None  # a later step's, raised once the groups before it are sent
        try:
            await _unless_gone(send({"type": "http.response.start", "status": 200,
                                     "headers": self.raw_headers}), gone_wait, stall_s)
            while True:
                while at_hand is not None and len(running) < encoder.parallel:  # keep the jobs going
                    group, lease = at_hand
                    at_hand = None
                    try:
                        running.append(_Running(svc, encoder, group, lease, started_groups == g.total - 1,
                                                stage_seconds["encode"]))
                    except BaseException:
                        lease.close()
                        raise
                    started_groups += 1
                if failure is not None and not running:
                    raise failure
                if failure is None and at_hand is None and getter is None and started_groups < g.total:
                    getter = asyncio.ensure_future(buffer.get())
                waiting = {gone_wait} | ({getter} if getter else set()) | ({running[0].result} if running else set())
                wait_start = time.perf_counter()
                done, _ = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
                if not running:
                    idle += time.perf_counter() - wait_start
                if gone_wait in done:
                    raise ClientGone()
                if getter is not None and getter in done:  # a group decoded: its job starts first
                    at_hand, getter = getter.result(), None
                    if isinstance(at_hand[0], BaseException):  # the decode failed: no group comes after
                        failure, at_hand = at_hand[0], None
                    else:
                        stage_seconds["wait"].observe(idle)
                        idle = 0.0
                    continue
                head = running.popleft()
                try:
                    chunk = head.result.result()
                except BaseException:
                    head.lease.close()
                    raise
                send_start = time.perf_counter()
                if isinstance(chunk, list):  # parts that may view the group's block: held until sent
                    try:
                        for part in chunk:
                            await _unless_gone(send({"type": "http.response.body", "body": sendable(part, sent),
                                                     "more_body": True}), gone_wait, stall_s)
                            held.wrote(len(part))
                    finally:  # even when the send was cut: let go once what was written has left
                        held.hold(head.lease)
                else:  # bytes of their own: the block goes back to the arena at once
                    head.lease.close()
                    await _unless_gone(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                       gone_wait, stall_s)
                stage_seconds["send"].observe(time.perf_counter() - send_start)
                sent_groups += 1
                frames += int(head.group.shape[1])
                if sent_groups == 1 and self.stream_metrics:
                    now = time.perf_counter()
                    metrics.TIME_TO_FIRST_FRAME.labels(*labels).observe(now - self.started)
                    observe_stages(labels, self.started, {**self.stages, "send": now})
                if head.last:
                    break
            await _unless_gone(send({"type": "http.response.body", "body": encoder.trailer, "more_body": False}),
                               gone_wait, stall_s)
            await _unless_gone(held.drain(), gone_wait, stall_s)
            if self.stream_metrics:
                metrics.STREAM_FPS.labels(*labels).observe(frames / max(time.perf_counter() - self.started, 1e-9))
        except ClientGone:
            outcome = Problem(499, "client-gone", "the client disconnected mid-stream")
        except ReaderStalled:
            outcome = Problem(408, "reader-stalled", f"the client read nothing for {stall_s:g}s")
        except Problem as p:  # a later decode step failed: the stream is cut (no end record)
            outcome = p
            log.warning("stream of %s cut after %d/%d frame groups: %s", g.hm.name, sent_groups, g.total, p.detail)
        except asyncio.CancelledError as exc:
            outcome = exc
            raise
        except Exception as exc:
            outcome = exc
            log.exception("stream of %s failed after %d/%d frame groups", g.hm.name, sent_groups, g.total)
        finally:
            for job in running:  # started and never sent: their blocks go when their jobs end
                job.give_up()
            if at_hand is not None:
                at_hand[1].close()
            for task in (pump, watcher, gone_wait) + ((getter,) if getter else ()):
                task.cancel()
            try:  # the pump's queued step is dropped before the decode closes
                await asyncio.gather(pump, watcher, gone_wait, return_exceptions=True)
            finally:
                if getter is not None and getter.done() and not getter.cancelled() and getter.exception() is None:
                    left = getter.result()[1]  # a group taken from the buffer as the stream ended
                    if left is not None:
                        left.close()
                if not isinstance(outcome, asyncio.CancelledError):  # a cut answer: what was written
                    try:  # still leaves before its blocks go (uvicorn's close flushes it)
                        await asyncio.wait_for(held.drain(), stall_s)
                    except (asyncio.TimeoutError, OSError):
                        pass
                held.release_all()
                while not buffer.empty():  # groups decoded and never sent
                    _, left = buffer.get_nowait()
                    if left is not None:
                        left.close()
                g.close()
                log.info("stream of %s ended after %d/%d frame groups (%d decoded)%s", g.hm.name, sent_groups,
                         g.total, g.decoded, "" if outcome is None else f": {outcome}")
                await self.tracking.__aexit__(type(outcome) if outcome else None, outcome, None)


async def _watch_disconnect(receive, gone: asyncio.Event) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    gone.set()


async def _unless_gone(aw, gone_wait: asyncio.Task, timeout: float | None = None):
    """Await `aw` unless the client goes (ClientGone) or it takes over `timeout` (ReaderStalled)."""
    task = asyncio.ensure_future(aw)
    try:
        done, _ = await asyncio.wait({task, gone_wait}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    if task in done:
        return task.result()
    task.cancel()
    raise ClientGone() if gone_wait in done else ReaderStalled()
