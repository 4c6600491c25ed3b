"""The batcher keeps one batch ahead where the model call's result is still on its way from the
device (batcher.Later): the next batch is stacked and its call made before the previous one's
result is waited for, results still leave in batch order, an error met while waiting fails that
batch alone, and a lone request waits for nothing. Real threads, no model: the calls are
functions whose results arrive when the test lets them."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from service.worker.batcher import Batcher, Later, WorkItem


class _Pending:
    """A result that arrives when `gate` is set (a device copy still running)."""

    def __init__(self, value, gate: threading.Event, log: list, name: str, fail: bool = False):
        self.value, self.gate, self.log, self.name, self.fail = value, gate, log, name, fail

    def result(self):
        self.log.append(f"wait {self.name}")
        assert self.gate.wait(10)
        if self.fail:
            raise RuntimeError(f"device error in {self.name}")
        return self.value


@pytest.fixture
def batcher():
    b = Batcher(max_batch=4, max_queue_delay_ms=0)
    yield b
    b.stop()


def _call(log, gates, name, fail=False):
    def call(x):
        log.append(f"start {name}")
        return Later(_Pending(x * 10, gates[name], log, name, fail))
    return call


def test_the_next_batch_starts_before_the_previous_result_is_waited_for(batcher):
    log, gates = [], {"a": threading.Event(), "b": threading.Event()}
    a = batcher.submit("m", "k", np.full((1, 2), 1.0), _call(log, gates, "a"))
    deadline = time.monotonic() + 10
    while "wait a" not in log and time.monotonic() < deadline:  # a lone batch is waited for at once
        time.sleep(0.005)
    assert log == ["start a", "wait a"]
    # a is on its way; b queued meanwhile: once a arrives, b is stacked and started ...
    b = batcher.submit("m", "k", np.full((1, 2), 2.0), _call(log, gates, "b"))
    c_gate = threading.Event()
    gates["c"] = c_gate
    c = batcher.submit("m", "k2", np.full((1, 2), 3.0), _call(log, gates, "c"))
    gates["a"].set()
    assert a.outcome.result(10).tolist() == [[10.0, 10.0]]
    deadline = time.monotonic() + 10
    while "start c" not in log and time.monotonic() < deadline:
        time.sleep(0.005)
    # ... and c (another key: a batch of its own) started before b's result was waited for
    assert log.index("start c") < log.index("wait b"), log
    assert not b.outcome.done()
    gates["b"].set()
    c_gate.set()
    assert b.outcome.result(10).tolist() == [[20.0, 20.0]]
    assert c.outcome.result(10).tolist() == [[30.0, 30.0]]
    assert log.index("wait b") < log.index("wait c"), log  # results in batch order


def test_an_error_met_while_waiting_fails_that_batch_alone(batcher):
    log, gates = [], {"bad": threading.Event(), "good": threading.Event()}
    bad = batcher.submit("m", "k", np.ones((1, 1)), _call(log, gates, "bad", fail=True))
    good = batcher.submit("m", "k2", np.ones((1, 1)), _call(log, gates, "good"))
    gates["bad"].set()
    gates["good"].set()
    with pytest.raises(RuntimeError, match="device error in bad"):
        bad.outcome.result(10)
    assert good.outcome.result(10).tolist() == [[10.0]]


def test_a_lone_request_waits_for_no_other_batch(batcher):
    log, gates = [], {"one": threading.Event()}
    gates["one"].set()
    t0 = time.perf_counter()
    one = batcher.submit("m", "k", np.ones((2, 1)), _call(log, gates, "one"))
    assert one.outcome.result(10).tolist() == [[10.0], [10.0]]
    assert time.perf_counter() - t0 < 2.0
    assert log == ["start one", "wait one"]


def test_a_batch_is_stacked_where_the_backend_says_and_anywhere_when_it_says_nothing():
    """host_batch (the backend's, e.g. CUDA's pinned buffers): the call gets the batch stacked in
    the buffer it gave, equal to the inputs in order; when it answers None, the batch is stacked by
    NumPy as before, and a lone request's own input is passed as it is."""
    given, seen = [], []

    def host_batch(shape, dtype):
        if shape[0] == 4:  # only the four-row batch has a place of its own
            given.append(np.full(shape, -1, dtype))
            return given[-1]
        return None

    b = Batcher(max_batch=8, max_queue_delay_ms=50, host_batch=host_batch)
    try:
        def call(x):
            seen.append(x)
            return x * 2

        parts = [np.arange(4, dtype=np.float32).reshape(1, 4) + i for i in range(4)]
        items = [WorkItem("m", "k", p, call) for p in parts]
        b.submit_many(items)  # queued together: one batch (a bucket of 4)
        for it, p in zip(items, parts):
            np.testing.assert_array_equal(it.outcome.result(10), p * 2)
        assert len(given) == 1 and seen[0] is given[0]
        np.testing.assert_array_equal(given[0], np.concatenate(parts))
        lone = np.ones((2, 4), np.float32)
        assert b.submit("m", "k", lone, call).outcome.result(10).tolist() == (lone * 2).tolist()
        assert seen[1] is lone
    finally:
        b.stop()


