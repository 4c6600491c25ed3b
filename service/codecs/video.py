"""MP4 (H.264) encoding with PyAV, imported lazily: `av` is the optional `video` extra."""
from __future__ import annotations

import importlib.util
import io
import os
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..problems import Problem
from .images import ZIP_MEDIA, to_uint8, zip_bytes


def _missing_av(alternative: str) -> Problem:
    # PyAV is a dependency; this answers an install that lost it (or a platform without a wheel)
    return Problem(501, "video-extra-missing", f"MP4 output needs PyAV: pip install av{alternative}")


def require_av(alternative: str = " (or ask for format=npy)") -> None:
    """The 501 of a request for MP4 output without the `video` extra, before any work (PyAV is
    looked for, not imported)."""
    if importlib.util.find_spec("av") is None:
        raise _missing_av(alternative)


def load_av():
    """PyAV, or the 501 problem naming the extra that installs it."""
    try:
        import av  # noqa: PLC0415 - optional dependency
    except ImportError as exc:
        raise _missing_av(" (or ask for format=npy)") from exc
    return av


#: threads converting frames to the encoder's yuv420p, shared by a process's encoders
YUV_THREADS = 4
_yuv_pool: ThreadPoolExecutor | None = None
_yuv_lock = threading.Lock()


#: `MP4_CABAC=auto` codes with CAVLC at this x264 CRF and below (quality >= 80), CABAC above (the
#: setting's default is `on`: CABAC always, files as they always were). Why auto draws the line here:
#: CABAC's arithmetic coding is serial within a slice and its work grows with the bits, so at high
#: quality it is most of x264's time: on one core of a 2-core Xeon, 4 noise-like 480x832 frames at
#: CRF 5 (the default quality 90) took 289 ms with CABAC against 79 with CAVLC, smooth ones 198
#: against 93, for 13-15 % more bytes; at CRF 18 the gain is 1.3-2.1x for 17-21 % more bytes
#: (2026-12-01). Where the files are already that large, half the encoder's CPU may be worth 14 %.
CAVLC_MAX_CRF = 10


def x264_options(codec: str, crf: int, preset: str, threads: int, cabac: str = "on") -> dict[str, str]:
    """The encoder's options for an MP4 answer: CRF, preset, threads (0: x264's own count) and the
    entropy coder (`cabac`: on, off, or auto by CAVLC_MAX_CRF; only libx264 takes the choice)."""
    options = {"crf": str(crf), "preset": preset, **({"threads": str(threads)} if threads else {})}
    if cabac not in ("auto", "on", "off"):
        raise ValueError(f"cabac is auto, on or off, not {cabac!r}")
    if codec == "libx264" and (cabac == "off" or (cabac == "auto" and crf <= CAVLC_MAX_CRF)):
        options["x264-params"] = "cabac=0"
    return options


def h264_codec(av) -> str:
    """x264 where this PyAV's FFmpeg has it, else its default H.264 encoder."""
    return "libx264" if "libx264" in av.codecs_available else "h264"


def _yuv420p(av, rgb: np.ndarray):
    return av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")


def yuv420p_frames(av, rgb: np.ndarray) -> list:
    """uint8 F,H,W,3 (H and W even) -> yuv420p VideoFrames, the frames converted side by side.

    Why: the encoder would convert each RGB frame itself (FFmpeg's swscale, bit for bit the same
    frame as here), one at a time on the thread that encodes. That conversion is single-threaded
    where x264 is not: 3.5-5 ms of a 480x832 frame on a 2-core EPYC, about a quarter of the frame's
    encode there. swscale runs without the interpreter lock, so the frames of a group convert at
    once on a few threads: a 4-frame group went from 58.4 to 47.4 ms there (2026-11-30). On a
    16-core H200 host it made no difference (16.1 ms against 15.7)."""
    global _yuv_pool
    frames = [np.ascontiguousarray(frame) for frame in rgb]
    if len(frames) < 2:
        return [_yuv420p(av, frame) for frame in frames]
    with _yuv_lock:
        if _yuv_pool is None:
            _yuv_pool = ThreadPoolExecutor(YUV_THREADS, thread_name_prefix="convserve-yuv")
    return list(_yuv_pool.map(lambda frame: _yuv420p(av, frame), frames))


def mp4_bytes(frames01: np.ndarray, fps: float, crf: int = 20, preset: str = "veryfast", threads: int = 0,
              cabac: str = "on") -> bytes:
    """F,H,W,3 in [0,1] -> H.264 MP4 (yuv420p, so odd sizes are padded to even by edge copy);
    threads: x264's (0: its own count); cabac: x264_options'."""
    av = load_av()
    rgb = to_uint8(frames01)
    f, h, w, _ = rgb.shape
    ph, pw = h + (h % 2), w + (w % 2)
    if (ph, pw) != (h, w):
        rgb = np.pad(rgb, ((0, 0), (0, ph - h), (0, pw - w), (0, 0)), mode="edge")
    # PyAV's mp4 muxer wants a seekable file to write the moov atom; a temp file keeps memory flat
    fd, path = tempfile.mkstemp(suffix=".mp4")
    os.close(fd)
    try:
        with av.open(path, mode="w", format="mp4") as container:
            codec = h264_codec(av)
            stream = container.add_stream(codec, rate=int(round(fps)))
            stream.width, stream.height, stream.pix_fmt = pw, ph, "yuv420p"
            stream.options = x264_options(codec, crf, preset, threads, cabac)
            for frame in yuv420p_frames(av, rgb):
                for packet in stream.encode(frame):
                    container.mux(packet)
            for packet in stream.encode():
                container.mux(packet)
        with open(path, "rb") as fh:
            return fh.read()
    finally:
        os.unlink(path)


def crf_for_quality(quality: int) -> int:
    """1..100 -> x264 CRF 51..0."""
    return int(round(51 - 51 * (max(1, min(100, quality)) / 100.0)))


def encode_videos(videos01: np.ndarray, fps: float, quality: int, preset: str = "veryfast",
                  threads: int = 0, cabac: str = "on") -> tuple[bytes, str]:
    """N,F,H,W,3 -> one MP4, or a zip of video_000.mp4, ... ; quality 1..100 maps to x264 CRF 51..0;
    preset, threads and cabac: x264's (the MP4_PRESET, MP4_THREADS and MP4_CABAC settings)."""
    crf = crf_for_quality(quality)
    if videos01.shape[0] == 1:
        return mp4_bytes(videos01[0], fps, crf, preset, threads, cabac), "video/mp4"
    return zip_bytes([(f"video_{i:03d}.mp4", mp4_bytes(v, fps, crf, preset, threads, cabac))
                      for i, v in enumerate(videos01)]), ZIP_MEDIA


def read_mp4_frames(data: bytes) -> np.ndarray:
    """Decode an MP4 back to uint8 F,H,W,3 (used by the CLI and tests)."""
    av = load_av()
    with av.open(io.BytesIO(data)) as container:
        return np.stack([fr.to_ndarray(format="rgb24") for fr in container.decode(video=0)])
