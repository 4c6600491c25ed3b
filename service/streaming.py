"""Streamed video decode (issue 13): frame groups leave the server as the causal decoder finishes
them, as fragmented MP4 for players or length-prefixed .npy records for programs.

One request path: the route is counted and admitted by Service.admit, the latents pass
validation.latents, and every decode step (one latent frame -> 1 or 4 frames) is a batcher
work item run by Service.run on the device worker. The first step runs before the response
starts, so a full queue (429 + Retry-After), a drain (503), a timeout (504) or bad latents (422)
answer problem+json like /decode does. Later steps are `continuation` items: the stream was
admitted once, so a full queue or a drain does not cut it. Steps are `solo` (a generator's next
step has nothing to batch with) and queue behind other work, so a long clip shares the device.

Back-pressure: a bounded buffer (BUFFER_GROUPS) sits between the decode steps and the socket.
When the reader is slow, uvicorn's send waits for the socket to drain, the buffer fills and no
further step is submitted: decoding pauses and memory stays flat. A client that disconnects
(or stops reading for request_timeout_s) ends the stream: the pending step is dropped, and the
decode generator is closed at the next frame boundary, which frees its causal feature cache.

Out of memory mid-stream (oom_recovery.frames): the decode resumes in tiles (then smaller
ones) from the group that failed, after decoding again and dropping the groups already sent; a
stream that runs out of memory even in the smallest tiles is cut (before its first group: 503)."""
from __future__ import annotations

import asyncio
import logging
import struct
import sys
import threading
import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from . import codecs, metrics, oom_recovery, validation
from .adapters import ERRORS, TENSOR_BODY, service
from .auth import require_api_key
from .bodies import read_body
from .fmp4 import FragmentedMP4Writer
from .model_host import HostedModel
from .pipeline import Service
from .problems import PROBLEM_SCHEMA, Problem
from .video import require_av

log = logging.getLogger("convserve.streaming")

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)],
                   responses={401: PROBLEM_SCHEMA}, tags=["v1", "streaming"])

ENDPOINT = "decode_stream"
MP4_MEDIA = "video/mp4"
NPY_STREAM_MEDIA = "application/x-npy-stream"
#: the .npy-stream record header: the record's byte length, 8-byte little-endian unsigned
RECORD_HEADER = struct.Struct("<Q")
#: the record that ends a complete .npy stream (length 0); a stream cut without it failed
END_RECORD = RECORD_HEADER.pack(0)
#: decoded frame groups that may wait between the decode and the socket
BUFFER_GROUPS = 1


class StreamClosed(Exception):
    """A step asked of a decode whose stream has ended."""


class ClientGone(Exception):
    pass


class ReaderStalled(Exception):
    pass


class GeneratorSteps:
    """Steps a generator on the device worker; close() from the event loop never waits for a
    running step: the worker closes the generator when that step ends."""

    def __init__(self, gen):
        self._gen = gen
        self._lock = threading.Lock()
        self._running = False
        self._closed = False
        self.steps = 0

    def step(self, _inputs=None):
        with self._lock:
            if self._closed:
                raise StreamClosed("the stream has ended")
            self._running = True
        try:
            out = next(self._gen)
            self.steps += 1
            return out
        except StopIteration:  # never raise StopIteration into an asyncio future
            raise RuntimeError("the decode ended before its last frame group") from None
        finally:
            with self._lock:
                self._running = False
                release = self._closed
            if release:
                self._release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._running:
                return
        self._release()

    @property
    def released(self) -> bool:
        return self._gen is None

    def _release(self) -> None:
        gen, self._gen = self._gen, None
        if gen is not None:
            gen.close()  # GeneratorExit at its yield: the frame and its feature cache go


class FrameGroups:
    """The frame groups of one streamed decode, each computed through Service.run."""

    def __init__(self, svc: Service, hm: HostedModel, latents: np.ndarray, tiled: bool | None):
        self.svc, self.hm, self.latents = svc, hm, latents
        self.total = int(latents.shape[2])
        self.steps = GeneratorSteps(oom_recovery.frames(hm, latents, tiled))
        self._key = ("decode_stream", id(self))  # unique: never batched with other work

    async def next(self, disconnected=None, *, continuation: bool = True) -> np.ndarray:
        return await self.svc.run(self.hm, self._key, self.latents, self.steps.step, disconnected,
                                  continuation=continuation, solo=True)

    async def pump(self, buffer: asyncio.Queue, start: int) -> None:
        """Groups start.. into the bounded buffer; put() waits while it is full (back-pressure)."""
        try:
            for _ in range(start, self.total):
                await buffer.put(await self.next())
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # noqa: BLE001 - handed to the sender, which ends the stream
            await buffer.put(exc)

    def close(self) -> None:
        self.steps.close()


def npy_record(group: np.ndarray) -> bytes:
    head, data = codecs.npy_parts(np.asarray(group, dtype=np.float32))
    return b"".join((RECORD_HEADER.pack(len(head) + len(data)), head, data))


