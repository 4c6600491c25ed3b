"""How a video answer's frame groups become what is sent: one job per group, made on the event loop
in group order (a job fixes the group's place: its timestamps, its header) and run in the codec
pool. The sender (routes/frame_stream_response.py) keeps up to `parallel` jobs running and
sends their results in group order.

A job returns bytes of its own, or a list of parts that may view the group's block (the sender
holds the block until they have left)."""
from __future__ import annotations

import math
import struct
from typing import Callable, Protocol

import numpy as np

from .. import codecs
from ..codecs.fmp4 import FragmentedMP4Writer

MP4_MEDIA = "video/mp4"
NPY_STREAM_MEDIA = "application/x-npy-stream"
#: the .npy-stream record header: the record's byte length, 8-byte little-endian unsigned
RECORD_HEADER = struct.Struct("<Q")
#: the record that ends a complete .npy stream (length 0); a stream cut without it failed
END_RECORD = RECORD_HEADER.pack(0)

Job = Callable[[], "bytes | list"]


class GroupEncoder(Protocol):
    media_type: str
    #: jobs that may run at once
    parallel: int
    #: sent after the last group
    trailer: bytes

    def job(self, group: np.ndarray, last: bool) -> Job: ...


def npy_record(group: np.ndarray) -> list:
    """A group's record as parts: its length and .npy header, then its float32 data, a view of
    the group's block where it is float32 already (FrameStreamResponse holds the block until
    the view has left; joined here, the data was copied once more than the chunked send does)."""
    head, data = codecs.npy_parts(np.asarray(group, dtype=np.float32))
    return [RECORD_HEADER.pack(len(head) + len(data)) + head, data]


class NpyRecords:
    """The streamed .npy answer: a record per group, then the end record."""
    media_type, parallel, trailer = NPY_STREAM_MEDIA, 1, END_RECORD

    def job(self, group: np.ndarray, last: bool) -> Job:
        return lambda: npy_record(group)


class NpyFile:
    """One .npy file of the whole clip (N,F,H,W,3 of `dtype`), its header before the first group."""
    media_type, parallel, trailer = codecs.NPY_MEDIA, 1, b""

    def __init__(self, shape: tuple[int, ...], dtype: str):
        self.dtype = np.dtype(dtype)
        self.head = codecs.npy_header(shape, self.dtype)
        self.content_length = len(self.head) + math.prod(shape) * self.dtype.itemsize
        self.started = False

    def job(self, group: np.ndarray, last: bool) -> Job:
        # parts, not bytes: float32 frames are sent from the group's block itself (a view; the
        # response holds the block until they have left), float16 from their conversion
        parts = [] if self.started else [self.head]
        self.started = True
        return lambda: [*parts, codecs.npy_parts(np.asarray(group, dtype=self.dtype))[1]]


class Mp4Fragments:
    """Fragmented MP4 of one video (group N,f,H,W,3 with N = 1): a fragment per group, encoded by
    `encoders` x264 contexts in turn (codecs/fmp4.py), that many at once."""
    media_type, trailer = MP4_MEDIA, b""

    def __init__(self, width: int, height: int, fps: float, quality: int, *, preset: str, threads: int,
                 encoders: int, cabac: str = "on"):
        self.writer = FragmentedMP4Writer(width, height, fps, quality, preset=preset, threads=threads,
                                          encoders=encoders, cabac=cabac)
        self.parallel = self.writer.encoders

    def job(self, group: np.ndarray, last: bool) -> Job:
        return self.writer.group_job(group[0], last)


def mp4_fragments(shape: tuple[int, ...], fps: float, quality: int, settings) -> Mp4Fragments:
    """The MP4 encoder of a clip of `shape` (N,F,H,W,3) with the server's MP4 settings."""
    return Mp4Fragments(shape[3], shape[2], fps, quality, preset=settings.mp4_preset, threads=settings.mp4_threads,
                        encoders=settings.mp4_encoders, cabac=settings.mp4_cabac)
