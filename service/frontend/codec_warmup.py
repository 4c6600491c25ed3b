"""A front end's video encoder, loaded before its first MP4 answer where a served model is a video
decoder (service/codecs/fmp4.py warm()).

Why: an MP4 answer's first fragment waits for whatever the encoder loads on first use, and its
later fragments wait behind the first. PyAV's import alone took 156-208 ms on a 2-core Xeon, and
each of a host's front ends paid it on its own first MP4 answer: on one H200 host, Wan 2.1
81x480x832 as MP4 reached the client 60-140 ms behind the uint8 `.npy` answer from its first
frame group on, a lag that no later group made up (benchmarks/analysis/video_timeline.py,
2026-12-01). Only where a video decoder is served: the import costs each front end ~18 MB."""
from __future__ import annotations

import logging

from ..codecs import fmp4

log = logging.getLogger("convserve.frontend")


async def warm_video_encoder(svc) -> float | None:
    """Once the front end knows its models (until_settled): the encoder loaded in the codec pool
    (where MP4 answers are encoded: its thread starts now too) where one of them is a video decoder. The seconds it took, or None (no video decoder, or the
    load failed: the first MP4 answer loads it then, or says why it cannot)."""
    await svc.until_settled()
    if not any(hm.is_video for hm in svc.models.values()):
        return None
    try:
        seconds = await svc.in_pool(fmp4.warm)
    except Exception as exc:  # PyAV missing or broken: the MP4 routes answer 501 with the reason
        log.warning("the video encoder did not load ahead (%s: %s); MP4 answers load it on first use",
                    exc.__class__.__name__, exc)
        return None
    log.debug("video encoder loaded in %.3f s", seconds)
    return seconds
