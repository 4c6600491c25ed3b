"""uvicorn with a graceful drain: the first SIGTERM/SIGINT makes /readyz false and new requests
503 while the socket stays open (so clients see 503, not connection refused), waits for in-flight
work up to SHUTDOWN_GRACE_S, then exits 0. A second SIGINT forces the exit."""
from __future__ import annotations

import logging
import signal
import time

import uvicorn

from .pipeline import Service

log = logging.getLogger("convserve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service, grace_s: float):
        super().__init__(config)
        self.service = service
        self.grace_s = grace_s
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # Runs as a signal handler on the event-loop thread: set flags only. Not recorded in
        # uvicorn's _captured_signals, so the signal is not re-raised after shutdown (exit 0).
        if self._drain_deadline is None:
            self.service.draining = True
            self._drain_deadline = time.monotonic() + self.grace_s
        elif sig == signal.SIGINT:
            self.should_exit = self.force_exit = True

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is not None and not self.should_exit:
            self.service.begin_drain()
            if self.service.idle():
                log.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() >= self._drain_deadline:
                log.warning("grace period over with %d request(s) in flight; shutting down",
                            self.service.inflight)
                self.should_exit = True
        return await super().on_tick(counter)
