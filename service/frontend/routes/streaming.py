"""Streamed video decode: frame groups leave the server as the causal decoder finishes
them, as fragmented MP4 for players or length-prefixed .npy records for programs.

One request path: the route is counted and admitted by Service.admit, the latents pass
validation.latents, and every decode step (one latent frame -> 1 or 4 frames) is a batcher
work item run by Service.run on the device worker. The first step runs before the response
starts, so a full queue (429 + Retry-After), a drain (503), a timeout (504) or bad latents (422)
answer problem+json like /decode does. Later steps are `continuation` items: the stream was
admitted once, so a full queue or a drain does not cut it. Steps are `solo` (a generator's next
step has nothing to batch with) and queue behind other work, so a long clip shares the device.

Back-pressure: a bounded buffer (BUFFER_GROUPS) sits between the decode steps and the socket,
and at most STEPS_AHEAD steps are asked of the worker beyond it (frame_groups.py). When the
reader is slow, uvicorn's send waits for the socket to drain, the buffer fills and no further step
is submitted: decoding pauses and memory stays flat. A client that disconnects (or stops reading
for request_timeout_s) ends the stream: the steps asked are dropped (their blocks let go), and the
decode generator is closed at the next frame boundary, which frees its causal feature cache.

Out of memory mid-stream (oom_recovery.frames): the decode resumes in tiles (then smaller
ones) from the group that failed, after decoding again and dropping the groups already sent; a
stream that runs out of memory even in the smallest tiles is cut (before its first group: 503)."""
from __future__ import annotations

import asyncio
import logging
import math
import struct
import sys
import time
from typing import Literal

import numpy as np
from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from ... import codecs, metrics
from ...codecs.fmp4 import FragmentedMP4Writer
from ...codecs.video import require_av
from ...problems import PROBLEM_SCHEMA, Problem
from .. import decode_request
from ..decode_request import DecodeRequest
from ..engine import Lease
from ..frame_groups import FrameGroups
from ..http.bodies import read_body
from ..http.sent import HeldUntilSent, Sent, sendable, sent_of
from ..pipeline import Service
from .adapters import ERRORS, TENSOR_BODY, service
from .auth import require_api_key

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


def npy_record(group: np.ndarray) -> list:
    """A group's record as parts: its length and .npy header, then its float32 data, a view of
    the group's block where it is float32 already (FrameStreamResponse holds the block until
    the view has left; joined here, the data was copied once more than the chunked send does)."""
    head, data = codecs.npy_parts(np.asarray(group, dtype=np.float32))
    return [RECORD_HEADER.pack(len(head) + len(data)) + head, data]


