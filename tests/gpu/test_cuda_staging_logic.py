"""The CPU-side rules of the CUDA backend's pinned staging (convkernels/backends/cuda/transfer.py, PinnedStaging),
with a stand-in for CuPy whose "device" copies are host memmoves: a taken buffer has the shape
asked for and is uploaded as it is; a buffer is handed out again only after its last upload was
waited for; anything not taken, too large or empty is not staged. And ParallelUpload (large pageable arrays
copied into pinned memory in parts, on threads): exact, its buffer rewritten only after its last upload was
waited for, small or strided arrays not taken. Runs everywhere; the upload on a
real GPU is tests/gpu/test_convnext_started_gpu.py's."""
from __future__ import annotations

import ctypes
import sys
import types

import numpy as np
import pytest

from convkernels.backends.cuda.transfer import PinnedStaging


class _Event:
    log: list = []

    def __init__(self, **kw):
        self.waited = False

    def record(self, stream):
        _Event.log.append(("record", self))

    def synchronize(self):
        self.waited = True
        _Event.log.append(("wait", self))


class _DeviceArray:
    def __init__(self, shape, dtype):
        self.host = np.zeros(shape, dtype)
        self.shape, self.dtype = self.host.shape, self.host.dtype
        self.data = types.SimpleNamespace(ptr=self.host.ctypes.data)


def _fake_cupy():
    runtime = types.SimpleNamespace(memcpyHostToDevice=1,
                                    memcpyAsync=lambda dst, src, n, kind, stream: ctypes.memmove(dst, src, n))
    cuda = types.SimpleNamespace(Event=_Event, runtime=runtime,
                                 get_current_stream=lambda: types.SimpleNamespace(ptr=0))
    return types.SimpleNamespace(cuda=cuda, empty=lambda shape, dtype: _DeviceArray(shape, dtype))


@pytest.fixture
def staging(monkeypatch):
    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda n, dtype: np.zeros(n, dtype)))
    _Event.log = []
    return PinnedStaging(_fake_cupy(), slots=2, max_slot_bytes=1 << 22)


def test_a_taken_buffer_is_uploaded_as_it_is(staging):
    host = staging.take((3, 5, 7, 3), np.uint8)
    assert host.shape == (3, 5, 7, 3) and host.dtype == np.uint8
    host[...] = np.arange(host.size, dtype=np.uint8).reshape(host.shape)
    dev = staging.upload(host)
    np.testing.assert_array_equal(dev.host, host)
    assert staging.upload(np.ascontiguousarray(host.copy())) is None  # not one of its buffers
    assert staging.upload(host[1:]) is None  # a view elsewhere in one is not a taken buffer


def test_a_buffer_comes_round_again_only_after_its_upload_was_waited_for(staging):
    a = staging.take((4, 8), np.float32)
    staging.upload(a)
    first_upload = _Event.log[-1][1]
    b = staging.take((4, 8), np.float32)  # the second slot: nothing to wait for
    assert not first_upload.waited
    staging.upload(b)
    again = staging.take((4, 8), np.float32)  # the first slot again: its upload is waited for first
    assert first_upload.waited and again.ctypes.data == a.ctypes.data
    assert staging.take((4, 8), np.float32).ctypes.data == b.ctypes.data


def test_a_larger_batch_gets_a_larger_buffer_and_the_old_one_is_forgotten(staging):
    small = staging.take((2, 4), np.float32)
    old = small.ctypes.data
    staging.take((1,), np.float32)
    big = staging.take((1 << 16, 4), np.float32)  # slot 0 again, too small now
    assert big.nbytes == (1 << 16) * 4 * 4
    assert staging.upload(big) is not None
    if big.ctypes.data != old:
        fake = np.frombuffer((ctypes.c_char * 32).from_address(old), np.float32).reshape(2, 4)
        assert staging.upload(fake) is None


def test_too_large_or_empty_batches_are_not_staged(staging):
    assert staging.take((1 << 21, 4), np.float32) is None  # 32 MiB over the 4 MiB bound
    assert staging.take((0, 3), np.float32) is None


# ---- ParallelUpload: large pageable arrays copied to pinned memory in parts, on threads ------------
@pytest.fixture
def parallel(monkeypatch):
    from convkernels.backends.cuda import transfer

    monkeypatch.setitem(sys.modules, "cupyx", types.SimpleNamespace(empty_pinned=lambda n, dtype: np.zeros(n, dtype)))
    monkeypatch.setattr(transfer, "MIN_BYTES", 1 << 12)
    monkeypatch.setattr(transfer, "PART_BYTES", 1 << 12)  # many parts of an odd-sized array
    _Event.log = []
    return transfer.ParallelUpload(_fake_cupy(), threads=3)


