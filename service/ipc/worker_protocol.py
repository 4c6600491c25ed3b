"""The wire protocol between the service's processes: what an HTTP front end (service/frontend/engine.py)
and a model worker (service/worker/model_worker.py) say to each other, and what a shard group's leader
(service/worker/shard_leader.py) says to its followers. One type per message, all of them here, and the
only place they are encoded and decoded.

Each message is a msgspec Struct in one tagged union, sent as one MessagePack frame
(`Connection.send_bytes` / `recv_bytes` of multiprocessing.connection, over the worker's Unix
socket). Why not pickled tuples: a typed message is checked where it is decoded (a wrong field is
an error there, not a KeyError three calls later), every field has a name, and encoding and
decoding a request's messages costs about a tenth as much (benchmarks/service/worker_protocol.py). Array-like Structs: a
message is a MessagePack array, its tag first; both ends are always the same version of this file.

Arrays never travel in a message: a message names them (`TensorRef`) in the sender's shared-memory
arena (service/ipc/shm.py), whose descriptor follows the hello over the same socket (SCM_RIGHTS).

Front end -> worker:
  Hello                          then the arena's descriptor; answered by a Status
  Submit(rid, model, op, options, input, outputs)
      op: decode | encode | vae_encode (batched; decode's options.shards=N: a shard group's,
      led by the worker, service/worker/shard_leader.py); encode_jpeg (encode, input a JPEG
      file's bytes, 1 x n uint8, decoded by the worker: only to a worker whose Status lists the
      model in jpeg_models); stream_open (a streamed decode of input's latents; answers its
      stream id); stream_next (options.stream: its next frame group)
  SubmitMany(subs)               the Submits a front end's event loop had ready for this worker
      in one turn, in one message: read, decoded and queued together (one frame, one wake-up of
      the device thread), each still answered on its own (a bad one fails alone)
  Cancel(rid)   StreamClose(stream)   Query(rid, what: kernels | stats)
A shard group's leader -> a follower (its own hello and ops: it does not pose as a front end):
  LeaderHello                    then the leader's arena's descriptor; answered by a Status
  ShardJoin   ShardDecode   ShardStreamOpen   ShardStreamNext   ShardStreamClose
Worker -> front end (or leader):
  Status(device, state, models, ...)     on connect and whenever it changes
  Started(rids)                          a model call began with these requests (one per model
                                         call and front end)
  Done(rid, error, stream)               error: a WorkerError (service/ipc/worker_errors.py's kinds)
  DoneMany(answers, started)             a batch's answers to one front end, in one message, and
                                         the rids of calls begun meanwhile (what a Started says)
  KernelsAnswer(rid, doc)   StatsAnswer(rid, records)   a Query's answer
"""
from __future__ import annotations

from typing import Any, Union

import msgspec
import numpy as np

from ..hosted_model import ModelView
from ..model_stats import ModelRecord
from ..settings import ModelEntry
from .shm import TensorRef

__all__ = ["Cancel", "Done", "DoneMany", "Hello", "KernelsAnswer", "LeaderHello", "Message", "ModelStatus",
           "Options", "ProtocolError", "Query", "ShardDecode", "ShardJoin", "ShardStreamClose", "ShardStreamNext", "ShardStreamOpen",
           "Started", "StatsAnswer", "Status", "StreamClose", "Submit", "SubmitMany", "TensorRef", "WorkerError", "decode",
           "encode", "recv", "send"]


class _Msg(msgspec.Struct, array_like=True, tag=True, frozen=True):
    """A message: tagged with its class name in the union."""


class Options(msgspec.Struct, frozen=True, omit_defaults=True):
    """A submit's options (frozen: hashable, part of the batcher's key of equal work)."""
    tiled: bool | None = None   # decode, stream_open: None lets the model choose
    clamp: bool = True          # decode
    uint8: bool = False         # decode, stream_open: pixels as uint8, converted on the device
    shards: int = 1             # decode, stream_open: N>1 runs on a shard group of N devices
    alpha: bool = False         # decode: an AlphaDecoder's RGBA pixels (N,H,W,4), not its RGB
    stream: int | None = None   # stream_next: the stream's id (stream_open's answer)


# ---- front end -> worker -----------------------------------------------------------------------
class Hello(_Msg):
    pid: int
    arena_size: int


class Submit(_Msg):
    rid: int
    model: str
    op: str
    options: Options
    input: TensorRef | None
    outputs: dict[str, TensorRef]


class SubmitMany(_Msg):
    """Several Submits in one frame (service/frontend/engine.py coalesces what one turn of its
    event loop submits to a worker): the worker's per-message cost (a read, a decode, a wake-up of
    its device thread) is paid once for all of them."""
    subs: list[Submit]


class Cancel(_Msg):
    rid: int


