"""A shard group's follower: the side of the workers of devices 1..N-1, which the
first device's worker leads (service/shard_leader.py, whose docstring holds the group's rules and
messages). A follower keeps its communicators (one per group size, made when the leader asks), its
bands' streamed decodes, and decodes what the leader hands it on its own device thread, between
its other batches; any failure there ends this worker (shard_leader.end_group)."""
from __future__ import annotations

import numpy as np

from models import sharding

from .shard_leader import end_group, pixels
from .stream_steps import GeneratorSteps


class ShardMember:
    """A follower's side: its communicators (one per group size, made when the leader asks) and
    the bands it decodes on its device thread."""

    def __init__(self, fault=None):
        self.fault = fault  # as ShardLeader's
        self.comm_cls = None  # comm_class(), set once the backend is up
        self.comms: dict[int, tuple[object, object]] = {}  # size -> (communicator, the leader's link)
        self.streams: dict[tuple, tuple] = {}  # (id(link), key) -> (link, GeneratorSteps)
        self.running_for = None  # the leader's link while a band runs

    def join(self, link, options: dict) -> np.ndarray:
        size = int(options["size"])
        try:
            if self.comm_cls is None:
                raise RuntimeError("this worker has no shard communicator (shard_groups / shard_comm)")
            comm = self.comm_cls.join(options["uid"], int(options["rank"]), size)
        except Exception as exc:  # the leader waits in its join
            end_group(f"joining rank {options['rank']} of a {size}-shard group failed: {type(exc).__name__}: {exc}")
        self.comms[size] = (comm, link)
        return np.ones((1, 1), np.uint8)

    def _comm(self, link, options: dict):
        entry = self.comms.get(int(options["size"]))
        if entry is None or entry[1] is not link:  # the leader waits in its band for this one
            end_group(f"band {options['rank']}: no {options['size']}-shard group joined with this leader")
        comm = entry[0]
        return self.fault(comm, int(options["rank"])) if self.fault is not None else comm

    def stream_open(self, link, hm, band: np.ndarray, options: dict) -> np.ndarray:
        """A streamed decode's band: its generator, stepped by stream_next (nothing runs yet)."""
        try:
            gen = sharding.frame_groups_band(hm.model, self._comm(link, options), np.array(band),
                                             int(options["total_rows"]), uint8=bool(options["uint8"]))
        except Exception as exc:  # the leader waits for this answer, then in its first step
            end_group(f"band {options['rank']} of a stream failed to open: {type(exc).__name__}: {exc}")
        self.streams[(id(link), options["stream"])] = (link, GeneratorSteps(gen))
        return np.ones((1, 1), np.uint8)

    def stream_next(self, link, options: dict) -> np.ndarray:
        entry = self.streams.get((id(link), options["stream"]))
        if entry is None:
            end_group(f"band {options['rank']}: no stream {options['stream']} from this leader")
        self.running_for = link
        try:
            out = entry[1].step()
        except Exception as exc:
            end_group(f"band {options['rank']} of frame group {options['step']} failed: {type(exc).__name__}: {exc}")
        finally:
            self.running_for = None
        return out  # uint8 from the device where the stream asked for it (stream_open)

    def stream_close(self, link, key) -> None:
        entry = self.streams.pop((id(link), key), None)
        if entry is not None:
            entry[1].close()

    def decode(self, link, hm, band: np.ndarray, options: dict) -> np.ndarray:
        comm = self._comm(link, options)
        self.running_for = link
        try:
            out = sharding.decode_band(hm.model, comm, band, int(options["total_rows"]), bool(options["clamp"]))
        except Exception as exc:
            end_group(f"band {options['rank']} of {options['size']} failed: {type(exc).__name__}: {exc}")
        finally:
            self.running_for = None
        return pixels(out, bool(options["uint8"]))

    def link_closed(self, link) -> None:
        """A front end (perhaps a leader) went: its groups are over; mid-band, so is this worker."""
        if self.running_for is link:
            end_group("the shard leader went away mid-band")
        self.comms = {size: e for size, e in self.comms.items() if e[1] is not link}
        for key in [k for k, e in self.streams.items() if e[0] is link]:
            self.streams.pop(key)[1].close()
