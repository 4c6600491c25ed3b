"""A `shards=N` decode inside the service: the model worker of the first device leads,
the workers of the next N-1 devices follow, joined by NCCL (convkernels.collectives.nccl).

Why one leader: every member of a group must run the group's collectives in the same order, or
NCCL pairs the wrong operations and hangs. The front ends are many processes; the first device's
worker is one, and its device thread runs one sharded decode at a time, so the order in which it
hands bands to its followers is the order. It talks to each follower as a front end does (the same
Unix socket, messages naming tensors in an arena of its own, service/ipc/shm.py); a follower runs a
band on its own device thread between its other batches.

The rules a group keeps:
- **Groups are prefixes.** shards=N uses devices 0..N-1 of the worker list, always led by worker
  0; its communicator is made on the first N-shard request and kept (`_Group`), the followers
  keeping theirs (`ShardMember`, service/worker/shard_member.py) until the leader's connection goes.
- **Any failure ends the group's processes.** A rank that fails leaves the others waiting in a
  collective that will never complete, and NCCL offers no safe way out of that wait from Python.
  So: a follower whose band raises exits; the leader exits when a follower fails, goes
  or is late past the deadline; a follower exits when its leader goes mid-band. The supervisor
  starts each again; the front ends answer the request, and any other in flight on those workers,
  503 with Retry-After (`worker-died`): the request fails cleanly and the GPUs come back.
- **Without NCCL** (the numpy and mlx backends) the leader decodes the N shards itself on
  emulated shards (threads, models.sharding.decode_emulated): the same arithmetic, no speed-up.
  That is how CI checks the request path; the GPU tests check the NCCL one.

The leader's messages to a follower are its own (service/ipc/worker_protocol.py): a LeaderHello,
then ShardJoin (the communicator's id), ShardDecode (a band's latents -> its pixels),
ShardStreamOpen / ShardStreamNext / ShardStreamClose (a streamed decode's band and its frame
groups). Each names only the blocks it has: a join, a stream's step carry no placeholder tensors.
"""
from __future__ import annotations

import importlib
import itertools
import logging
import os
import selectors
import threading
import time
from multiprocessing.connection import Client, Connection
from multiprocessing.reduction import send_handle

import numpy as np

from convkernels.host import pixels_to_uint8
from convkernels.collectives.shard_comm import split
from models import sharding

from .. import threads
from ..ipc import worker_protocol as wp
from ..ipc.shm import ALIGN, Arena, TensorRef
from ..ipc.worker_errors import ShardFailed

log = logging.getLogger("convserve.shards")

#: exit status of a worker that ended its shard group (the supervisor starts it again)
GROUP_FAILED_EXIT = 75
#: how long a group may take to connect, get ready, join or decode before it ends (the service
#: passes twice its request timeout, at least this much: a first call builds plans)
DEADLINE_S = 120.0


def arena_bytes(shm_bytes: int, devices: int) -> int:
    """The leader's arena, for the bands it hands out and the pixels it gets back (sparse: pages
    are only touched by the tensors in flight). Why this size: the leader runs one message round
    at a time (a decode, a stream's open or one frame group) and frees its blocks before the next,
    so the arena holds at most the followers' shares of one request's latents and pixels; the
    front end held that request's latents and pixels together in its own arena of `shm_bytes`
    (more is a 413 there). Plus a page of rounding for each of a follower's two blocks."""
    return shm_bytes + 2 * devices * ALIGN


#: the test-only communicator of CONVSERVE_SHARD_COMM=test-gloo: tests/gloo_shards.py (torch's gloo),
#: importable only where the repository's tests/ is on PYTHONPATH: never part of the product
TEST_GLOO_MODULE = "gloo_shards"


def comm_class(backend, settings):
    """The communicator a worker's groups use: NCCL on CUDA (when `shard_groups` is on); on CPU
    backends None (the leader emulates the shards), or the tests' gloo one with `shard_comm`
    "test-gloo"."""
    if backend.name == "cuda":
        if not settings.shard_groups:
            return None
        from convkernels.collectives.nccl import NcclShards
        return NcclShards
    if settings.shard_comm != "test-gloo":
        return None
    try:
        return importlib.import_module(TEST_GLOO_MODULE).GlooShards
    except ImportError as exc:
        raise RuntimeError("CONVSERVE_SHARD_COMM=test-gloo is test-only: it needs the repository's tests/ "
                           f"on PYTHONPATH and torch installed ({exc})") from exc