class StreamClose(_Msg):
    stream: int


class Query(_Msg):
    rid: int
    what: str


# ---- a shard leader -> its followers (service/worker/shard_leader.py, service/worker/shard_member.py) ----------
class LeaderHello(_Msg):
    pid: int
    arena_size: int


class ShardJoin(_Msg):
    rid: int
    model: str  # the request's that made the group (the batcher's metrics label its join with it)
    rank: int
    size: int
    # the communicator's group id, exactly as its unique_id() made it: NCCL's is bytes in CuPy 14
    # (a tuple of ints in older CuPy), the test communicator's a tuple; its join takes it back as is
    uid: bytes | tuple


class ShardDecode(_Msg):
    rid: int
    model: str
    rank: int
    size: int
    total_rows: int
    clamp: bool
    uint8: bool
    input: TensorRef   # the band's latents
    output: TensorRef  # its pixels
    alpha: bool = False  # RGBA pixels (decode_rgba), as the request's Options.alpha


class ShardStreamOpen(_Msg):
    rid: int
    model: str
    rank: int
    size: int
    stream: int
    total_rows: int
    uint8: bool
    input: TensorRef   # the band's latents (the follower keeps a copy)


class ShardStreamNext(_Msg):
    rid: int
    model: str
    rank: int
    size: int
    stream: int
    step: int
    output: TensorRef  # the band's frame group


class ShardStreamClose(_Msg):
    stream: int


# ---- worker -> front end (or leader) -----------------------------------------------------------
class ModelStatus(msgspec.Struct, array_like=True, frozen=True):
    """One model a worker serves, as a front end needs it (service/hosted_model.py's HostedModel fields)."""
    entry: ModelEntry
    view: ModelView
    load_seconds: float
    warmup_seconds: float | None
    extra: dict[str, Any]


class Status(_Msg):
    device: str
    state: str  # connecting (a front end's before the first) | loading | ready | failed | down
    gpu: str | None = None
    pid: int | None = None
    load_error: str | None = None
    failed: dict[str, str] = {}
    backend: str | None = None
    models: dict[str, ModelStatus] = {}
    row_seconds: float = 0.0
    #: the families whose decode splits over devices (models.sharding.OFFERED): what a front end's
    #: refusal of a sharded decode names, without the front end importing any model code
    shard_offered: str = ""
    #: the models whose encode takes JPEG files (op encode_jpeg): decoded in the worker
    #: (service/worker/jpeg_bodies.py), on the GPU's JPEG engines where it has them
    jpeg_models: list[str] = []

    def down(self) -> Status:
        """As a front end shows its worker while the link is lost."""
        return msgspec.structs.replace(self, state="down")


class Started(_Msg):
    rids: list[int]


class WorkerError(msgspec.Struct, array_like=True, frozen=True):
    """Why a request failed: its kind (service/ipc/worker_errors.py's table), a message, the log's id."""
    kind: str
    message: str
    error_id: str | None = None


class Done(_Msg):
    rid: int
    error: WorkerError | None = None
    stream: int | None = None  # stream_open's answer: the stream's id


class DoneMany(_Msg):
    answers: list[Done]
    #: requests whose model call began, said here instead of in a Started of their own (one
    #: message per front end a drain of the worker's delivery queue)
    started: list[int] = []


class KernelsAnswer(_Msg):
    rid: int
    doc: dict[str, Any] | None


class StatsAnswer(_Msg):
    rid: int
    records: dict[str, ModelRecord]


Message = Union[Hello, Submit, SubmitMany, Cancel, StreamClose, Query, LeaderHello, ShardJoin, ShardDecode, ShardStreamOpen,
                ShardStreamNext, ShardStreamClose, Status, Started, Done, DoneMany, KernelsAnswer, StatsAnswer]


def _enc_hook(obj: Any) -> Any:
    """NumPy scalars in a card or a kernels document travel as the Python values they hold."""
    if isinstance(obj, np.generic):
        return obj.item()
    raise NotImplementedError(f"{type(obj).__name__} cannot cross the worker protocol")


#: what decode raises for bytes that are not a message of this protocol (a ValueError)
ProtocolError = msgspec.DecodeError

_encoder = msgspec.msgpack.Encoder(enc_hook=_enc_hook)  # thread-safe: one for every thread
_decoder = msgspec.msgpack.Decoder(Message)


def encode(msg: Message) -> bytes:
    return _encoder.encode(msg)


def decode(data: bytes) -> Message:
    """One message; msgspec.ValidationError (a ValueError) for one that breaks the protocol."""
    return _decoder.decode(data)


def send(conn, msg: Message) -> None:
    conn.send_bytes(_encoder.encode(msg))


def recv(conn) -> Message:
    return _decoder.decode(conn.recv_bytes())
