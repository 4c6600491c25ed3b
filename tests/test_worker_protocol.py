"""The wire protocol between front ends, model workers and shard leaders (service/ipc/worker_protocol.py)
and its one table of error kinds (service/ipc/worker_errors.py), over a real socketpair."""
from __future__ import annotations

from multiprocessing import Pipe

import pytest

from service.worker.batcher import Cancelled, Closed
from service.ipc import worker_errors
from service.ipc import worker_protocol as wp
from service.ipc.shm import TensorRef
from service.model_stats import Duration, ModelRecord
from service.worker.oom_recovery import DeviceOutOfMemory
from service.settings import ModelEntry
from service.worker.shard_leader import ShardFailed
from service.worker.stream_steps import StreamClosed

IN, OUT = TensorRef(4096, (2, 4, 8, 8), "<f4"), TensorRef(1 << 20, (2, 64, 64, 3), "|u1")


def _status() -> wp.Status:
    from service.hosted_model import ModelView
    view = ModelView("vae", "image-decoder", {"name": "vae", "sizes": [1, 2]}, None, None, latent_channels=4,
                     spatial_factor=8)
    return wp.Status("cpu", "ready", pid=12, failed={"x": "ValueError: no"}, backend="numpy", row_seconds=0.01,
                     models={"vae": wp.ModelStatus(ModelEntry("vae", "tiny-vae"), view, 0.5, None, {"a": 1})})


MESSAGES = [
    wp.Hello(1, 1 << 30), wp.LeaderHello(2, 1 << 34),
    wp.Submit(3, "vae", "decode", wp.Options(tiled=None, clamp=False, uint8=True, shards=2), IN, {"out": OUT}),
    wp.Submit(4, "vae", "stream_next", wp.Options(stream=3), None, {"out": OUT}),
    wp.SubmitMany([wp.Submit(5, "vae", "encode", wp.Options(), IN, {"embedding": OUT}),
                   wp.Submit(6, "vae", "decode", wp.Options(uint8=True), IN, {"out": OUT})]),
    wp.Cancel(3), wp.StreamClose(3), wp.Query(5, "stats"),
    wp.ShardJoin(6, "vae", 1, 2, ("127.0.0.1", 4242, "ab")),
    wp.ShardJoin(6, "vae", 1, 2, bytes(range(128))),  # NCCL's id in CuPy 14: bytes, which its join insists on
    wp.ShardDecode(7, "vae", 1, 2, 16, True, False, IN, OUT), wp.ShardStreamOpen(8, "vae", 1, 2, 1, 16, True, IN),
    wp.ShardStreamNext(9, "vae", 1, 2, 1, 0, OUT), wp.ShardStreamClose(1),
    _status(), wp.Started([3, 4]), wp.Done(3), wp.Done(8, None, 8),
    wp.DoneMany([wp.Done(3), wp.Done(4, wp.WorkerError("model-error", "RuntimeError: x", "abc"))]),
    wp.KernelsAnswer(5, {"device": "cpu", "conv_choices": []}),
    wp.StatsAnswer(5, {"vae": ModelRecord(inference_count=3, batches={2: {"compute_infer": Duration(1, 20)}})}),
]


@pytest.mark.parametrize("msg", MESSAGES, ids=lambda m: type(m).__name__)
def test_every_message_crosses_a_socket_unchanged(msg):
    a, b = Pipe(duplex=True)
    with a, b:
        wp.send(a, msg)
        assert wp.recv(b) == msg


def test_a_frame_that_breaks_the_protocol_is_refused():
    with pytest.raises(wp.ProtocolError):
        wp.decode(wp.encode(wp.Cancel(1))[:-1])
    with pytest.raises(wp.ProtocolError):  # a pickle is no message
        wp.decode(b"\x80\x04\x95")
    with pytest.raises(wp.ProtocolError):  # a field of the wrong type fails where it is decoded
        wp.decode(wp.encode(wp.Started([1])).replace(b"\x91\x01", b"\x91\xa1x"))


@pytest.mark.parametrize("exc, kind, status, problem", [
    (DeviceOutOfMemory("no room"), "device-oom", 503, "device-out-of-memory"),
    (Cancelled(), "cancelled", 499, "client-gone"),
    (Closed(), "closed", 503, "shutting-down"),
    (StreamClosed("gone"), "stream-closed", 409, "stream-closed"),
    (ShardFailed("rank 1"), "shard-failed", 503, "shard-failed"),
    (ValueError("bad shape"), "invalid-input", 422, "model-rejected-input"),
    (RuntimeError("boom"), "model-error", 500, "model-error"),
])
def test_one_table_maps_an_exception_to_its_kind_and_its_problem(exc, kind, status, problem):
    error = worker_errors.error_info(exc)
    assert error.kind == kind
    answer = worker_errors.problem("m", error.kind, error.message, error.error_id, lambda: "7")
    assert (answer.status, answer.kind) == (status, problem)
    if kind in ("device-oom", "shard-failed"):
        assert answer.headers["Retry-After"] == "7"  # the queue's own estimate


def test_a_front_ends_own_kinds_and_an_unknown_one():
    died = worker_errors.problem("m", "worker-died", "gone", None, lambda: "7")
    assert (died.status, died.kind, died.headers["Retry-After"]) == (503, "worker-died", "2")
    odd = worker_errors.problem("m", "no-such-kind", "huh", "id1", lambda: "7")
    assert (odd.status, odd.kind) == (500, "model-error") and "id1" in odd.detail