def end_group(why: str) -> None:
    """This worker's part in a shard group cannot complete: log why and exit at once (see the
    module docstring); threads waiting in NCCL are not unwound."""
    log.error("shard group failed: %s; this worker exits and is started again", why)
    logging.shutdown()
    os._exit(GROUP_FAILED_EXIT)


def pixels(out: np.ndarray, uint8: bool) -> np.ndarray:
    """A band's float32 pixels in [0, 1], or as uint8 when the request asked for them (a decode's;
    a stream's bands come as uint8 from the device already: frame_groups_band(uint8=...))."""
    return pixels_to_uint8(out) if uint8 else out


class _Follower:
    """The leader's connection to one follower: its socket, the answers it is waiting for."""

    def __init__(self, address: str, arena: Arena, deadline: float):
        while True:
            try:
                self.conn: Connection = Client(address, family="AF_UNIX")
                break
            except (FileNotFoundError, ConnectionRefusedError, OSError):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no shard follower at {address}") from None
                time.sleep(0.1)
        wp.send(self.conn, wp.LeaderHello(os.getpid(), arena.size))
        send_handle(self.conn, arena.fd, 0)
        self._send_lock = threading.Lock()  # the device thread and a stream's close both send
        self.address = address
        self.state = None
        self.answers: dict[int, wp.WorkerError | None] = {}
        self.cond = threading.Condition()

    def send(self, msg: wp.Message) -> None:
        with self._send_lock:
            wp.send(self.conn, msg)

    def read_one(self) -> list[wp.WorkerError]:
        """One message (the reader thread); the errors it answers. EOF propagates."""
        msg = wp.recv(self.conn)
        answers = msg.answers if isinstance(msg, wp.DoneMany) else [msg] if isinstance(msg, wp.Done) else []
        with self.cond:
            if isinstance(msg, wp.Status):
                self.state = msg.state
            for done in answers:
                self.answers[done.rid] = done.error
            self.cond.notify_all()
        return [done.error for done in answers if done.error is not None]


class _Blocks:
    """The arena blocks of one follower's message: held until its answer is read (_Group._collect)."""

    def __init__(self, arena: Arena):
        self.arena = arena
        self.held: list[TensorRef] = []
        self.out: TensorRef | None = None

    def put(self, inputs: np.ndarray) -> TensorRef:
        ref = self.arena.put(inputs)  # a band (a strided view of the latents) copied once, into the block
        self.held.append(ref)
        return ref

    def reserve(self, shape: tuple[int, ...], dtype: str) -> TensorRef:
        self.out = self.arena.reserve(shape, dtype)
        self.held.append(self.out)
        return self.out

    def free(self) -> None:
        for ref in self.held:
            self.arena.free(ref.offset)
        self.held = []


