"""The ShardComm of real devices: one rank per process, one GPU each, joined by NCCL through
CuPy's `cupy.cuda.nccl`. It has the collectives shard_comm.ThreadShards emulates,
with the same semantics, so the sharded model code tested on the CPU runs here unchanged.

Rules it keeps:
- every rank calls the same collectives in the same order (NCCL's own rule; the sharded
  decoders do, since every shard runs the same layers);
- each call is queued on the caller's current CuPy stream, the stream the CUDA backend queues
  its kernels on, so no host synchronisation is added: the exchange runs between the kernels
  that produce and consume it;
- exchanges and gathers move bytes (any storage dtype, bfloat16's uint16 bit patterns too);
  only all-reduce does arithmetic, on float64/float32/float16;
- a host (NumPy) array given to all_reduce comes back as a host array (the scalar counts of
  sharded_ops.exact_group_norm).

Setting up: the parent makes `NcclShards.unique_id()` and hands it to every rank's process,
which calls `NcclShards.join(uid, rank, size)` with its GPU current.
"""
from __future__ import annotations

import numpy as np

_REDUCE_TYPES = {np.dtype(np.float64): "NCCL_FLOAT64", np.dtype(np.float32): "NCCL_FLOAT32",
                 np.dtype(np.float16): "NCCL_FLOAT16"}


def _nccl():
    from cupy.cuda import nccl
    return nccl


class NcclShards:
    """One rank of a group of processes joined by NCCL (see the module docstring)."""

    def __init__(self, comm, rank: int, size: int):
        import cupy as cp
        self._cp, self._comm, self.rank, self.size = cp, comm, rank, size

    @staticmethod
    def unique_id() -> bytes | tuple:
        """The group's id, made once by whoever starts the ranks: bytes in CuPy 14 (a tuple of ints
        in older CuPy); `join` wants it back unchanged."""
        return _nccl().get_unique_id()

    @classmethod
    def join(cls, uid: bytes | tuple, rank: int, size: int) -> "NcclShards":
        """This process's rank, on its current GPU; returns once every rank has joined."""
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} outside a group of {size}")
        return cls(_nccl().NcclCommunicator(size, uid, rank), rank, size)

    def close(self) -> None:
        if self._comm is not None:
            self._comm.destroy()
            self._comm = None

    def _stream(self) -> int:
        return self._cp.cuda.get_current_stream().ptr

    def exchange_rows(self, top, bottom):
        """Send `top` to the rank above and `bottom` to the rank below; receive the neighbours'
        edge rows (the same shapes: equal batch, width and channels on every shard)."""
        cp, nccl = self._cp, _nccl()
        top, bottom = cp.ascontiguousarray(top), cp.ascontiguousarray(bottom)
        above = cp.empty_like(top) if self.rank > 0 else None
        below = cp.empty_like(bottom) if self.rank < self.size - 1 else None
        stream, byte = self._stream(), nccl.NCCL_INT8
        nccl.groupStart()
        try:
            if above is not None:
                self._comm.send(top.data.ptr, top.nbytes, byte, self.rank - 1, stream)
                self._comm.recv(above.data.ptr, above.nbytes, byte, self.rank - 1, stream)
            if below is not None:
                self._comm.send(bottom.data.ptr, bottom.nbytes, byte, self.rank + 1, stream)
                self._comm.recv(below.data.ptr, below.nbytes, byte, self.rank + 1, stream)
        finally:
            nccl.groupEnd()
        return above, below

    def allreduce_sum(self, a):
        cp, nccl = self._cp, _nccl()
        host = isinstance(a, np.ndarray)
        x = cp.ascontiguousarray(cp.asarray(a))
        kind = _REDUCE_TYPES.get(x.dtype)
        if kind is None:
            raise TypeError(f"all-reduce sums float64, float32 or float16 arrays, got {x.dtype}")
        out = cp.empty_like(x)
        self._comm.allReduce(x.data.ptr, out.data.ptr, x.size, getattr(nccl, kind), nccl.NCCL_SUM, self._stream())
        return out.get() if host else out

    def allgather(self, a, lengths=None):
        """Every rank's `a`, in rank order. Shards may differ along axis 1 (uneven row bands):
        each array travels padded to the longest. `lengths` (every rank's size on axis 1) where the
        caller knows them, else they are gathered first: that asks the host to wait, which a
        recorded CUDA graph cannot do."""
        cp = self._cp
        a = cp.ascontiguousarray(a)
        if lengths is None:
            lengths = self._gather_bytes(cp.asarray(np.array([a.shape[1]], np.int64)), 8).view(np.int64).get()
        lengths = [int(n) for n in lengths]
        if lengths[self.rank] != a.shape[1]:
            raise ValueError(f"rank {self.rank} holds {a.shape[1]} along axis 1, told {lengths[self.rank]}")
        longest = max(lengths)
        padded = a
        if a.shape[1] < longest:
            padded = cp.zeros((a.shape[0], longest, *a.shape[2:]), a.dtype)
            padded[:, :a.shape[1]] = a
        every = self._gather_bytes(padded, padded.nbytes).view(a.dtype).reshape(self.size, *padded.shape)
        return [every[r][:, :lengths[r]] for r in range(self.size)]

    def _gather_bytes(self, x, nbytes: int):
        nccl = _nccl()
        out = self._cp.empty(self.size * nbytes, self._cp.int8)
        self._comm.allGather(x.data.ptr, out.data.ptr, nbytes, nccl.NCCL_INT8, self._stream())
        return out
