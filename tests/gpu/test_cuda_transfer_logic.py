"""The CPU-side rules of the CUDA backend's block copies and host transfers
(convkernels/backends/cuda/transfer.py): when parts joined along an axis are contiguous blocks,
and that a transfer waits for its copy exactly once, also when it is dropped unread (its pinned
buffer must not go back to CuPy's pool while a copy may still write into it). Runs everywhere;
the op suite (tests/test_ops.py, concat and to_host_async) and tests/gpu/test_cuda_paths.py
check the copies themselves on a GPU."""
from __future__ import annotations

import gc

import numpy as np

from convkernels.backends.cuda.transfer import HostTransfer, axis_blocks


class Event:
    """Stands in for a CUDA event: counts the waits."""

    def __init__(self):
        self.waits = 0

    def synchronize(self):
        self.waits += 1


def test_parts_joined_along_an_axis_are_blocks_only_when_every_axis_before_is_one():
    assert axis_blocks((1, 6, 4, 5, 96), 1)      # one video's frames along time
    assert not axis_blocks((2, 6, 4, 5, 96), 1)  # two videos: each part is two runs
    assert axis_blocks((7, 3), 0)
    assert axis_blocks((1, 1, 8), 2)
    assert not axis_blocks((1, 2, 8), 2)


def test_a_transfer_waits_once_and_keeps_its_source_until_then():
    done, source, host = Event(), object(), np.zeros(3, np.float32)
    t = HostTransfer(host, done, source)
    assert t.result() is host and done.waits == 1
    assert t.result() is host and done.waits == 1  # already waited: no second wait
    assert t._source is None  # the device array is released once the copy is done
    del t
    gc.collect()
    assert done.waits == 1  # read, so dropping it waits no more


def test_a_transfer_dropped_unread_waits_for_its_copy():
    done = Event()
    t = HostTransfer(np.zeros(3, np.float32), done, object())
    del t
    gc.collect()
    assert done.waits == 1
