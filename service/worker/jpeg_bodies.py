"""JPEG bodies decoded in a model worker: a batch of encode requests' files (each in its front end's
arena, checked there by service/codecs/jpeg_header.py) -> the uint8 N,S,S,3 pixels the model's
uint8 path takes, on the device where the GPU's hardware JPEG engines can decode them.

Why: a front end's PIL decode of a 224x224 JPEG costs it 336-638 us of CPU, more than the rest of
a one-image request; NVIDIA's hardware JPEG engines (nvImageCodec's HW_GPU_ONLY backend) decoded
a batch of 32 on one H200 with 48 us of host CPU an image, PIL's pixels exactly
(benchmarks/service/gpu_jpeg.py --decode). In the service the front ends still decode by default
(JPEG_DECODE=frontend): with one image a request the worker's one interpreter, not the host's
cores, became the limit (service/settings.py has the figures).

Rules:
- Each body is judged on its own. One the device's decoder cannot decode (it returns nothing for
  it) is decoded by PIL on this host, as the front end would have; one neither can decode, or
  whose pixels are not S x S x 3, fails alone with invalid-input (a 422): its row is zeros and
  the rest of the batch runs.
- The engines decode straight into the rows of one array (nvImageCodec images wrapping them)
  where this nvImageCodec can (the probe finds out), else into images of their own, copied.
  They get only files whose header says the model's size: a row holds nothing bigger.
- The device's decode runs on a stream of the decoding thread's own (service/worker/jpeg_stage.py's
  thread), and an event is recorded after it (`ready`); the device thread's stream waits for that
  event before it reads the rows (`join`).
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
from ..codecs.jpeg_header import device_decodable_size
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
        self.direct = True  # decode_into decodes into the rows themselves (the probe decides)
        self._held: deque = deque()  # (event, arrays) until the work that reads them has run
        self._held_lock = threading.Lock()  # the decoding thread and the device thread both hold

    def probe(self) -> None:
        """Decode a known JPEG, straight into an array's rows where this nvImageCodec can (`direct`),
        else into images of its own; raises where the engines are absent or their pixels are not PIL's."""
        data, ref = _probe_jpeg()
        body = np.frombuffer(data, np.uint8)
        cp, why = self.cp, None
        for direct in (True, False):
            self.direct = direct
            try:
                out = cp.zeros((1, *ref.shape), np.uint8)
                if not self.decode_into([body], [out[0]])[0]:
                    why = "the hardware JPEG decoder gave no image (no JPEG engines on this GPU?)"
                    continue
                diff = int(np.abs(cp.asnumpy(out[0]).astype(np.int16) - ref.astype(np.int16)).max())
            except Exception as exc:  # this nvImageCodec cannot decode into a buffer of ours
                why = f"{exc.__class__.__name__}: {exc}"
                continue
            if diff <= self.PROBE_MAX_DIFF:
                return
            why = f"the hardware JPEG decoder's pixels are not PIL's (max diff {diff})"
        raise RuntimeError(why)

    def decode_into(self, bodies: list[np.ndarray], rows: list) -> list[bool]:
        """Decode each body into its row (a device array of its decoded shape, on the current
        stream); whether each was decoded. Direct: nvImageCodec decodes into the rows themselves
        (images wrapping them): no allocation and no copy an image, and fewer calls that let go of
        the interpreter lock, each of which may wait up to the switch interval to get it back.
        Else into images of its own, copied into the rows."""
        nvimgcodec, stream = self.nvimgcodec, self.cp.cuda.get_current_stream()
        streams = [nvimgcodec.CodeStream(b) for b in bodies]
        if self.direct:
            wrapped = [nvimgcodec.as_image(row, stream.ptr) for row in rows]
            got = self.decoder.decode(streams, images=wrapped, params=self.params, cuda_stream=stream.ptr)
            return [image is not None for image in got]
        got = self.decoder.decode(streams, params=self.params, cuda_stream=stream.ptr)
        ok = []
        for row, image in zip(rows, got):
            ok.append(image is not None and tuple(image.shape) == tuple(row.shape))
            if ok[-1]:
                row[...] = self.cp.asarray(image)
        self.hold([image for image in got if image is not None])
        return ok

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
        hw = self.hardware
        out = np.zeros((len(bodies), size, size, 3), np.uint8) if hw is None else hw.cp.empty(
            (len(bodies), size, size, 3), np.uint8)
        # the engines get only files whose header says size x size (the rows are that shape);
        # any other, and any they cannot decode, PIL decodes here
        fits = [i for i, b in enumerate(bodies) if hw is not None and device_decodable_size(b) == (size, size)]
        decoded: set[int] = set()
        if fits:
            try:
                ok = hw.decode_into([bodies[i] for i in fits], [out[i] for i in fits])
                decoded = {i for i, good in zip(fits, ok) if good}
            except Exception as exc:  # the whole call refused: every body goes to PIL
                log.warning("%s: the hardware JPEG decoder failed a batch of %d (%s: %s)", self.device,
                            len(fits), exc.__class__.__name__, exc)
        failures: dict[int, BadBody] = {}
        on_host = 0
        for i, body in enumerate(bodies):
            if i in decoded:
                continue
            try:
                px = open_image(body.tobytes(), size * size)
                if px.shape != (size, size, 3):
                    raise BadBody(f"the image is {px.shape[1]}x{px.shape[0]}; this model takes {size}x{size}")
            except (Problem, BadBody) as exc:
                failures[i] = exc if isinstance(exc, BadBody) else BadBody(exc.detail)
                if hw is not None:
                    out[i].fill(0)
                continue
            on_host += 1
            if hw is None:
                out[i] = px
            else:
                out[i].set(px)
        if decoded:
            metrics.IMAGE_DECODES.labels(model, "device").inc(len(decoded))
        if on_host:
            metrics.IMAGE_DECODES.labels(model, "worker-host").inc(on_host)
        return out, failures, (hw.hold([out]) if hw is not None else None)
