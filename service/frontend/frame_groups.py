"""A streamed video decode's frame groups on the front end's side (FrameGroups); the route that
sends them is service/frontend/routes/frame_stream_response.py."""
from __future__ import annotations

import asyncio
from collections import deque

import numpy as np

from ..ipc import worker_protocol as wp
from .decode_request import DecodeRequest
from .engine import Lease
from .pipeline import Service

#: a stream's decode steps asked of its worker before the last one is back (FrameGroups.pump).
#: One at a time, each group began a round trip after the last ended: Wan 2.1 81x480x832 as
#: uint8 .npy took 0.888 s against the raw decode's 0.815 (one H200, 2026-11-30)
STEPS_AHEAD = 2


class FrameGroups:
    """The frame groups of one streamed decode: the decode itself (the causal decoder's state)
    lives in the model worker that opened it (service/worker/model_worker.py); each group is one step
    asked of it through Service.run, written into a block of this front end's arena that is let
    go once the group is sent (its own lease)."""

    def __init__(self, svc: Service, req: DecodeRequest):
        """req.uint8: the groups leave the device as uint8 pixels (for the MP4 encoder). req.shards
        > 1: the first N devices decode each group together (service/worker/shard_leader.py)."""
        self.svc, self.req, self.hm = svc, req, req.hm
        hm = req.hm
        self.total = int(req.latents.shape[2])
        n, _, h, w, c = req.out_shape
        # the unit of work the stream runs at once (and stops after, when its client goes)
        svc.check_work(hm, n * int(hm.model.temporal_factor) * h * w, f"a group of {n}x{int(hm.model.temporal_factor)}"
                       f"x{h}x{w} frames")
        self._group_shape = lambda k: (n, 1 if k == 0 else int(hm.model.temporal_factor), h, w, c)
        self.link = None
        self.stream_id = None
        self.asked = 0
        self.decoded = 0

    async def open(self, disconnected=None) -> None:
        """Start the decode on a worker (it checks the latents there); its groups come from it."""
        req = self.req
        sub = await self.svc.run(self.hm, "stream_open", req.worker_options(), req.latents, {}, disconnected,
                                 link=req.link(self.svc.engine))  # None: any worker
        self.link, self.stream_id = sub.link, sub.future.result()

    async def next(self, disconnected=None) -> tuple[np.ndarray, Lease]:
        """The next group (a view of the arena) and the lease that holds it."""
        lease = Lease(self.svc.arena)
        k, self.asked = self.asked, self.asked + 1
        try:
            sub = await self.svc.run(self.hm, "stream_next", wp.Options(stream=self.stream_id), None,
                                     {"out": (self._group_shape(k), "uint8" if self.req.uint8 else "float32")},
                                     disconnected, lease=lease, link=self.link, continuation=True)
        except BaseException:
            lease.close()
            raise
        self.decoded += 1
        return sub.arrays()["out"], lease

    async def pump(self, buffer: asyncio.Queue, start: int) -> None:
        """Groups start.. into the bounded buffer; put() waits while it is full (back-pressure).
        STEPS_AHEAD steps are asked at once, so the worker starts each group as the one before
        ends instead of a round trip through this front end later."""
        asked: deque[asyncio.Task] = deque()
        waited = None  # the step awaited now
        got = None  # a group come back and not yet in the buffer
        try:
            k = start
            while k < self.total or asked:
                while k < self.total and len(asked) < STEPS_AHEAD:
                    asked.append(asyncio.ensure_future(self.next()))
                    k += 1
                    # the step's submit happens in the task's first run, before it awaits
                    # (Service.run with no inputs): one turn of the loop sends it, so the steps
                    # reach the worker in order, and the worker runs a stream's steps in order
                    await asyncio.sleep(0)
                waited = asked.popleft()
                got = await waited
                waited = None
                await buffer.put(got)
                got = None
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the sender, which ends the stream
            await buffer.put((exc, None))
        finally:  # steps asked and never handed over: withdrawn, or their blocks let go
            if got is not None:
                got[1].close()
            if waited is not None:  # it may have come back as the pump was cancelled
                asked.appendleft(waited)
            for task in asked:
                task.cancel()
            for outcome in await asyncio.gather(*asked, return_exceptions=True):
                if isinstance(outcome, tuple):
                    outcome[1].close()

    def close(self) -> None:
        """End the decode in its worker (its causal cache goes there)."""
        if self.link is not None and self.stream_id is not None:
            self.svc.engine.close_stream(self.link, self.stream_id)
            self.stream_id = None
