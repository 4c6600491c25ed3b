"""JPEG bodies decoded in a model worker: a batch of encode requests' files (each in its front end's
arena, checked there by service/codecs/jpeg_header.py) -> the uint8 N,S,S,3 pixels the model's
uint8 path takes, on the device where the GPU's hardware JPEG engines can decode them.

Why: a front end's PIL decode of a 224x224 JPEG costs it 336-638 us of CPU, more than the rest of
a one-image request; NVIDIA's hardware JPEG engines (nvImageCodec's HW_GPU_ONLY backend) decoded
a batch of 32 on one H200 with 48 us of host CPU an image, PIL's pixels exactly
(benchmarks/service/gpu_jpeg.py --decode).

Rules:
- Each body is judged on its own. One the device's decoder cannot decode (it returns nothing for
  it) is decoded by PIL on this host, as the front end would have; one neither can decode, or
  whose pixels are not S x S x 3, fails alone with invalid-input (a 422): its row is zeros and
  the rest of the batch runs.
- The device's decode runs on a stream of the decoding thread's own (service/worker/jpeg_stage.py's
  thread): the decoded images are copied into one array there and an event recorded after it
  (`ready`); the device thread's stream waits for that event before it reads the rows (`join`).
- Device memory is not let go while a stream may still read it: nvImageCodec's images are held
  until the event after their copy has passed, and decoded rows until an event recorded after
  the device thread's join has passed (CuPy's pool would otherwise hand their blocks to the next
  decode on the decoding stream while the device's stream still reads them).
- Where the worker decodes with no hardware decoder (JPEG_DECODE=worker), PIL decodes on this
  host: the model call gets host pixels, as from the front end's arena.
"""
from __future__ import annotations

import contextlib
import io
import logging
import threading
from collections import deque

import numpy as np

from .. import metrics
from ..codecs.images import open_image
from ..problems import Problem

log = logging.getLogger("convserve.worker")


class BadBody(ValueError):
    """A body neither decoder could decode to the model's pixels (crosses as invalid-input: 422)."""


