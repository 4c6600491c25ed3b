"""Fragmented MP4 (H.264) written one frame group at a time, for streamed video decode.

Every group becomes one fragment (moof + mdat) that starts with an IDR frame, and its bytes are
ready as soon as the group is encoded. FFmpeg's mp4 muxer cuts a fragment only when the *next*
packet arrives (frag_keyframe / frag_every_frame), and PyAV cannot call av_write_frame(NULL) to
flush it, so each group is muxed by its own short-lived muxer (movflags
frag_keyframe+empty_moov+default_base_moof, plus frag_discont so the fragment's decode time is
the frames' own timestamp, and fragment_index so sequence numbers run on). The first group's
output also carries the init segment (ftyp + moov); later groups keep only moof + mdat.
The encoder is one libx264 context for the whole clip, or several that take the groups in turn
(tune=zerolatency: one packet out per frame in, no B-frames), with SPS/PPS in-band on each IDR so
every group's muxer sees them."""
from __future__ import annotations

import io
import threading
import time
from fractions import Fraction
from typing import Callable

import numpy as np

from .images import to_uint8
from .video import crf_for_quality, h264_codec, load_av, x264_options, yuv420p_frames

#: top-level boxes kept from the first group's muxer output, then from every later one
_FIRST_KEEP = {"ftyp", "moov", "moof", "mdat"}
_LATER_KEEP = {"moof", "mdat"}


def top_level_boxes(data: bytes) -> list[tuple[str, bytes]]:
    """(type, whole box) for each top-level ISO-BMFF box; raises on a malformed size."""
    out, i = [], 0
    while i < len(data):
        size = int.from_bytes(data[i:i + 4], "big")
        kind = data[i + 4:i + 8].decode("latin-1")
        if size == 1:  # 64-bit largesize
            size = int.from_bytes(data[i + 8:i + 16], "big")
        if size < 8 or i + size > len(data):
            raise ValueError(f"malformed MP4 box {kind!r} of size {size} at byte {i}")
        out.append((kind, data[i:i + size]))
        i += size
    return out


class _Encoder:
    """One x264 context, its lock, and the index of the group it must encode next."""
    __slots__ = ("codec", "lock", "next_index")

    def __init__(self, codec, first_index: int):
        self.codec, self.lock, self.next_index = codec, threading.Lock(), first_index


