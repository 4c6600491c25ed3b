"""Encode requests' JPEG files decoded ahead of the batcher, on a thread of the model worker's own
(service/worker/jpeg_bodies.py decodes; this module owns the thread and the hand-off).

Why a thread of its own: nvImageCodec's decode waits, on the thread that calls it, until the JPEG
engines are done, and costs ~50 us of host CPU an image besides. Decoded on the device thread (one
H200, 2026-11-30: ConvNeXt-T, one 224x224 JPEG a request), that thread fed the GPU 4,781-4,997
images a second against 5,972-7,728 for uint8 .npy bodies in the same runs: the wait and the
per-image work were the device thread's.

Rules:
- A front end's encode_jpeg requests come here first (FrontendLink._admit), are decoded together
  with whatever else has come meanwhile (up to a batch), and then go to the batcher as ordinary
  uint8 encode requests whose inputs are their decoded rows: they batch with uint8 .npy requests
  on the host path, and with each other on the device path.
- A request whose file fails to decode is answered from here (the delivery thread), alone.
- A request withdrawn while here (Cancel) is dropped here, not decoded.
- Device rows carry an event recorded after their decode (WorkItem.ready): the device thread's
  stream waits for it before reading them (JpegBodies.join).
"""
from __future__ import annotations

import logging
import queue
from collections import defaultdict
from typing import Callable

from .. import threads
from .jpeg_bodies import JpegBodies
from .work_item import WorkItem

log = logging.getLogger("convserve.worker")


class JpegStage:
    """The decode thread in front of the batcher (the rules above)."""

    def __init__(self, bodies: JpegBodies, submit: Callable[[list[WorkItem]], None],
                 deliver: Callable[[list[WorkItem]], None], max_batch: int, name: str):
        self.bodies, self.submit_decoded, self.deliver, self.max_batch = bodies, submit, deliver, max_batch
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threads.start(self._loop, f"convserve-jpeg-{name}")

    def submit(self, items: list[WorkItem]) -> None:
        self._queue.put(items)

    def stop(self) -> None:
        self._queue.put(None)

    def _take(self) -> list[WorkItem] | None:
        """What has come: at least one item, then whatever else is queued, up to max_batch."""
        first = self._queue.get()
        if first is None:
            return None
        items = list(first)
        while len(items) < self.max_batch:
            try:
                more = self._queue.get_nowait()
            except queue.Empty:
                break
            if more is None:
                self._queue.put(None)
                break
            items.extend(more)
        return items

    def _loop(self) -> None:
        with self.bodies.on_own_stream():
            while True:
                items = self._take()
                if items is None:
                    return
                by_model: dict[str, list[WorkItem]] = defaultdict(list)
                for item in items:
                    if not item.cancelled:
                        by_model[item.model].append(item)
                for group in by_model.values():
                    try:
                        self._decode(group)
                    except Exception as exc:  # noqa: BLE001 - the group's requests get it, the thread goes on
                        log.exception("decoding a group of %d JPEG files failed", len(group))
                        for item in group:
                            item.outcome.set(None, exc)
                        self.deliver(group)

    def _decode(self, group: list[WorkItem]) -> None:
        call = group[0].call
        size = call.jpeg_size
        pixels, failures, ready = self.bodies.decode(group[0].model, [it.inputs[0] for it in group], size)
        decoded, failed = [], []
        for i, item in enumerate(group):
            if i in failures:
                item.outcome.set(None, failures[i])
                failed.append(item)
                continue
            item.inputs, item.ready, item.call, item.host_address = pixels[i:i + 1], ready, call.decoded, 0
            # an encode of uint8 pixels' key (FrontendLink._item): host rows batch with .npy
            # requests' rows, device rows only with each other
            item.key = (item.model, "encode", item.inputs.shape[1:], "|u1", item.key[-1]) + (
                ("device",) if ready is not None else ())
            decoded.append(item)
        if failed:
            self.deliver(failed)
        if decoded:
            try:
                self.submit_decoded(decoded)
            except Exception as exc:  # noqa: BLE001 - a stopped batcher: nothing of them runs
                for item in decoded:
                    item.outcome.set(None, exc)
                self.deliver(decoded)
