"""The cost of one request's messages between a front end and a model worker: the pickled tuples
the service sent before service/ipc/worker_protocol.py, against its msgspec Structs.

A typical request is one Submit (a decode naming its input and output blocks in the arena) and its
answer in a DoneMany. Printed, in microseconds per request:
- encode + decode of the submit and of its answer, in a loop (the CPU the protocol costs); for the
  bulk row, --bulk requests travel together: one SubmitMany and one DoneMany for all of them (what
  a front end under load sends, service/frontend/engine.py);
- a round trip over a socketpair (multiprocessing's duplex Pipe, as the worker's Unix socket):
  the front end sends the submit, an echo thread standing in for the worker reads and decodes it
  and answers, the front end reads and decodes the answer.

    python benchmarks/service/worker_protocol.py [--n 20000] [--round-trips 5000] [--bulk 16]

On a busy machine the numbers are indicative: compare the two rows of one run, not runs.
"""
from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass
from multiprocessing import Pipe
from multiprocessing.reduction import ForkingPickler
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo

from service.ipc import worker_protocol as wp  # noqa: E402
from service.ipc.shm import TensorRef  # noqa: E402


@dataclass(frozen=True)
class OldRef:
    """service/ipc/shm.py's TensorRef as it was: a frozen dataclass, pickled."""
    offset: int
    shape: tuple
    dtype: str


def old_messages(rid: int):
    submit = ("submit", rid, "sd-vae", "decode", {"tiled": None, "clamp": True, "uint8": True},
              OldRef(1 << 20, (1, 4, 64, 64), "<f4"), {"out": OldRef(1 << 22, (1, 512, 512, 3), "|u1")})
    return submit, ("done_many", [(rid, None, None)])


def new_messages(rid: int):
    submit = wp.Submit(rid, "sd-vae", "decode", wp.Options(tiled=None, clamp=True, uint8=True),
                       TensorRef(1 << 20, (1, 4, 64, 64), "<f4"), {"out": TensorRef(1 << 22, (1, 512, 512, 3), "|u1")})
    return submit, wp.DoneMany([wp.Done(rid)])


def bulk_messages(k: int):
    """k requests' submits in one SubmitMany and their answers in one DoneMany."""
    subs = [new_messages(rid)[0] for rid in range(k)]
    return wp.SubmitMany(subs), wp.DoneMany([wp.Done(rid) for rid in range(k)])


def codec_loop(n: int, messages, dumps, loads) -> float:
    """Seconds per request: its submit and its answer encoded and decoded."""
    submit, answer = messages(7)
    t0 = time.perf_counter()
    for _ in range(n):
        loads(dumps(submit))
        loads(dumps(answer))
    return (time.perf_counter() - t0) / n


def round_trips(n: int, send, recv, messages) -> float:
    """Seconds per request over a socketpair, the worker an echo thread."""
    front, worker = Pipe(duplex=True)
    submit, answer = messages(7)

    def echo() -> None:
        for _ in range(n):
            recv(worker)
            send(worker, answer)

    thread = threading.Thread(target=echo, daemon=True)
    thread.start()
    t0 = time.perf_counter()
    for _ in range(n):
        send(front, submit)
        recv(front)
    elapsed = time.perf_counter() - t0
    thread.join()
    front.close()
    worker.close()
    return elapsed / n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=20000, help="encode+decode loops")
    ap.add_argument("--round-trips", type=int, default=5000)
    ap.add_argument("--bulk", type=int, default=16, help="requests per SubmitMany in the bulk row")
    args = ap.parse_args()
    old_submit, _ = old_messages(7)
    new_submit, _ = new_messages(7)
    print(f"submit bytes: pickled tuple {len(bytes(ForkingPickler.dumps(old_submit)))}, "
          f"msgpack Struct {len(wp.encode(new_submit))}")
    rows = {
        "pickled tuples": (codec_loop(args.n, old_messages, lambda m: bytes(ForkingPickler.dumps(m)),
                                      ForkingPickler.loads),
                           round_trips(args.round_trips, lambda c, m: c.send(m), lambda c: c.recv(), old_messages)),
        "msgspec Structs": (codec_loop(args.n, new_messages, wp.encode, wp.decode),
                            round_trips(args.round_trips, wp.send, wp.recv, new_messages)),
    }
    k = args.bulk
    rows[f"SubmitMany of {k}"] = (codec_loop(args.n // k, lambda rid: bulk_messages(k), wp.encode, wp.decode) / k,
                                  round_trips(args.round_trips // k, wp.send, wp.recv, lambda rid: bulk_messages(k)) / k)
    print(f"{'':16s} {'encode+decode us/request':>26s} {'socketpair round trip us/request':>34s}")
    for name, (codec, trip) in rows.items():
        print(f"{name:16s} {codec * 1e6:26.2f} {trip * 1e6:34.1f}")


if __name__ == "__main__":
    main()
