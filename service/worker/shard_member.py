"""A shard group's follower: the side of the workers of devices 1..N-1, which the
first device's worker leads (service/worker/shard_leader.py, whose docstring holds the group's rules and
messages). A follower keeps its communicators (one per group size, made when the leader asks), its
bands' streamed decodes, and decodes what the leader hands it on its own device thread, between
its other batches; any failure there ends this worker (shard_leader.end_group)."""
from __future__ import annotations

import numpy as np

from models import sharding

from ..ipc import worker_protocol as wp
from .shard_leader import end_group, pixels
from .stream_steps import GeneratorSteps

#: a row standing in the batcher for what a join or a stream's step has none of: the inputs of one
#: that takes no latents, the result of one that gives no pixels (the batcher splits every result
#: by rows). It never travels: those messages name no block for it.
_NO_ROWS = np.zeros((1, 1), np.uint8)


class ShardMember:
    """A follower's side: its communicators (one per group size, made when the leader asks) and
    the bands it decodes on its device thread."""

    def __init__(self, fault=None):
        self.fault = fault  # as ShardLeader's
        self.comm_cls = None  # comm_class(), set once the backend is up
        self.comms: dict[int, tuple[object, object]] = {}  # size -> (communicator, the leader's link)
        self.streams: dict[tuple, tuple] = {}  # (id(link), key) -> (link, GeneratorSteps)
        self.running_for = None  # the leader's link while a band runs

    def call_for(self, link, msg, models: dict, view):
        """A leader's message -> (inputs, the model call, its output blocks): a solo item for the
        device thread. view: the leader's arena, as this worker maps it."""
        if isinstance(msg, wp.ShardJoin):
            return _NO_ROWS, lambda x: self.join(link, msg), {}
        if isinstance(msg, wp.ShardDecode):
            hm = models[msg.model]
            return view.array(msg.input), lambda x: self.decode(link, hm, x, msg), {"out": msg.output}
        if isinstance(msg, wp.ShardStreamOpen):
            hm = models[msg.model]
            return view.array(msg.input), lambda x: self.stream_open(link, hm, x, msg), {}
        if isinstance(msg, wp.ShardStreamNext):
            return _NO_ROWS, lambda x: self.stream_next(link, msg), {"out": msg.output}
        raise ValueError(f"a shard leader's {type(msg).__name__} is no band")

    def join(self, link, msg: wp.ShardJoin) -> np.ndarray:
        try:
            if self.comm_cls is None:
                raise RuntimeError("this worker has no shard communicator (shard_groups / shard_comm)")
            comm = self.comm_cls.join(msg.uid, msg.rank, msg.size)
        except Exception as exc:  # the leader waits in its join
            end_group(f"joining rank {msg.rank} of a {msg.size}-shard group failed: {type(exc).__name__}: {exc}")
        self.comms[msg.size] = (comm, link)
        return _NO_ROWS

    def _comm(self, link, msg):
        entry = self.comms.get(msg.size)
        if entry is None or entry[1] is not link:  # the leader waits in its band for this one
            end_group(f"band {msg.rank}: no {msg.size}-shard group joined with this leader")
        comm = entry[0]
        return self.fault(comm, msg.rank) if self.fault is not None else comm

    def stream_open(self, link, hm, band: np.ndarray, msg: wp.ShardStreamOpen) -> np.ndarray:
        """A streamed decode's band: its generator, stepped by stream_next (nothing runs yet)."""
        try:
            gen = sharding.frame_groups_band(hm.model, self._comm(link, msg), np.array(band), msg.total_rows,
                                             uint8=msg.uint8)
        except Exception as exc:  # the leader waits for this answer, then in its first step
            end_group(f"band {msg.rank} of a stream failed to open: {type(exc).__name__}: {exc}")
        self.streams[(id(link), msg.stream)] = (link, GeneratorSteps(gen))
        return _NO_ROWS

    def stream_next(self, link, msg: wp.ShardStreamNext) -> np.ndarray:
        entry = self.streams.get((id(link), msg.stream))
        if entry is None:
            end_group(f"band {msg.rank}: no stream {msg.stream} from this leader")
        self.running_for = link
        try:
            out = entry[1].step()
        except Exception as exc:
            end_group(f"band {msg.rank} of frame group {msg.step} failed: {type(exc).__name__}: {exc}")
        finally:
            self.running_for = None
        return out  # uint8 from the device where the stream asked for it (stream_open)

    def stream_close(self, link, key) -> None:
        entry = self.streams.pop((id(link), key), None)
        if entry is not None:
            entry[1].close()

    def decode(self, link, hm, band: np.ndarray, msg: wp.ShardDecode) -> np.ndarray:
        comm = self._comm(link, msg)
        self.running_for = link
        try:
            out = sharding.decode_band(hm.model, comm, band, msg.total_rows, msg.clamp, msg.alpha)
        except Exception as exc:
            end_group(f"band {msg.rank} of {msg.size} failed: {type(exc).__name__}: {exc}")
        finally:
            self.running_for = None
        return pixels(out, msg.uint8)

    def link_closed(self, link) -> None:
        """A front end (perhaps a leader) went: its groups are over; mid-band, so is this worker."""
        if self.running_for is link:
            end_group("the shard leader went away mid-band")
        self.comms = {size: e for size, e in self.comms.items() if e[1] is not link}
        for key in [k for k, e in self.streams.items() if e[0] is link]:
            self.streams.pop(key)[1].close()