class FrameStreamResponse(Response):
    """Chunked response of encoded frame groups; ends the Service.admit it was handed."""

    def __init__(self, groups: FrameGroups, first: tuple[np.ndarray, Lease], encode, *, media_type: str,
                 headers: dict, tracking, started: float, trailer: bytes = b"", stream_metrics: bool = True,
                 stages: dict[str, float] | None = None):
        """stream_metrics: observe time to first frame and frames/s (the streaming route's series;
        a whole clip sent progressively by /decode is not a stream to its client). stages: the
        perf_counter time at which each stage before the answer ended (body, open, first_group),
        observed with the send stage once the first group is sent."""
        self.stages = stages or {}
        self.stream_metrics = stream_metrics
        self.status_code = 200
        self.media_type = media_type
        self.background = None
        self.init_headers({**headers, "Cache-Control": "no-store", "X-Accel-Buffering": "no"})
        self.groups, self.first, self.encode = groups, first, encode
        self.tracking, self.started, self.trailer = tracking, started, trailer

    async def __call__(self, scope, receive, send) -> None:
        svc, g = self.groups.svc, self.groups
        labels = (g.hm.name, svc.backend_name)
        stall_s = svc.settings.request_timeout_s
        gone = asyncio.Event()
        watcher = asyncio.create_task(_watch_disconnect(receive, gone))
        gone_wait = asyncio.create_task(gone.wait())
        buffer: asyncio.Queue = asyncio.Queue(maxsize=BUFFER_GROUPS)
        pump = asyncio.create_task(g.pump(buffer, start=1))
        outcome: BaseException | None = None
        sent_groups = frames = 0
        sent = sent_of(scope)
        held = HeldUntilSent(sent or Sent(None))  # without `sent`, parts are copies: nothing waits
        try:
            await _unless_gone(send({"type": "http.response.start", "status": 200,
                                     "headers": self.raw_headers}), gone_wait, stall_s)
            group, lease = self.first
            while True:
                last = sent_groups == g.total - 1
                try:
                    chunk = await svc.in_pool(self.encode, group, last)
                except BaseException:
                    lease.close()
                    raise
                if isinstance(chunk, list):  # parts that may view the group's block: held until sent
                    try:
                        for part in chunk:
                            await _unless_gone(send({"type": "http.response.body", "body": sendable(part, sent),
                                                     "more_body": True}), gone_wait, stall_s)
                            held.wrote(len(part))
                    finally:  # even when the send was cut: let go once what was written has left
                        held.hold(lease)
                else:  # bytes of their own: the block goes back to the arena at once
                    lease.close()
                    await _unless_gone(send({"type": "http.response.body", "body": chunk, "more_body": True}),
                                       gone_wait, stall_s)
                sent_groups += 1
                frames += int(group.shape[1])
                if sent_groups == 1 and self.stream_metrics:
                    now = time.perf_counter()
                    metrics.TIME_TO_FIRST_FRAME.labels(*labels).observe(now - self.started)
                    observe_stages(labels, self.started, {**self.stages, "send": now})
                if last:
                    break
                group, lease = await _unless_gone(buffer.get(), gone_wait)
                if isinstance(group, BaseException):
                    raise group
            await _unless_gone(send({"type": "http.response.body", "body": self.trailer, "more_body": False}),
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
            for task in (pump, watcher, gone_wait):
                task.cancel()
            try:  # the pump's queued step is dropped before the decode closes
                await asyncio.gather(pump, watcher, gone_wait, return_exceptions=True)
            finally:
                if not isinstance(outcome, asyncio.CancelledError):  # a cut answer: what was written
                    try:  # still leaves before its blocks go (uvicorn's close flushes it)
                        await asyncio.wait_for(held.drain(), stall_s)
                    except (asyncio.TimeoutError, OSError):
                        pass
                held.release_all()
                self.first[1].close()
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
                        fps: float = Query(16.0, gt=0, le=240, description="MP4 frame rate"),
                        shards: str = Query("1", description="devices that decode each group together: 1, N or "
                                            "auto (docs/sharding.md)")):
    started = time.perf_counter()
    svc = service(request)
    tracking = svc.admit(name, ENDPOINT)
    hm = await tracking.__aenter__()
    groups = None
    try:
        requested = decode_request.parse_shards(shards)
        if format == "mp4":
            require_av()
        body = await read_body(request, svc.settings.max_body_bytes)
        # a large body is parsed and scanned off the event loop (a 32 MiB JSON body delayed /healthz)
        latents, _ = await svc.offload(len(body), codecs.read_tensor_body, body, request.headers.get("content-type"),
                                       "latents")
        req = await decode_request.build(svc, hm, latents, format=format, tiled=decode_request.parse_tiled(tiled),
                                         shards=requested)
        stages = {"body": time.perf_counter()}
        shape = req.out_shape
        n, t = shape[0], req.latents.shape[2]
        if format == "mp4":
            if n != 1:
                raise Problem(422, "batch-not-streamable",
                              f"a streamed MP4 holds one video, got {n}; ask for format=npy or send one")
            writer = FragmentedMP4Writer(shape[3], shape[2], fps, quality, preset=svc.settings.mp4_preset)
            encode, media, trailer = (lambda grp, last: writer.add_group(grp[0], last)), MP4_MEDIA, b""
        else:
            encode, media, trailer = (lambda grp, last: npy_record(grp)), NPY_STREAM_MEDIA, END_RECORD
        groups = FrameGroups(svc, req)
        await groups.open(request.is_disconnected)
        stages["open"] = time.perf_counter()
        first = await groups.next(request.is_disconnected)
        stages["first_group"] = time.perf_counter()
    except BaseException:
        if groups is not None:
            groups.close()
        await tracking.__aexit__(*sys.exc_info())
        raise
    headers = {"X-Output-Shape": ",".join(map(str, shape)), "X-Frame-Groups": str(t)}
    return FrameStreamResponse(groups, first, encode, media_type=media, headers=headers,
                               tracking=tracking, started=started, trailer=trailer, stages=stages)


async def whole_clip_response(svc: Service, req: DecodeRequest, *, fps: float, quality: int, tracking, disconnected,
                              started: float) -> FrameStreamResponse:
    """/decode of one video (not the streaming route): the whole MP4 or .npy file, sent as its
    frame groups are decoded rather than after the last one (the clip's encode and transfer
    overlap its decode). The first group is decoded before the answer starts, so admission,
    timeouts and bad latents answer problem+json as before; a later failure cuts the answer
    (an .npy short of its Content-Length, an MP4 without its last chunk). `tracking` (the
    request's Service.admit) ends with the answer."""
    shape = req.out_shape
    headers = {"X-Output-Shape": ",".join(map(str, shape))}
    if req.format == "mp4":
        writer = FragmentedMP4Writer(shape[3], shape[2], fps, quality, preset=svc.settings.mp4_preset)
        encode, media = (lambda grp, last: writer.add_group(grp[0], last)), MP4_MEDIA
    else:
        out_dt = np.dtype(req.dtype)
        head = codecs.npy_header(shape, out_dt)
        headers["Content-Length"] = str(len(head) + math.prod(shape) * out_dt.itemsize)
        sent_head = []

        def encode(grp: np.ndarray, last: bool) -> list:
            # parts, not bytes: float32 frames are sent from the group's block itself (a view; the
            # response holds the block until they have left), float16 from their conversion
            parts = [] if sent_head else [head]
            sent_head.append(True)
            return [*parts, codecs.npy_parts(np.asarray(grp, dtype=out_dt))[1]]
        media = codecs.NPY_MEDIA
    groups = FrameGroups(svc, req)
    try:
        await groups.open(disconnected)
        first = await groups.next(disconnected)
    except BaseException:
        groups.close()
        raise
    return FrameStreamResponse(groups, first, encode, media_type=media, headers=headers, tracking=tracking,
                               started=started, stream_metrics=False)