class FragmentedMP4Writer:
    """add_group(frames01 (f,H,W,3) in [0,1]) -> bytes to send now. Odd sizes are padded to even
    by edge copy (yuv420p), as in video.mp4_bytes.

    With encoders=K, group i is encoded by x264 context i mod K, so K groups can be encoded side by
    side: each group starts with an IDR frame and depends on no other. Why: on a random-init
    decoder's noise-like frames veryfast took 35 ms a 4-frame 480x832 group on a 16-core host,
    about the Wan 2.1 decode's 37.5, so one context set the clip's pace. group_job() fixes a
    group's place (index, timestamps, context) and must be called in group order; the job it
    returns may run on any thread, at the same time as the jobs of other contexts. One context's
    jobs must run in group order, one at a time: a caller keeps at most K jobs running and starts
    them in group order (a job out of its context's order raises)."""

    def __init__(self, width: int, height: int, fps: float, quality: int = 90, preset: str = "veryfast",
                 threads: int = 0, encoders: int = 1, cabac: str = "on"):
        """preset: x264's speed preset; threads: each encoder's (0: x264's own choice, by cores);
        encoders: x264 contexts taking the groups in turn; cabac: the entropy coder
        (video.x264_options). benchmarks/service/video_encoder.py measures them."""
        av = self._av = load_av()
        self.width, self.height = width, height
        self.coded_width, self.coded_height = width + width % 2, height + height % 2
        self.rate = Fraction(fps).limit_denominator(1001)
        name = h264_codec(av)
        options = {**x264_options(name, crf_for_quality(quality), preset, 0, cabac), "tune": "zerolatency",
                   "forced-idr": "1"}

        def context(threads: int, first_index: int) -> _Encoder:
            enc = av.CodecContext.create(name, "w")
            enc.width, enc.height, enc.pix_fmt = self.coded_width, self.coded_height, "yuv420p"
            enc.time_base, enc.framerate = 1 / self.rate, self.rate
            enc.options = {**options, **({"threads": str(threads)} if threads else {})}
            return _Encoder(enc, first_index)

        self._contexts = [context(threads, i) for i in range(max(1, encoders))]
        self.encoders = len(self._contexts)
        # The last group's encode is the one part of an answer that overlaps no decode: the
        # client waits for all of it. With several contexts it gets one of its own with all of
        # their threads (x264's zerolatency threads are slices of each frame: more of them make a
        # frame's encode shorter), since the others have (nearly) nothing left to do by then.
        self._tail = context(threads * self.encoders, 0) if self.encoders > 1 and threads else None
        self._frames = 0  # frames placed so far: the next group's first timestamp
        self._groups = 0  # groups placed so far

    def add_group(self, frames01: np.ndarray, last: bool = False) -> bytes:
        """The next group, encoded here and now."""
        return self.group_job(frames01, last)()

    def group_job(self, frames01: np.ndarray, last: bool = False) -> Callable[[], bytes]:
        """The next group's place now (call in group order); its encode and mux when the job runs."""
        index, first_pts = self._groups, self._frames
        self._groups += 1
        self._frames += int(frames01.shape[0])
        context = self._contexts[index % self.encoders]
        if last and self._tail is not None:
            context = self._tail
            context.next_index = index
        return lambda: self._encode(context, index, first_pts, frames01, last)

    def _encode(self, context: _Encoder, index: int, first_pts: int, frames01: np.ndarray, last: bool) -> bytes:
        av = self._av
        rgb = to_uint8(frames01)
        ph, pw = self.coded_height - self.height, self.coded_width - self.width
        if ph or pw:
            rgb = np.pad(rgb, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
        enc = context.codec
        packets = []
        with context.lock:
            if context.next_index != index:
                raise RuntimeError(f"frame group {index} reached its encoder before group {context.next_index}")
            context.next_index += self.encoders
            for i, vf in enumerate(yuv420p_frames(av, rgb)):
                vf.pts = first_pts + i
                if i == 0:  # each fragment starts with an IDR: decodable on its own
                    vf.pict_type = av.video.frame.PictureType.I
                packets += enc.encode(vf)
            if last:
                packets += enc.encode(None)
        if index == 1 and self._tail is not None:  # opened ahead, off the last group's time (2-6 ms)
            with self._tail.lock:
                if not self._tail.codec.is_open:
                    self._tail.codec.open()
        if not last and len(packets) != len(rgb):
            # zerolatency gives each frame's packet at once; a context that held one back would
            # leave it out of this group's fragment (and another context ahead of it in time)
            raise RuntimeError(f"x264 gave {len(packets)} packets for a group of {len(rgb)} frames")
        return self._fragment(index, packets)

    def _fragment(self, index: int, packets) -> bytes:
        if not packets:
            return b""
        av = self._av
        buf = io.BytesIO()
        options = {"movflags": "frag_keyframe+empty_moov+default_base_moof+frag_discont+skip_trailer",
                   "fragment_index": str(index + 1), "avoid_negative_ts": "disabled"}
        with av.open(buf, mode="w", format="mp4", options=options) as mux:
            stream = mux.add_mux_stream("h264", rate=self.rate, width=self.coded_width,
                                        height=self.coded_height)
            stream.time_base = self._contexts[0].codec.time_base
            for packet in packets:
                packet.stream = stream
                mux.mux(packet)
        keep = _FIRST_KEEP if index == 0 else _LATER_KEEP
        return b"".join(box for kind, box in top_level_boxes(buf.getvalue()) if kind in keep)


def warm() -> float:
    """Everything a first MP4 answer would load, loaded now: PyAV's import (FFmpeg's libraries, 156-208 ms
    on a 2-core Xeon), x264 opened and run on a frame, the MP4 muxer and its first fragment. Seconds it
    took. A front end serving a video decoder calls it once before its first MP4 answer
    (service/frontend/codec_warmup.py): every one of its MP4 answers waits for the first group's
    fragment, and that wait held the whole clip's frames back by the import."""
    start = time.perf_counter()
    y, x = np.mgrid[0:32, 0:48]
    frames = np.stack([(x * 5) % 256, (y * 7) % 256, (x + y) % 256], -1)[None].astype(np.float32) / 255
    FragmentedMP4Writer(48, 32, 16.0, threads=1).add_group(frames, last=True)
    return time.perf_counter() - start
