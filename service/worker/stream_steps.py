"""The stateful part of a streamed decode, kept in its model worker between the front end's
steps: the causal decoder's generator, stepped on the device thread (each step one frame group),
closed from any thread without waiting for a running step."""
from __future__ import annotations

import threading

from ..ipc.worker_errors import StreamClosed


class GeneratorSteps:
    """Steps a generator on the device thread; close() from another thread never waits for a
    running step: the device thread closes the generator when that step ends."""

    def __init__(self, gen):
        self._gen = gen
        self._lock = threading.Lock()
        self._running = False
        self._closed = False
        self.steps = 0

    def step(self, _inputs=None):
        with self._lock:
            if self._closed:
                raise StreamClosed("the stream has ended")
            self._running = True
        try:
            out = next(self._gen)
            self.steps += 1
            return out
        except StopIteration:  # never raise StopIteration into a future
            raise RuntimeError("the decode ended before its last frame group") from None
        finally:
            with self._lock:
                self._running = False
                release = self._closed
            if release:
                self._release()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            if self._running:
                return
        self._release()

    @property
    def released(self) -> bool:
        return self._gen is None

    def _release(self) -> None:
        gen, self._gen = self._gen, None
        if gen is not None:
            gen.close()  # GeneratorExit at its yield: the frame and its feature cache go
