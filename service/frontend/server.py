"""An HTTP front end: uvicorn with a graceful drain. The first SIGTERM/SIGINT makes /readyz false
and new requests 503 while the socket stays open (so clients see 503, not connection refused),
waits for in-flight work up to SHUTDOWN_GRACE_S, then exits 0. A second SIGINT forces the exit.
A front end whose parent (the supervisor) is gone drains and exits the same way."""
from __future__ import annotations

import logging
import os
import signal
import socket
import time
from typing import Callable

import uvicorn

from ..settings import Settings
from ..threads import lower_priority
from .pipeline import Service

log = logging.getLogger("convserve")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, service: Service, grace_s: float,
                 on_drain: Callable[[], None] | None = None, parent_pid: int | None = None):
        """on_drain: called once when a drain begins (the main front end passes SIGTERM on to the
        others); parent_pid: drain when that process is gone (an orphaned front end)."""
        super().__init__(config)
        self.service = service
        self.grace_s = grace_s
        self.on_drain = on_drain
        self.parent_pid = parent_pid
        self._drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame) -> None:
        # Runs as a signal handler on the event-loop thread: set flags only. Not recorded in
        # uvicorn's _captured_signals, so the signal is not re-raised after shutdown (exit 0).
        if self._drain_deadline is None:
            self._begin()
        elif sig == signal.SIGINT:
            self.should_exit = self.force_exit = True

    def _begin(self) -> None:
        self.service.draining = True
        self._drain_deadline = time.monotonic() + self.grace_s
        if self.on_drain is not None:
            self.on_drain()

    async def on_tick(self, counter: int) -> bool:
        if self._drain_deadline is None and self.parent_pid is not None and os.getppid() != self.parent_pid:
            log.warning("the supervisor is gone; draining")
            self._begin()
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


def run_frontend(settings: Settings, endpoints: list[tuple[str, str]], sockets: list[socket.socket],
                 *, on_drain: Callable[[], None] | None = None, parent_pid: int | None = None) -> None:
    """One HTTP front end on the shared listening socket(s), until it has drained."""
    lower_priority(settings.frontend_nice)  # this thread and those it starts: the front end's work
    from .app import create_app
    from .http.http_protocol import http_protocol_class

    app = create_app(settings, endpoints, accept_once_ready=parent_pid is not None)
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            http=http_protocol_class(settings.http), timeout_graceful_shutdown=5,
                            timeout_keep_alive=settings.keep_alive_s,
                            # h11's own bound on an unfinished head, set to ours: one limit under both parsers
                            h11_max_incomplete_event_size=settings.max_header_bytes)
    DrainingServer(config, app.state.service, settings.shutdown_grace_s, on_drain=on_drain,
                   parent_pid=parent_pid).run(sockets=sockets)


def frontend_main(settings: Settings, endpoints: list[tuple[str, str]], sockets: list[socket.socket],
                  parent_pid: int) -> None:
    """A further front end's process (multiprocessing, spawn); the supervisor starts it."""
    logging.basicConfig(level=settings.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s[frontend]: %(message)s")
    run_frontend(settings, endpoints, sockets, parent_pid=parent_pid)
