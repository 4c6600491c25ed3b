"""Stopping a model call that nobody waits for any more, at its next tile or frame group.

A decode's tiles and a video's latent frames are natural stopping points: the state between
them is plain arrays, so leaving there wastes nothing that a retry would need. The caller (the
service's batcher) says, for the calls it makes on its thread, how to tell that the call's
requesters have all gone (`watching`); the tile and frame loops ask `check()`, which raises
`Abandoned` once they have. Outside `watching`, `check()` costs one attribute read. A shard of a
row-split decode never stops alone (models/nn/row_shard.py): the others would wait for it in their
next collective, so check() lets it run on."""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator

from . import row_shard


class Abandoned(Exception):
    """Every requester of the running model call has gone: it stopped at a tile or frame group."""


_local = threading.local()


@contextmanager
def watching(gone: Callable[[], bool]) -> Iterator[None]:
    """Model calls on this thread inside the block stop at their next check once `gone()`."""
    previous = getattr(_local, "gone", None)
    _local.gone = gone
    try:
        yield
    finally:
        _local.gone = previous


def check() -> None:
    gone = getattr(_local, "gone", None)
    if gone is not None and row_shard.current() is None and gone():
        raise Abandoned()