def test_a_call_that_takes_device_input_gets_the_gathered_batch_else_the_stacked_one():
    """gather (the worker's: a batch joined on the device from its requests' own blocks) serves
    only calls marked device_input; where it answers None, and for every other call, the batch is
    stacked on the host as before; with faults armed (before_call) it is never asked."""
    asked, seen = [], []

    def gather(batch):
        asked.append(len(batch))
        if len(batch) == 4:
            return None
        return np.concatenate([it.inputs for it in batch]) + 100  # told apart by its values

    def device_call(x):
        seen.append(x)
        return np.zeros((len(x), 1))

    device_call.device_input = True

    def host_call(x):
        seen.append(x)
        return np.zeros((len(x), 1))

    for before_call, expect_gather in ((None, True), (lambda inputs: None, False)):
        asked.clear()
        seen.clear()
        b = Batcher(max_batch=8, max_queue_delay_ms=50, gather=gather, before_call=before_call)
        try:
            for call, rows in ((device_call, 2), (device_call, 4), (host_call, 2)):
                items = [WorkItem("m", (call.__name__, rows), np.full((1, 4), i, np.float32), call)
                         for i in range(rows)]
                b.submit_many(items)
                for it in items:
                    it.outcome.result(10)
        finally:
            b.stop()
        if expect_gather:
            assert asked == [2, 4]  # the host call's batch never asked
            assert seen[0].tolist() == [[100.0] * 4, [101.0] * 4]
        else:
            assert asked == [] and seen[0].tolist() == [[0.0] * 4, [1.0] * 4]
        assert seen[1].tolist() == [[float(i)] * 4 for i in range(4)]  # gather said None: stacked
        assert seen[2].tolist() == [[0.0] * 4, [1.0] * 4]


def test_an_item_cancelled_before_it_reaches_the_queue_never_runs_and_the_queue_goes_on(batcher):
    """A JPEG file withdrawn while on its decode thread (service/worker/jpeg_stage.py) reaches the
    batcher cancelled: left at the queue's head it would have stalled every later request."""
    ran = []

    def call(x):
        ran.append(int(x[0, 0]))
        return x

    early = WorkItem("m", "k", np.full((1, 1), 1.0), call)
    assert batcher.cancel(early)  # withdrawn before the batcher had it: answered Cancelled at once
    later = WorkItem("m", "k", np.full((1, 1), 2.0), call)
    batcher.submit_many([early, later])
    assert later.outcome.result(timeout=10)[0, 0] == 2.0
    assert ran == [2]
    assert type(early.outcome.exception(timeout=1)).__name__ == "Cancelled"
