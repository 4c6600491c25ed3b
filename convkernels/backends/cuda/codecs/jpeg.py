"""JPEG files decoded on the GPU's hardware JPEG engines through nvImageCodec (`nvidia-nvimgcodec-cu13`,
the cuda-jpeg extra): the device half of the service's encode bodies (service/worker/jpeg_bodies.py
decides which files come here, and decodes the rest with PIL).

Rules:
- Only the engines decode (HW_GPU_ONLY): a CPU Huffman stage would cost the caller's process the
  CPU its decode was moved to save.
- Files are decoded straight into the rows of one device array (nvImageCodec images wrapping them)
  where this nvImageCodec can (`direct`; the caller's probe decides), else into images of its own,
  copied into the rows. A row holds exactly one decoded file: callers send only files whose header
  says the row's size.
- Work runs on the calling thread's current stream; `ready` records the event after it, and `join`
  makes the current stream wait for such events before it reads the rows.
- Device memory is not let go while a stream may still read it: nvImageCodec's images and joined
  rows are held until an event recorded after their last reader has passed (CuPy's pool would
  otherwise hand their blocks to the next decode on another stream while one still reads them).
- EXIF orientation is ignored, as PIL's decode in the service ignores it.
"""
from __future__ import annotations

import contextlib
import threading
from collections import deque

import numpy as np


class HardwareJpeg:
    """The engines' decoder for one device (the rules above)."""

    def __init__(self, cp, device_id: int):
        from nvidia import nvimgcodec

        self.cp, self.nvimgcodec, self.device_id = cp, nvimgcodec, device_id
        self.decoder = nvimgcodec.Decoder(device_id=device_id,
                                          backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)])
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB)
        self.direct = True  # decode_into decodes into the rows themselves (the caller's probe decides)
        self._held: deque = deque()  # (event, arrays) until the work that reads them has run
        self._held_lock = threading.Lock()  # the decoding thread and the device thread both hold

    def new_rows(self, n: int, height: int, width: int):
        """Device rows for n decoded files, uint8 n,height,width,3 (on the current stream)."""
        return self.cp.empty((n, height, width, 3), np.uint8)

    def decode_into(self, bodies: list[np.ndarray], out, rows: list[int]) -> list[bool]:
        """Decode bodies[k] into out[rows[k]]; whether each was decoded. Direct: no allocation and no
        copy an image, and fewer calls that let go of the interpreter lock, each of which may wait
        up to the switch interval to get it back."""
        nvimgcodec, stream = self.nvimgcodec, self.cp.cuda.get_current_stream()
        streams = [nvimgcodec.CodeStream(b) for b in bodies]
        if self.direct:
            wrapped = [nvimgcodec.as_image(out[r], stream.ptr) for r in rows]
            got = self.decoder.decode(streams, images=wrapped, params=self.params, cuda_stream=stream.ptr)
            return [image is not None for image in got]
        got = self.decoder.decode(streams, params=self.params, cuda_stream=stream.ptr)
        ok = []
        for r, image in zip(rows, got):
            ok.append(image is not None and tuple(image.shape) == tuple(out.shape[1:]))
            if ok[-1]:
                out[r] = self.cp.asarray(image)
        self._hold([image for image in got if image is not None])
        return ok

    def set_row(self, out, row: int, pixels: np.ndarray | None) -> None:
        """out[row] = host pixels (a file decoded elsewhere), or zeros for None (one that failed)."""
        if pixels is None:
            out[row].fill(0)
        else:
            out[row].set(pixels)

    def ready(self, out):
        """The event the rows are ready at, on the current stream; the rows held until then."""
        return self._hold([out])

    def join(self, rows: list, events: list):
        """Decoded rows (1,H,W,3 each, from any thread's stream) -> one N,H,W,3 array on the current
        stream, after their `ready` events; the rows held until the join has run."""
        stream = self.cp.cuda.get_current_stream()
        for event in {id(e): e for e in events if e is not None}.values():
            stream.wait_event(event)
        out = self.cp.concatenate(rows)  # a copy even of one row: the model may read it after the hold has passed
        self._hold(rows)
        return out

    def to_host(self, x) -> np.ndarray:
        return self.cp.asnumpy(x)

    @contextlib.contextmanager
    def own_stream(self):
        """The calling thread's work here (decodes, their copies) on a stream of its own."""
        with self.cp.cuda.Device(self.device_id), self.cp.cuda.Stream(non_blocking=True):
            yield

    def _hold(self, arrays: list):
        """Keep `arrays` until the work queued so far on the current stream has run; that point's event."""
        event = self.cp.cuda.Event(disable_timing=True)
        event.record(self.cp.cuda.get_current_stream())
        with self._held_lock:
            while self._held and self._held[0][0].done:
                self._held.popleft()
            self._held.append((event, arrays))
        return event
