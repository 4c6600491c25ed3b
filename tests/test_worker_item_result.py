"""A request's outcome in the model worker (service/worker/work_item.py): set once, the first
setting kept; a waiter on another thread wakes when it is set, whichever comes first; a wait
times out; and the service's threads carry their names to the kernel (service/threads.py), which
the throughput benchmark reads per thread."""
from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest

from service import threads
from service.worker.work_item import ItemResult


def test_set_once_keeps_the_first_outcome():
    r = ItemResult()
    assert not r.done()
    assert r.set([1, 2]) is True
    assert r.set(None, RuntimeError("late")) is False
    assert r.done() and r.result() == [1, 2] and r.exception() is None


def test_an_error_is_raised_by_result_and_returned_by_exception():
    r = ItemResult()
    err = ValueError("bad rows")
    r.set(None, err)
    assert r.exception() is err
    with pytest.raises(ValueError, match="bad rows"):
        r.result()


@pytest.mark.parametrize("waiter_first", [True, False])
def test_a_waiter_on_another_thread_gets_the_outcome(waiter_first):
    for _ in range(200):  # the two orders, and the races between them
        r, got = ItemResult(), []
        t = threading.Thread(target=lambda: got.append(r.result(10)))
        if waiter_first:
            t.start()
            r.set("rows")
        else:
            r.set("rows")
            t.start()
        t.join(10)
        assert got == ["rows"]


def test_a_wait_times_out():
    r = ItemResult()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError):
        r.result(0.05)
    assert time.monotonic() - t0 >= 0.05
    r.set(3)  # and a later setting still reaches the next reader
    assert r.result(0) == 3


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")
def test_a_started_thread_carries_its_name_to_the_kernel():
    seen, done = {}, threading.Event()

    def body():
        seen["comm"] = Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip()
        done.set()

    t = threads.start(body, "convserve-deliver-with-a-long-tail")
    assert done.wait(10)
    t.join(10)
    assert t.name == "convserve-deliver-with-a-long-tail"
    assert seen["comm"] == "deliver-with-a-l"[:15]  # the tail after convserve-, 15 bytes
