"""Streamed video decode: frame groups leave the server as the causal decoder finishes
them, as fragmented MP4 for players or length-prefixed .npy records for programs.

One request path: the route is counted and admitted by Service.admit, the latents pass
validation.latents, and every decode step (one latent frame -> 1 or 4 frames) is a batcher
work item run by Service.run on the device worker. The first step runs before the response
starts, so a full queue (429 + Retry-After), a drain (503), a timeout (504) or bad latents (422)
answer problem+json like /decode does. Later steps are `continuation` items: the stream was
admitted once, so a full queue or a drain does not cut it. Steps are `solo` (a generator's next
step has nothing to batch with) and queue behind other work, so a long clip shares the device.

Back-pressure: a bounded buffer (BUFFER_GROUPS, frame_stream_response.py) sits between the decode
steps and the encoder's jobs (at most its `parallel`: MP4_ENCODERS for MP4, group_encoders.py),
and at most STEPS_AHEAD steps are asked of the worker beyond it (frame_groups.py). When the
reader is slow, uvicorn's send waits for the socket to drain, the buffer fills and no further step
is submitted: decoding pauses and memory stays flat. A client that disconnects (or stops reading
for request_timeout_s) ends the stream: the steps asked are dropped (their blocks let go), and the
decode generator is closed at the next frame boundary, which frees its causal feature cache.

Out of memory mid-stream (oom_recovery.frames): the decode resumes in tiles (then smaller
ones) from the group that failed, after decoding again and dropping the groups already sent; a
stream that runs out of memory even in the smallest tiles is cut (before its first group: 503)."""
from __future__ import annotations

import sys
import time
from typing import Literal

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import Response

from ... import codecs
from ...codecs.video import require_av
from ...problems import PROBLEM_SCHEMA, Problem
from .. import decode_request
from ..decode_request import DecodeRequest
from ..frame_groups import FrameGroups
from ..group_encoders import MP4_MEDIA, NPY_STREAM_MEDIA, NpyFile, NpyRecords, mp4_fragments
from ..http.bodies import read_body
from ..pipeline import Service
from .adapters import ERRORS, TENSOR_BODY, service
from .auth import require_api_key
from .frame_stream_response import FrameStreamResponse

router = APIRouter(prefix="/v1", dependencies=[Depends(require_api_key)],
                   responses={401: PROBLEM_SCHEMA}, tags=["v1", "streaming"])

ENDPOINT = "decode_stream"


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
            encoder = mp4_fragments(shape, fps, quality, svc.settings)
        else:
            encoder = NpyRecords()
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
    return FrameStreamResponse(groups, first, encoder, headers=headers, tracking=tracking, started=started,
                               stages=stages)


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
        encoder = mp4_fragments(shape, fps, quality, svc.settings)
    else:
        encoder = NpyFile(shape, req.dtype)
        headers["Content-Length"] = str(encoder.content_length)
    groups = FrameGroups(svc, req)
    try:
        await groups.open(disconnected)
        first = await groups.next(disconnected)
    except BaseException:
        groups.close()
        raise
    return FrameStreamResponse(groups, first, encoder, headers=headers, tracking=tracking, started=started,
                               stream_metrics=False)
