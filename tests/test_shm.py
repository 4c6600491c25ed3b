"""The shared-memory transport between HTTP front ends and model workers (service/ipc/shm.py): the
allocator's bookkeeping, and a tensor crossing into another process and back through the pages
of one arena (its descriptor sent over a Unix socket, as front ends send it to workers)."""
from __future__ import annotations

import multiprocessing
from multiprocessing.connection import Listener
from multiprocessing.reduction import send_handle

import numpy as np
import pytest

from service.ipc.shm import ALIGN, Arena, ArenaFull, TensorRef, TooLarge


def test_blocks_are_aligned_disjoint_and_reused_after_free():
    arena = Arena(64 * ALIGN)
    a, b, c = arena.alloc(1), arena.alloc(ALIGN + 1), arena.alloc(3 * ALIGN)
    assert {a % ALIGN, b % ALIGN, c % ALIGN} == {0}
    assert a + ALIGN <= b and b + 2 * ALIGN <= c  # rounded up to whole pages, no overlap
    assert arena.used_bytes == 6 * ALIGN
    arena.free(b)
    assert arena.alloc(2 * ALIGN) == b  # first fit: the hole is used again
    for off in (a, b, c):
        arena.free(off)
    assert arena.used_bytes == 0 and arena.alloc(64 * ALIGN) == 0  # coalesced into one free run


def test_full_and_too_large_are_told_apart():
    arena = Arena(8 * ALIGN)
    held = arena.alloc(6 * ALIGN)
    with pytest.raises(ArenaFull) as full:
        arena.alloc(4 * ALIGN)
    assert not isinstance(full.value, TooLarge)  # waiting helps: a 503, not a 413
    with pytest.raises(TooLarge):
        arena.alloc(9 * ALIGN)
    arena.free(held)
    assert arena.alloc(8 * ALIGN) == 0


def test_put_copies_the_array_and_views_read_it_back():
    arena = Arena(1 << 20)
    rng = np.random.default_rng()
    x = rng.standard_normal((3, 5, 7)).astype(np.float32)
    ref = arena.put(x[:, ::-1])  # a strided input is copied as it reads
    assert ref.shape == (3, 5, 7) and ref.nbytes == x.nbytes
    np.testing.assert_array_equal(arena.array(ref), x[:, ::-1])
    with pytest.raises(ValueError):
        arena.array(TensorRef(arena.size - ALIGN, (ALIGN,), "<f4"))  # past the end


def _child(address: str, size: int, ref_in: TensorRef, ref_out: TensorRef) -> None:
    from multiprocessing.connection import Client
    from multiprocessing.reduction import recv_handle

    from service.ipc.shm import ArenaView

    with Client(address, family="AF_UNIX") as conn:
        view = ArenaView(recv_handle(conn), size)
        x = view.array(ref_in)
        view.array(ref_out)[...] = x * 2 + 1  # the worker's side: read inputs, write outputs
        conn.send(("done", float(x.sum())))


def test_a_tensor_crosses_into_another_process_and_back_through_the_pages(tmp_path):
    arena = Arena(1 << 20)
    x = np.random.default_rng().standard_normal((2, 9, 11)).astype(np.float32)
    ref_in, ref_out = arena.put(x), arena.reserve(x.shape, np.float32)
    arena.array(ref_out).fill(np.nan)  # poison: every element must be written by the child
    address = str(tmp_path / "s.sock")
    with Listener(address, family="AF_UNIX") as listener:
        proc = multiprocessing.get_context("spawn").Process(target=_child, args=(address, arena.size, ref_in, ref_out))
        proc.start()
        with listener.accept() as conn:
            send_handle(conn, arena.fd, proc.pid)
            tag, total = conn.recv()
        proc.join(30)
    assert proc.exitcode == 0 and tag == "done"
    assert total == pytest.approx(float(x.sum()), rel=1e-5)
    np.testing.assert_array_equal(arena.array(ref_out), x * 2 + 1)


def test_trim_gives_pages_above_the_kept_region_back_once_idle(monkeypatch):
    import service.ipc.shm as shm

    monkeypatch.setattr(shm, "KEEP_RESIDENT_BYTES", 4 * ALIGN)
    arena = Arena(64 * ALIGN)
    big = arena.put(np.full((32 * ALIGN,), 7, np.uint8))
    arena.free(big.offset)  # idle now: the pages past 4 pages are dropped (read back as zeros)
    tail = arena.array(TensorRef(8 * ALIGN, (ALIGN,), "|u1"))
    assert tail.max() == 0