class _Group:
    """The leader's side of one N-shard group: followers 1..N-1 and the NCCL communicator."""

    def __init__(self, addresses: list[str], model: str, arena: Arena, comm_cls, deadline_s: float = DEADLINE_S):
        self.size = len(addresses) + 1
        self.arena = arena
        self.deadline_s = deadline_s
        self.inflight = False
        self.inflight_since = 0.0
        self.broken = False  # a follower went while the group was idle
        self._rids = itertools.count(1)
        deadline = time.monotonic() + self.deadline_s
        self.followers = [_Follower(a, arena, deadline) for a in addresses]
        threads.start(self._read, f"convserve-shards-{self.size}")
        for f in self.followers:
            with f.cond:
                if not f.cond.wait_for(lambda f=f: f.state in ("ready", "failed"), deadline - time.monotonic()):
                    end_group(f"the shard follower at {f.address} was not ready in {self.deadline_s:.0f} s")
                if f.state != "ready":
                    raise RuntimeError(f"the shard follower at {f.address} failed to load its models")
        uid = comm_cls.unique_id()  # bytes or a tuple of plain values: it travels in the ShardJoin as is
        rids = self._send_all(lambda rank, rid, blocks: wp.ShardJoin(rid, model, rank, self.size, uid))
        try:
            self.comm = comm_cls.join(uid, 0, self.size)  # returns once every follower has joined too
        except Exception as exc:  # the followers wait in their join: they go too
            end_group(f"joining the {self.size}-shard group failed: {type(exc).__name__}: {exc}")
        self._collect(rids)

    def _read(self) -> None:
        """The watchdog: every follower's answers; a follower gone while the group is busy ends it."""
        sel = selectors.DefaultSelector()
        for f in self.followers:
            sel.register(f.conn, selectors.EVENT_READ, f)
        while True:
            # the leader's own band may wait in a collective for a rank that never comes: the
            # watchdog, not that band, notices the deadline
            if self.inflight and time.monotonic() - self.inflight_since > self.deadline_s:
                end_group(f"the {self.size}-shard group did not finish in {self.deadline_s:.0f} s")
            for key, _ in sel.select(1.0):
                f = key.data
                try:
                    errors = f.read_one()
                    if errors:  # the leader's own band may be waiting in NCCL for that rank: no way back
                        end_group(f"the shard follower at {f.address} failed: {errors[0].message}")
                except (EOFError, OSError):
                    if self.inflight:
                        end_group(f"the shard follower at {f.address} went away")
                    # idle: the next request makes a new group (this one's communicator is left
                    # as it is: destroying it could wait for the rank that is gone)
                    log.warning("shard follower at %s went away; its %d-shard group is dropped", f.address,
                                self.size)
                    self.broken = True
                    return

    def _send_all(self, part):
        """A message to every follower: part(rank, rid, blocks) -> the message, its tensors put in
        (or reserved in) the arena by `blocks` (a _Blocks), which holds them until _collect."""
        self.inflight, self.inflight_since = True, time.monotonic()
        rids = []
        for rank, f in enumerate(self.followers, start=1):
            rid, blocks = next(self._rids), _Blocks(self.arena)
            f.send(part(rank, rid, blocks))
            rids.append((f, rid, blocks))
        return rids

    def _collect(self, rids, join=None):
        """join(every follower's answer, views of the arena) once all have come, or the group ends;
        by default the answers copied out. The blocks go back after join: it reads them where they
        lie (a frame group's bands are joined straight from them, no copy on the way)."""
        deadline = self.inflight_since + self.deadline_s
        try:
            for f, rid, _ in rids:
                with f.cond:
                    if not f.cond.wait_for(lambda f=f, rid=rid: rid in f.answers,
                                           max(0.0, deadline - time.monotonic())):
                        end_group(f"the shard follower at {f.address} gave no answer in {self.deadline_s:.0f} s")
                    error = f.answers.pop(rid)
                if error is not None:
                    end_group(f"the shard follower at {f.address} failed: {error.message}")
            views = [self.arena.array(blocks.out) for _, _, blocks in rids if blocks.out is not None]
            return join(views) if join is not None else [np.array(v) for v in views]
        finally:
            for _, _, blocks in rids:
                blocks.free()
            self.inflight = False

    def decode(self, hm, latents: np.ndarray, clamp: bool, uint8: bool, alpha: bool = False) -> np.ndarray:
        model = hm.model
        total = latents.shape[sharding.LATENT_ROWS]
        bands = split(latents, sharding.bands(model, latents.shape, self.size), axis=sharding.LATENT_ROWS)

        def part(rank, rid, blocks):
            return wp.ShardDecode(rid, hm.name, rank, self.size, total, clamp, uint8, blocks.put(bands[rank]),
                                  blocks.reserve(hm.output_shape(bands[rank].shape, alpha),
                                                 "uint8" if uint8 else "float32"), alpha)

        rids = self._send_all(part)
        try:
            own = pixels(sharding.decode_band(model, self.comm, bands[0], total, clamp, alpha), uint8)
        except Exception as exc:
            end_group(f"the leader's band failed: {type(exc).__name__}: {exc}")
        return self._collect(rids, lambda bands: np.concatenate([own, *bands], axis=sharding.PIXEL_ROWS))


    def frames(self, hm, latents: np.ndarray, uint8: bool, key: int):
        """A video's frame groups decoded by the group, each joined as every rank completes it
        (the leader's stream_next steps it on its device thread, as any stream's)."""
        model = hm.model
        total = latents.shape[sharding.LATENT_ROWS]
        bands = split(latents, sharding.bands(model, latents.shape, self.size), axis=sharding.LATENT_ROWS)
        self._collect(self._send_all(lambda rank, rid, blocks: wp.ShardStreamOpen(
            rid, hm.name, rank, self.size, key, total, uint8, blocks.put(bands[rank]))))
        own = sharding.frame_groups_band(model, self.comm, bands[0], total, uint8=uint8)
        try:
            for k in range(latents.shape[2]):
                frames = 1 if k == 0 else int(model.temporal_factor)

                def part(rank, rid, blocks, k=k, frames=frames):
                    n, _, h, w, c = hm.output_shape(bands[rank].shape)
                    return wp.ShardStreamNext(rid, hm.name, rank, self.size, key, k,
                                              blocks.reserve((n, frames, h, w, c), "uint8" if uint8 else "float32"))

                rids = self._send_all(part)
                try:
                    mine = next(own)
                except Exception as exc:
                    end_group(f"the leader's band of frame group {k} failed: {type(exc).__name__}: {exc}")
                yield self._collect(rids, lambda bands, mine=mine: np.concatenate([mine, *bands],
                                                                                  axis=sharding.PIXEL_ROWS))
        finally:
            own.close()
            for f in self.followers:  # their generators go too (a plain message: nothing runs)
                try:
                    f.send(wp.ShardStreamClose(key))
                except OSError:
                    pass


