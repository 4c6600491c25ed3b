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
- The device half is the backend's (`jpeg_decoder()`, convkernels/backends/cuda/codecs/jpeg.py:
  nvImageCodec, its streams, events and held memory). This module probes it against PIL at start,
  decides which files go to it (only those whose header says the model's size: a row holds
  nothing bigger), decodes the rest with PIL, and counts where each was decoded.
- The device's decode runs on a stream of the decoding thread's own (service/worker/jpeg_stage.py's
  thread); the device thread's stream waits for its `ready` event before it reads the rows (`join`).
- Where the worker decodes with no hardware decoder (JPEG_DECODE=worker), PIL decodes on this
  host: the model call gets host pixels, as from the front end's arena.
"""
from __future__ import annotations

import contextlib
import io
import logging

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


#: a hardware decode's pixels may differ from PIL's by the engines' rounding; the probe allows this much
PROBE_MAX_DIFF = 2


def probe_decoder(hw) -> None:
    """Decode a known JPEG on the backend's decoder, straight into an array's rows where it can
    (`direct`), else into images of its own; raises where the engines are absent or their pixels
    are not PIL's."""
    data, ref = _probe_jpeg()
    body, why = np.frombuffer(data, np.uint8), None
    for direct in (True, False):
        hw.direct = direct
        try:
            out = hw.new_rows(1, *ref.shape[:2])
            if not hw.decode_into([body], out, [0])[0]:
                why = "the hardware JPEG decoder gave no image (no JPEG engines on this GPU?)"
                continue
            diff = int(np.abs(hw.to_host(out[0]).astype(np.int16) - ref.astype(np.int16)).max())
        except Exception as exc:  # this nvImageCodec cannot decode into a buffer of ours
            why = f"{exc.__class__.__name__}: {exc}"
            continue
        if diff <= PROBE_MAX_DIFF:
            return
        why = f"the hardware JPEG decoder's pixels are not PIL's (max diff {diff})"
    raise RuntimeError(why)


class JpegBodies:
    """A worker's decoder of JPEG bodies (the rules above): hardware where present, else PIL."""

    def __init__(self, hardware, device: str):
        """hardware: the backend's jpeg_decoder() (convkernels/backends/cuda/codecs/jpeg.py), probed; or None."""
        self.hardware, self.device = hardware, device

    @classmethod
    def for_backend(cls, backend, setting: str, device: str) -> JpegBodies | None:
        """The worker's decoder for JPEG_DECODE=`setting`: auto decodes here only with a hardware
        decoder (None: the front ends decode), worker always (PIL without one), frontend never."""
        if setting == "frontend":
            return None
        hardware = None
        try:
            hardware = backend.jpeg_decoder()
            if hardware is not None:
                probe_decoder(hardware)
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
        with self.hardware.own_stream():
            yield

    def join(self, rows: list, events: list):
        """Decoded device rows (1,S,S,3 each) -> one N,S,S,3 array on the current stream, after
        their decodes' events; the rows held until the join has run (the rules above)."""
        return self.hardware.join(rows, events)

    def decode(self, model: str, bodies: list[np.ndarray], size: int) -> tuple[object, dict[int, BadBody], object]:
        """Bodies (1-D uint8 each) -> (N,size,size,3 uint8 pixels: on the device with a hardware
        decoder, else on the host; the failed bodies' rows zero, {index: why}, and the event the
        device pixels are ready at: None for host pixels)."""
        hw = self.hardware
        out = np.zeros((len(bodies), size, size, 3), np.uint8) if hw is None else hw.new_rows(len(bodies), size, size)
        # the engines get only files whose header says size x size (the rows are that shape);
        # any other, and any they cannot decode, PIL decodes here
        fits = [i for i, b in enumerate(bodies) if hw is not None and device_decodable_size(b) == (size, size)]
        decoded: set[int] = set()
        if fits:
            try:
                ok = hw.decode_into([bodies[i] for i in fits], out, fits)
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
                    hw.set_row(out, i, None)
                continue
            on_host += 1
            if hw is None:
                out[i] = px
            else:
                hw.set_row(out, i, px)
        if decoded:
            metrics.IMAGE_DECODES.labels(model, "device").inc(len(decoded))
        if on_host:
            metrics.IMAGE_DECODES.labels(model, "worker-host").inc(on_host)
        return out, failures, (hw.ready(out) if hw is not None else None)
