"""A shard communicator over torch.distributed's gloo (CPU), for tests: it joins the service's CPU
model workers into a real multi-process shard group, so the leader/follower protocol of
service/worker/shard_leader.py (connections, the join, bands out and pixels back, failures) runs without
GPUs, with an existing collective library in NCCL's place. Same interface as
convkernels.collectives.nccl.NcclShards: `unique_id()` on the leader, `join(uid, rank, size)` on every
rank, then exchange_rows / allreduce_sum / allgather on NumPy arrays.

A server loads it with CONVSERVE_SHARD_COMM=test-gloo and tests/ on PYTHONPATH
(tests/test_service_shards.py). torch is a test dependency, never a runtime one.
"""
from __future__ import annotations

import datetime
import os
import socket

import numpy as np
# imported with this module, which a worker loads as its backend comes up (comm_class): imported
# at a group's first join instead, the leader's and then the follower's import of torch (2-3 s
# each, one after the other) came first in every new group's first request
import torch
import torch.distributed as dist

#: the leader's TCPStore server: kept for the life of the process (its groups rendezvous there)
_STORES: dict[int, object] = {}
TIMEOUT = datetime.timedelta(seconds=120)
_UP, _DOWN = 0, 1  # message tags: rows travelling to the rank above, to the rank below


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class GlooShards:
    """One rank of a gloo group (see the module docstring)."""

    def __init__(self, pg, rank: int, size: int):
        self._torch, self._pg, self.rank, self.size = torch, pg, rank, size

    @staticmethod
    def unique_id() -> tuple:
        port = _free_port()
        _STORES[port] = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=TIMEOUT)
        return "127.0.0.1", port, os.urandom(8).hex()  # the prefix keeps each group's keys apart

    @classmethod
    def join(cls, uid: tuple, rank: int, size: int) -> "GlooShards":
        host, port, prefix = uid
        store = _STORES.get(port) or dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT)
        return cls(dist.ProcessGroupGloo(dist.PrefixStore(prefix, store), rank, size, TIMEOUT), rank, size)

    def _t(self, a):
        return self._torch.from_numpy(np.ascontiguousarray(a))

    def exchange_rows(self, top, bottom):
        works, above, below = [], None, None
        if self.rank > 0:
            above = self._torch.empty(tuple(top.shape), dtype=self._t(top).dtype)
            works += [self._pg.send([self._t(top)], self.rank - 1, _UP), self._pg.recv([above], self.rank - 1, _DOWN)]
        if self.rank < self.size - 1:
            below = self._torch.empty(tuple(bottom.shape), dtype=self._t(bottom).dtype)
            works += [self._pg.send([self._t(bottom)], self.rank + 1, _DOWN),
                      self._pg.recv([below], self.rank + 1, _UP)]
        for w in works:
            w.wait()
        return (None if above is None else above.numpy()), (None if below is None else below.numpy())

    def allreduce_sum(self, a):
        t = self._t(a).clone()
        self._pg.allreduce([t]).wait()
        return t.numpy()

    def allgather(self, a, lengths=None):
        """Every rank's array in rank order; shapes may differ (bands of unequal rows). The shapes
        travel anyway (lengths, where given, are not needed here)."""
        a = np.ascontiguousarray(a)
        shape = self._t(np.asarray(a.shape, np.int64))
        shapes = [self._torch.empty_like(shape) for _ in range(self.size)]
        self._pg.allgather([shapes], [shape]).wait()
        sizes = [int(np.prod(s.numpy())) for s in shapes]
        flat = np.zeros(max(sizes), a.dtype)
        flat[:a.size] = a.reshape(-1)
        outs = [self._torch.empty(max(sizes), dtype=self._t(flat).dtype) for _ in range(self.size)]
        self._pg.allgather([outs], [self._t(flat)]).wait()
        return [o.numpy()[:n].reshape(tuple(s.numpy())) for o, n, s in zip(outs, sizes, shapes)]
