"""Whether a connection has something to read now: the question both ends of a worker link ask
after each message, to take whatever else has arrived in one go (the model worker's I/O thread,
service/worker/model_worker.py; a front end's link thread, service/frontend/engine.py).

`Connection.poll()` builds a selector, registers the descriptor and closes it again on every
call; in the worker's I/O thread that cost as much as reading the message. A `Readable` keeps
one `poll` object per connection. Where `select.poll` is missing, it asks the connection."""
from __future__ import annotations

import select
from multiprocessing.connection import Connection


class Readable:
    __slots__ = ("_conn", "_poller")

    def __init__(self, conn: Connection):
        self._conn = conn
        self._poller = None
        if hasattr(select, "poll"):
            self._poller = select.poll()
            self._poller.register(conn.fileno(), select.POLLIN)

    def __call__(self) -> bool:
        """A message, or the end of the connection, is there to read now."""
        if self._poller is None:
            return self._conn.poll()
        return bool(self._poller.poll(0))
