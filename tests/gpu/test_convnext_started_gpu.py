"""ConvNeXt's encode_started on the CUDA backend: two batches queued before either is waited for
(what the service's batcher does with one batch ahead) give exactly what encode gives each, the
second's replayed graph never overwriting the first's embeddings on their way to the host; uint8
and float pixels, graphs on (the service's default). And the same with every batch stacked in the
backend's pinned staging buffers (host_batch, as the batcher stacks them), more batches in flight
than there are buffers: each is uploaded from its own buffer before the buffer is written again.
Skipped without CUDA."""
from __future__ import annotations

import numpy as np
import pytest

from gpu_support import cuda_or_skip

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def model():
    cuda_or_skip()
    from convkernels import get_backend
    from models import load_model

    return load_model("c", "convnext-tiny", get_backend("cuda"))


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_batches_queued_ahead_equal_encode(model, dtype):
    rng = np.random.default_rng(7)
    batches = [rng.integers(0, 256, (n, 224, 224, 3), dtype=np.uint8) for n in (4, 4, 3)]
    if dtype == "float32":
        batches = [b.astype(np.float32) / 255 for b in batches]
    wanted = [model.encode(b)["embedding"] for b in batches]
    for _ in range(3):  # the graphs are recorded by now: these replay
        started = [model.encode_started(b) for b in batches]  # all queued before any is waited for
        got = [s.result()["embedding"] for s in started]
        for w, g in zip(wanted, got):
            assert g.shape == w.shape and np.array_equal(g, w)
    assert len({tuple(np.round(w[0], 4)) for w in wanted}) == 3  # the batches differ: a mix-up would show


@pytest.mark.parametrize("dtype", ["uint8", "float32"])
def test_batches_stacked_in_pinned_buffers_equal_encode(model, dtype):
    from convkernels.backends.cuda.transfer import SLOTS

    rng = np.random.default_rng(11)
    batches = [rng.integers(0, 256, (4, 224, 224, 3), dtype=np.uint8) for _ in range(SLOTS + 2)]
    if dtype == "float32":
        batches = [b.astype(np.float32) / 255 for b in batches]
    wanted = [model.encode(b)["embedding"] for b in batches]
    bk = model.backend
    for _ in range(2):
        started = []
        for b in batches:  # all queued before any is waited for, as the batcher's queue would
            where = bk.host_batch(b.shape, b.dtype)
            assert where is not None
            np.concatenate([b[:2], b[2:]], axis=0, out=where)
            started.append(model.encode_started(where))
        for w, s in zip(wanted, started):
            assert np.array_equal(s.result()["embedding"], w)


def test_large_host_batches_cross_exactly_in_parallel_parts(model):
    """Host arrays of 16 MiB and more cross through ParallelUpload (several threads copy them into
    pinned memory, part by part): byte-exact on the device, the one pinned buffer reused between
    uploads of other contents, an odd size whose last part is short included; and ConvNeXt's encode
    of a large float32 batch equals the same encode with the array crossing CuPy's own way."""
    from convkernels.backends.cuda.transfer import MIN_BYTES

    bk = model.backend
    rng = np.random.default_rng(13)
    for shape in ((41, 224, 224, 3), (5, 1031, 1033)):
        host = rng.standard_normal(shape).astype(np.float32)
        assert host.nbytes >= MIN_BYTES and bk.arrays.large.takes(host)
        for x in (host, host[::-1].copy()):
            assert np.array_equal(bk.arrays.cp.asnumpy(bk.arrays.from_host(x, "float32")), x)
    batch = rng.random((48, 224, 224, 3), dtype=np.float32)  # 29 MB
    assert bk.arrays.large.takes(batch)
    parallel = model.encode(batch)["embedding"]
    threads, bk.arrays.large.threads = bk.arrays.large.threads, 1  # takes nothing: CuPy's upload
    try:
        assert not bk.arrays.large.takes(batch)
        ordinary = model.encode(batch)["embedding"]
    finally:
        bk.arrays.large.threads = threads
    assert np.array_equal(parallel, ordinary) and float(np.abs(parallel).max()) > 0


def test_batches_gathered_from_a_pinned_shared_arena_equal_encode(model):
    """The service's path for uint8 one-image requests: each image in its own block of a front
    end's shared-memory arena (a real memfd mapping), the arena's low pages pinned in place, the
    batch gathered on the device (gather_rows) and encoded from there; equal to encode of the
    same images stacked on the host. A block above the pinned pages is not gathered (None), and
    after release nothing is."""
    from service.ipc.shm import Arena

    bk = model.backend
    assert model.takes_device_pixels
    rng = np.random.default_rng(13)
    arena = Arena(16 << 20)
    region = bk.pin_host_region(arena.address, 8 << 20)
    try:
        batches = []
        for n in (5, 3, 8):
            refs = [arena.put(rng.integers(0, 256, (1, 224, 224, 3), dtype=np.uint8)) for _ in range(n)]
            batches.append([arena.array(r) for r in refs])
        wanted = [model.encode(np.concatenate(parts))["embedding"] for parts in batches]
        for _ in range(2):
            started = [model.encode_started(bk.gather_rows(parts, [region] * len(parts))) for parts in batches]
            for w, s in zip(wanted, started):
                assert np.array_equal(s.result()["embedding"], w)
        high = arena.array(arena.put(np.zeros((1, 2048, 2048, 3), np.uint8)))  # 12 MiB: past the pinned 8
        assert bk.gather_rows([batches[0][0], high], [region, region]) is None
    finally:
        region.release()
    assert bk.gather_rows(batches[0], [region] * 5) is None
    arena.close()


def test_gather_rows_joins_parts_of_any_size_and_alignment_exactly(model):
    """gather_rows on parts of one row and of several, odd row sizes, and parts that start at an
    odd byte: the joined rows equal the parts stacked on the host."""
    from convkernels.backends.cuda.transfer import gather_rows
    from service.ipc.shm import Arena

    bk = model.backend
    cp = bk.cp
    rng = np.random.default_rng(17)
    arena = Arena(16 << 20)
    region = bk.pin_host_region(arena.address, 8 << 20)
    try:
        for shape, rows in (((33, 35, 3), (1, 3, 1, 2, 1)), ((224, 224, 3), (1,) * 9), ((5, 7), (2, 1, 4))):
            parts = [arena.array(arena.put(rng.integers(0, 256, (n, *shape), dtype=np.uint8))) for n in rows]
            got = gather_rows(cp, parts, [region] * len(parts))
            assert np.array_equal(cp.asnumpy(got), np.concatenate(parts)), (shape, rows)
        # parts at odd addresses (views one byte into their blocks)
        blocks = [arena.array(arena.put(rng.integers(0, 256, (1, 101), dtype=np.uint8))) for _ in range(4)]
        odd = [b[:, 1:] for b in blocks]
        assert all(p.ctypes.data % 16 for p in odd)
        got = gather_rows(cp, odd, [region] * len(odd))
        assert np.array_equal(cp.asnumpy(got), np.concatenate(odd))
    finally:
        region.release()
    arena.close()