def test_a_large_array_arrives_whole_and_exact(parallel):
    host = np.random.default_rng(0).standard_normal((7, 33, 17, 3)).astype(np.float32)  # 47 KiB: 12 parts
    assert parallel.takes(host)
    dev = parallel.upload(host)
    assert dev.shape == host.shape and dev.dtype == host.dtype
    np.testing.assert_array_equal(dev.host, host)
    other = np.arange(5 * 1031, dtype=np.float32).reshape(5, 1031)
    np.testing.assert_array_equal(parallel.upload(other).host, other)  # the same buffer, rewritten


def test_the_buffer_is_rewritten_only_after_its_last_upload_was_waited_for(parallel):
    host = np.ones((4, 4096), np.float32)
    parallel.upload(host)
    first = _Event.log[-1][1]
    assert not first.waited
    parallel.upload(host)
    assert first.waited


def test_small_strided_or_single_threaded_arrays_are_not_taken(parallel):
    from convkernels.backends.cuda.transfer import ParallelUpload

    assert not parallel.takes(np.ones(16, np.float32))  # under MIN_BYTES
    assert not parallel.takes(np.ones((64, 64), np.float32)[:, ::2])  # not C-contiguous
    assert not ParallelUpload(_fake_cupy(), threads=1).takes(np.ones((64, 4096), np.float32))


# ---- PinnedRegion and gather_rows: a batch gathered from memory pinned where it lies -----------

def _pinning_cupy(registered: list):
    cp = _fake_cupy()
    cp.cuda.runtime.hostRegister = lambda ptr, n, flags: registered.append(("pin", ptr, n))
    cp.cuda.runtime.hostUnregister = lambda ptr: registered.append(("unpin", ptr))
    return cp


def test_rows_are_gathered_exactly_from_their_regions_in_batch_order():
    from convkernels.backends.cuda.transfer import PinnedRegion, gather_rows

    _Event.log = []
    pins: list = []
    cp = _pinning_cupy(pins)
    rng = np.random.default_rng()
    arenas = [rng.integers(0, 256, 4096 * 3, dtype=np.uint8) for _ in range(2)]
    regions = [PinnedRegion(cp, a.ctypes.data, 4096 * 2) for a in arenas]  # the low two pages of each
    assert pins == [("pin", a.ctypes.data, 8192) for a in arenas]
    parts = [arenas[1][100:100 + 3 * 5 * 7].reshape(1, 5, 7, 3), arenas[0][0:2 * 105].reshape(2, 5, 7, 3),
             arenas[1][4096:4096 + 105].reshape(1, 5, 7, 3)]
    dev = gather_rows(cp, parts, [regions[1], regions[0], regions[1]])
    np.testing.assert_array_equal(dev.host, np.concatenate(parts))
    done = _Event.log[-1][1]
    assert all(r.uploaded is done for r in regions)  # each region's last DMAs: this event

    # a block above the pinned pages, a strided part, a part without a region: not gathered
    above = arenas[0][8192 - 50:8192 - 50 + 105].reshape(1, 5, 7, 3)  # crosses the pinned end
    assert gather_rows(cp, [parts[0], above], [regions[1], regions[0]]) is None
    assert gather_rows(cp, [parts[1][:, ::2]], [regions[0]]) is None
    assert gather_rows(cp, [parts[0]], [None]) is None
    assert gather_rows(cp, [], []) is None


def test_a_released_region_waits_for_its_last_dmas_then_unpins_and_gathers_nothing_more():
    from convkernels.backends.cuda.transfer import PinnedRegion, gather_rows

    _Event.log = []
    pins: list = []
    cp = _pinning_cupy(pins)
    arena = np.zeros(8192, np.uint8)
    region = PinnedRegion(cp, arena.ctypes.data, 8192)
    part = arena[:64].reshape(1, 64)
    assert gather_rows(cp, [part], [region]) is not None
    last = region.uploaded
    region.release()
    assert last.waited and pins[-1] == ("unpin", arena.ctypes.data)
    assert _Event.log.index(("wait", last)) < len(_Event.log)
    assert gather_rows(cp, [part], [region]) is None  # gone: the caller stacks it on the host
    region.release()  # twice: nothing more
    assert [p[0] for p in pins] == ["pin", "unpin"]
