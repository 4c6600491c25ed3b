"""Fragmented MP4 (H.264) written one frame group at a time, for streamed video decode.

Every group becomes one fragment (moof + mdat) that starts with an IDR frame, and its bytes are
ready as soon as the group is encoded. FFmpeg's mp4 muxer cuts a fragment only when the *next*
packet arrives (frag_keyframe / frag_every_frame), and PyAV cannot call av_write_frame(NULL) to
flush it, so each group is muxed by its own short-lived muxer (movflags
frag_keyframe+empty_moov+default_base_moof, plus frag_discont so the fragment's decode time is
the frames' own timestamp, and fragment_index so sequence numbers run on). The first group's
output also carries the init segment (ftyp + moov); later groups keep only moof + mdat.
The encoder is one libx264 context for the whole clip (tune=zerolatency: one packet out per
frame in, no B-frames), with SPS/PPS in-band on each IDR so every group's muxer sees them."""
from __future__ import annotations

import io
from fractions import Fraction

import numpy as np

from .images import to_uint8
from .video import crf_for_quality, load_av, yuv420p_frames

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


class FragmentedMP4Writer:
    """add_group(frames01 (f,H,W,3) in [0,1]) -> bytes to send now. Odd sizes are padded to even
    by edge copy (yuv420p), as in video.mp4_bytes. Not thread-safe: one group at a time."""

    def __init__(self, width: int, height: int, fps: float, quality: int = 90, preset: str = "veryfast",
                 threads: int = 0):
        """preset: x264's speed preset; threads: the encoder's (0: x264's own choice, by cores).
        benchmarks/service/video_encoder.py measures both."""
        av = self._av = load_av()
        self.width, self.height = width, height
        self.coded_width, self.coded_height = width + width % 2, height + height % 2
        self.rate = Fraction(fps).limit_denominator(1001)
        name = "libx264" if "libx264" in av.codecs_available else "h264"
        enc = av.CodecContext.create(name, "w")
        enc.width, enc.height, enc.pix_fmt = self.coded_width, self.coded_height, "yuv420p"
        enc.time_base, enc.framerate = 1 / self.rate, self.rate
        enc.options = {"crf": str(crf_for_quality(quality)), "preset": preset, "tune": "zerolatency",
                       "forced-idr": "1", **({"threads": str(threads)} if threads else {})}
        self._enc = enc
        self._frames = 0
        self._groups = 0

    def add_group(self, frames01: np.ndarray, last: bool = False) -> bytes:
        av = self._av
        rgb = to_uint8(frames01)
        ph, pw = self.coded_height - self.height, self.coded_width - self.width
        if ph or pw:
            rgb = np.pad(rgb, ((0, 0), (0, ph), (0, pw), (0, 0)), mode="edge")
        packets = []
        for i, vf in enumerate(yuv420p_frames(av, rgb)):
            vf.pts = self._frames
            self._frames += 1
            if i == 0:  # each fragment starts with an IDR: decodable on its own
                vf.pict_type = av.video.frame.PictureType.I
            packets += self._enc.encode(vf)
        if last:
            packets += self._enc.encode(None)
        return self._fragment(packets)

    def _fragment(self, packets) -> bytes:
        if not packets:
            return b""
        av = self._av
        buf = io.BytesIO()
        options = {"movflags": "frag_keyframe+empty_moov+default_base_moof+frag_discont+skip_trailer",
                   "fragment_index": str(self._groups + 1), "avoid_negative_ts": "disabled"}
        with av.open(buf, mode="w", format="mp4", options=options) as mux:
            stream = mux.add_mux_stream("h264", rate=self.rate, width=self.coded_width,
                                        height=self.coded_height)
            stream.time_base = self._enc.time_base
            for packet in packets:
                packet.stream = stream
                mux.mux(packet)
        keep = _FIRST_KEEP if self._groups == 0 else _LATER_KEEP
        self._groups += 1
        return b"".join(box for kind, box in top_level_boxes(buf.getvalue()) if kind in keep)