def _probe_jpeg() -> tuple[bytes, np.ndarray]:
    """A small photo-like baseline JPEG and PIL's pixels of it: what a hardware decoder must give."""
    from PIL import Image

    y, x = np.mgrid[0:48, 0:64]
    img = np.stack([(x * 4) % 256, (y * 5) % 256, ((x + y) * 3) % 256], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(img).save(buf, format="JPEG", quality=90)
    data = buf.getvalue()
    return data, open_image(data, 1 << 20)


class HardwareDecoder:
    """nvImageCodec's decoder on the GPU's JPEG engines only (no CPU Huffman stage: that would cost
    this process the CPU the front ends saved)."""

    #: a decode's pixels may differ from PIL's by the engines' rounding; the probe allows this much
    PROBE_MAX_DIFF = 2

    def __init__(self, cp, device_id: int):
        from nvidia import nvimgcodec

        self.cp, self.nvimgcodec = cp, nvimgcodec
        self.decoder = nvimgcodec.Decoder(device_id=device_id,
                                          backends=[nvimgcodec.Backend(nvimgcodec.BackendKind.HW_GPU_ONLY)])
        self.params = nvimgcodec.DecodeParams(apply_exif_orientation=False, color_spec=nvimgcodec.ColorSpec.SRGB)
        self.device_id = device_id
        self._held: deque = deque()  # (event, arrays) until the work that reads them has run
        self._held_lock = threading.Lock()  # the decoding thread and the device thread both hold

    def probe(self) -> None:
        """Decode a known JPEG; raises where the engines are absent or their pixels are not PIL's."""
        data, ref = _probe_jpeg()
        out = self.decode([np.frombuffer(data, np.uint8)])[0]
        if out is None:
            raise RuntimeError("the hardware JPEG decoder gave no image (no JPEG engines on this GPU?)")
        got = self.cp.asnumpy(self.cp.asarray(out))
        diff = int(np.abs(got.astype(np.int16) - ref.astype(np.int16)).max()) if got.shape == ref.shape else None
        if diff is None or diff > self.PROBE_MAX_DIFF:
            raise RuntimeError(f"the hardware JPEG decoder's pixels are not PIL's (shape {got.shape}, max diff {diff})")

    def decode(self, bodies: list[np.ndarray]) -> list:
        """Each body's decoded image (an nvImageCodec Image, a CUDA array) or None."""
        streams = [self.nvimgcodec.CodeStream(b) for b in bodies]
        stream = self.cp.cuda.get_current_stream()
        return list(self.decoder.decode(streams, params=self.params, cuda_stream=stream.ptr))

    def hold(self, arrays: list):
        """Keep `arrays` until the work queued so far on the current stream has run; that point's event."""
        event = self.cp.cuda.Event(disable_timing=True)
        event.record(self.cp.cuda.get_current_stream())
        with self._held_lock:
            while self._held and self._held[0][0].done:
                self._held.popleft()
            self._held.append((event, arrays))
        return event


class JpegBodies:
    """A worker's decoder of JPEG bodies (the rules above): hardware where present, else PIL."""

    def __init__(self, hardware: HardwareDecoder | None, device: str):
        self.hardware, self.device = hardware, device

    @classmethod
    def for_backend(cls, backend, setting: str, device: str) -> JpegBodies | None:
        """The worker's decoder for JPEG_DECODE=`setting`: auto decodes here only with a hardware
        decoder (None: the front ends decode), worker always (PIL without one), frontend never."""
        if setting == "frontend":
            return None
        hardware = None
        if getattr(backend, "name", None) == "cuda":
            try:
                hardware = HardwareDecoder(backend.cp, backend.device_id)
                hardware.probe()
            except Exception as exc:  # no nvImageCodec, no engines, or pixels not PIL's
                log.info("%s: JPEG bodies not decoded on the device (%s: %s)", device, exc.__class__.__name__, exc)
                hardware = None
        if hardware is None and setting == "auto":
            return None
        log.info("%s: JPEG bodies decoded here, %s", device, "on the GPU's JPEG engines" if hardware else "by PIL")
        return cls(hardware, device)

    @contextlib.contextmanager
    def on_own_stream(self):
        """The calling thread's device work (decodes, their copies) on a stream of its own."""
        if self.hardware is None:
            yield
            return
        cp = self.hardware.cp
        with cp.cuda.Device(self.hardware.device_id), cp.cuda.Stream(non_blocking=True):
            yield

    def join(self, rows: list, events: list):
        """Decoded device rows (1,S,S,3 each) -> one N,S,S,3 array on the current stream, after
        their decodes' events; the rows held until the join has run (the rules above)."""
        cp = self.hardware.cp
        stream = cp.cuda.get_current_stream()
        for event in {id(e): e for e in events if e is not None}.values():
            stream.wait_event(event)
        out = cp.concatenate(rows)  # a copy even of one row: the model may read it after the hold has passed
        self.hardware.hold(rows)
        return out

    def decode(self, model: str, bodies: list[np.ndarray], size: int) -> tuple[object, dict[int, BadBody], object]:
        """Bodies (1-D uint8 each) -> (N,size,size,3 uint8 pixels: on the device with a hardware
        decoder, else on the host; the failed bodies' rows zero, {index: why}, and the event the
        device pixels are ready at: None for host pixels)."""
        images: list = [None] * len(bodies)
        if self.hardware is not None:
            try:
                images = self.hardware.decode(bodies)
            except Exception as exc:  # the whole call refused: every body goes to PIL
                log.warning("%s: the hardware JPEG decoder failed a batch of %d (%s: %s)", self.device,
                            len(bodies), exc.__class__.__name__, exc)
        failures: dict[int, BadBody] = {}
        host: dict[int, np.ndarray] = {}
        for i, (body, image) in enumerate(zip(bodies, images)):
            if image is not None and tuple(image.shape) == (size, size, 3):
                continue
            images[i] = None
            try:
                px = open_image(body.tobytes(), size * size)
            except Problem as exc:
                failures[i] = BadBody(exc.detail)
                continue
            if px.shape != (size, size, 3):
                failures[i] = BadBody(f"the JPEG is {px.shape[1]}x{px.shape[0]}; this model takes {size}x{size}")
                continue
            host[i] = px
        on_device = len(bodies) - len(host) - len(failures)
        if on_device:
            metrics.IMAGE_DECODES.labels(model, "device").inc(on_device)
        if host:
            metrics.IMAGE_DECODES.labels(model, "worker-host").inc(len(host))
        if self.hardware is None:
            out = np.zeros((len(bodies), size, size, 3), np.uint8)
            for i, px in host.items():
                out[i] = px
            return out, failures, None
        cp = self.hardware.cp
        rows = [cp.asarray(image) if image is not None else
                cp.asarray(host[i]) if i in host else cp.zeros((size, size, 3), np.uint8)
                for i, image in enumerate(images)]
        out = cp.stack(rows)  # one copy kernel for the batch (its images stay held until it ran)
        ready = self.hardware.hold([im for im in images if im is not None])
        return out, failures, ready