class FrameStreamResponse(Response):
    """Chunked response of encoded frame groups; ends the Service.admit it was handed."""

    def __init__(self, groups: FrameGroups, first: np.ndarray, encode, *, media_type: str,
                 headers: dict, tracking, started: float, trailer: bytes = b""):
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.groups, self.first, self.encode = groups, first, encode
        self.tracking, self.started, self.trailer = tracking, started, trailer

    async def __call__(self, scope, receive, send) -> None:
        svc, g = self.groups.svc, self.groups
        labels = (g.hm.name, svc.backend.name)
        stall_s = svc.settings.request_timeout_s
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        gone_wait = asyncio.create_task(gone.wait())
        buffer: asyncio.Queue = asyncio.Queue(maxsize=BUFFER_GROUPS)
        pump = asyncio.create_task(g.pump(buffer, start=1))
        outcome: BaseException | None = None
        sent_groups = frames = 0
        try:
            await _unless_gone(send({"type": "http.response.start", "status": 200,
                                     "headers": self.raw_headers}), gone_wait, stall_s)
            group = self.first
            while True:
                last = sent_groups == g.total - 1
                chunk = await svc.in_pool(self.encode, group, last)
                await _unless_gone(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                   gone_wait, stall_s)
                sent_groups += 1
                frames += int(group.shape[1])
                if sent_groups == 1:
                    metrics.TIME_TO_FIRST_FRAME.labels(*labels).observe(time.perf_counter() - self.started)
                if last:
                    break
                group = await _unless_gone(buffer.get(), gone_wait)
                if isinstance(group, BaseException):
                    raise group
            await _unless_gone(send({"type": "http.response.body", "body": self.trailer, "more_body": False}),
                               gone_wait, stall_s)
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
            for task in (pump, watcher, gone_wait):
                task.cancel()
            try:  # the pump's queued step is dropped before the generator closes
                await asyncio.gather(pump, watcher, gone_wait, return_exceptions=True)
            finally:
                g.close()
                log.info("stream of %s ended after %d/%d frame groups (%d decoded)%s", g.hm.name, sent_groups,
                         g.total, g.steps.steps, "" if outcome is None else f": {outcome}")
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


DESCRIPTION = """The streaming form of `/decode` for video decoders: frames leave as the causal
decoder finishes them (1 frame for the first latent frame, then 4 per latent frame), over chunked
HTTP. Same body (latents N,C,T,h,w as .npy, safetensors or JSON+base64), limits and errors as
`/decode`; admission errors (429 with `Retry-After`, 503, 504, 4xx) come before any frame.

- `format=mp4` (default, one video): fragmented MP4, H.264 (`movflags=frag_keyframe+empty_moov`):
  the first chunk carries the init segment (ftyp, moov), each frame group is one fragment
  (moof + mdat) starting with a keyframe, so a progressive player can start on the first chunk
  (the tests decode it with PyAV/FFmpeg).
- `format=npy`: `application/x-npy-stream`, one record per frame group: an 8-byte little-endian
  unsigned length L, then L bytes of a `.npy` file holding float32 N,f,H,W,3 in [0,1]. A record
  with L = 0 ends the stream; a stream that stops without it was cut by an error. Concatenating
  the arrays on axis 1 gives exactly `/decode?format=npy`.

Back-pressure: a reader that stops reading pauses the decode; one that disconnects ends it at the
next frame. `X-Output-Shape` gives the whole clip's shape N,F,H,W,3, `X-Frame-Groups` the number
of groups (T)."""


@router.post(
    "/models/{name}/decode/stream", summary="Decode latents to video, streaming frames as they finish",
    description=DESCRIPTION,
    responses={**ERRORS, 200: {"description": "fragmented MP4 or .npy records, chunked", "content": {
        MP4_MEDIA: {"schema": {"type": "string", "format": "binary"}},
        NPY_STREAM_MEDIA: {"schema": {"type": "string", "format": "binary"}}}},
        499: PROBLEM_SCHEMA},
    response_class=Response, openapi_extra=TENSOR_BODY)
async def decode_stream(name: str, request: Request,
                        format: Literal["mp4", "npy"] = Query("mp4", description="mp4 (fragmented) | npy (records)"),
                        quality: int = Query(90, ge=1, le=100, description="MP4 quality (CRF 51..0)"),
                        tiled: Literal["on", "off", "auto"] = Query("auto",
                                                                    description="tiled decode (bounded memory)"),
                        fps: float = Query(16.0, gt=0, le=240, description="MP4 frame rate")):
    started = time.perf_counter()
    svc = service(request)
    tracking = svc.admit(name, ENDPOINT)
    hm = await tracking.__aenter__()
    groups = None
    try:
        if format == "mp4":
            require_av()
        body = await read_body(request, svc.settings.max_body_bytes)
        latents, _ = codecs.read_tensor_body(body, request.headers.get("content-type"), "latents")
        lat = await svc.in_pool(validation.latents, hm, latents, svc.settings)  # NaN scan: off the loop
        shape = hm.output_shape(lat.shape)
        n, t = shape[0], lat.shape[2]
        if format == "mp4":
            if n != 1:
                raise Problem(422, "batch-not-streamable",
                              f"a streamed MP4 holds one video, got {n}; ask for format=npy or send one")
            writer = FragmentedMP4Writer(shape[3], shape[2], fps, quality)
            encode, media, trailer = (lambda grp, last: writer.add_group(grp[0], last)), MP4_MEDIA, b""
        else:
            encode, media, trailer = (lambda grp, last: npy_record(grp)), NPY_STREAM_MEDIA, END_RECORD
        groups = FrameGroups(svc, hm, lat, {"on": True, "off": False}.get(tiled))
        first = await groups.next(request.is_disconnected, continuation=False)
    except BaseException:
        if groups is not None:
            groups.close()
        await tracking.__aexit__(*sys.exc_info())
        raise
    headers = {"X-Output-Shape": ",".join(map(str, shape)), "X-Frame-Groups": str(t)}
    return FrameStreamResponse(groups, first, encode, media_type=media, headers=headers,
                               tracking=tracking, started=started, trailer=trailer)