class ShardLeader:
    """Worker 0's sharded decodes (ModelHost.call_for's `shards` option) and streams."""

    def __init__(self, addresses: tuple[str, ...], comm_cls=None, fault=None, deadline_s: float = DEADLINE_S,
                 on_gpu: bool = False, *, shm_bytes: int):
        self.comm_cls = comm_cls  # comm_class(): None emulates the shards here (never on GPUs)
        self.on_gpu = on_gpu
        self.deadline_s = deadline_s  # a group busy longer than this ends (its first call builds plans)
        self.fault = fault  # fault_injection.shard_fault(): a test-only wrapper of one rank's communicator
        self.addresses = addresses  # every worker's, in device order; this worker's is the first
        self.groups: dict[int, _Group] = {}
        self.arena: Arena | None = None
        self.arena_bytes = arena_bytes(shm_bytes, len(addresses))
        self._stream_keys = itertools.count(1)

    def _check(self, hm) -> None:
        sharding.check(hm.model)
        if self.comm_cls is None and self.on_gpu:  # the front ends refuse these first
            raise ValueError("sharded requests on GPUs are off (CONVSERVE_SHARD_GROUPS)")

    def _group(self, model: str, shards: int) -> _Group:
        if shards > len(self.addresses):
            raise ValueError(f"shards={shards}, but this server runs {len(self.addresses)} devices")
        group = self.groups.get(shards)
        if group is None or group.broken:
            self.arena = self.arena or Arena(self.arena_bytes)
            group = self.groups[shards] = _Group(list(self.addresses[1:shards]), model, self.arena, self.comm_cls,
                                                 self.deadline_s)
        return group

    def frames(self, hm, latents: np.ndarray, shards: int, uint8: bool):
        """A streamed video decode over `shards` devices: its frame groups, joined (a generator
        stepped by the worker's stream_next)."""
        self._check(hm)
        if self.comm_cls is not None:
            yield from self._group(hm.name, shards).frames(hm, latents, uint8, next(self._stream_keys))
            return
        groups = sharding.frame_groups_emulated(hm.model, latents, shards, comm_wrapper=self.fault, uint8=uint8)
        try:
            for out in groups:  # an error comes from a step of the groups: only they run inside
                yield out
        except Exception as exc:
            raise ShardFailed(f"sharded decode over {shards} emulated shards failed: "
                              f"{type(exc).__name__}: {exc}") from exc
        finally:
            groups.close()

    def decode(self, hm, latents: np.ndarray, shards: int, clamp: bool, uint8: bool, alpha: bool = False) -> np.ndarray:
        self._check(hm)
        if self.comm_cls is None:
            try:
                out = sharding.decode_emulated(hm.model, latents, shards, clamp, comm_wrapper=self.fault, alpha=alpha)
            except Exception as exc:
                raise ShardFailed(f"sharded decode over {shards} emulated shards failed: "
                                  f"{type(exc).__name__}: {exc}") from exc
            return pixels(out, uint8)
        return self._group(hm.name, shards).decode(hm, latents, clamp, uint8, alpha)
