"""A decode split by latent rows over shards: the one thing a layer is told about its shard.

Rules (Megatron's parallel layers and xDiT's PatchConv work this way: a layer is told its shard,
and the model keeps one forward):
- A model has one forward. A runner (models/sharding) makes a shard current for the calls that
  run it (`RowShard.current()` inside `with shard.running():`); the layers read it. None (no shard current)
  is the unsharded decode, and every layer then runs exactly the ops it always ran.
- A shard holds its communicator (convkernels.collectives.shard_comm.ShardComm: rank order is row
  order) and its band: the whole's latent rows and its own. The row scale at a layer (the rows it
  sees per latent row: 2 after an upsample, 2 more for FLUX.2's unpatchify) is read from the
  activation it is given, so a family needs nothing besides its forward to be shardable.
- Which layers talk to other shards: a conv with a kernel taller than one row (halo rows from its
  neighbours), GroupNorm (the whole image's statistics, one all-reduce), the mid-block attentions
  (every shard's keys and values, all-gathered) and the upsamplers (one halo row). RMS norms over
  channels, activations, 1x1 convs, time convs and unpatchify are row-local and run as they are.
- A layer that cannot run on a band refuses (a stride-2 conv): a decoder is shardable when each
  of its layers is, which the emulated-shard tests check family by family.
- A shard never stops alone: models/nn/interrupt.check() does not raise while a shard is current
  (the others would wait in their next collective for ever).
- The current shard is per thread and per context (a ContextVar), so threads emulating a group
  (ThreadShards) each see their own.
"""
from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Iterator

from convkernels.collectives.shard_comm import ShardComm, split_rows

_CURRENT: ContextVar["RowShard | None"] = ContextVar("row_shard", default=None)


@dataclass(frozen=True)
class RowShard:
    """One shard of a row-split decode: `comm`, and its band of `own` latent rows out of the
    whole's `whole` (split as split_rows splits them: the shards' bands in rank order). Equal
    shards (the same communicator and band) hash alike: a recorded forward, whose collectives are
    captured with it, is kept per shard and replayed by the next decode of the same band."""
    comm: ShardComm
    whole: int
    own: int

    def __post_init__(self) -> None:
        if not 0 < self.own <= self.whole:
            raise ValueError(f"a band of {self.own} rows out of {self.whole} is not a band")

    # ---- being current ----------------------------------------------------------------------------
    @staticmethod
    def current() -> "RowShard | None":
        """The shard the running forward computes, or None (unsharded)."""
        return _CURRENT.get()

    @contextmanager
    def running(self) -> Iterator["RowShard"]:
        """This shard is current inside the block (and the one before it again after)."""
        token = _CURRENT.set(self)
        try:
            yield self
        finally:
            _CURRENT.reset(token)

    def steps(self, gen: Iterator[Any]) -> Iterator[Any]:
        """gen's items, each computed with this shard current: a generator's body runs when it is
        asked for its next item, not where it was made, so a lazy decode (a video's frame groups)
        is stepped here."""
        try:
            while True:
                with self.running():
                    try:
                        item = next(gen)
                    except StopIteration:
                        return
                yield item
        finally:
            with self.running():
                gen.close()

    # ---- what the layers ask ----------------------------------------------------------------------
    @property
    def first(self) -> bool:
        """Holds the image's own top rows (no neighbour above: the conv pads zero rows there)."""
        return self.comm.rank == 0

    @property
    def last(self) -> bool:
        """Holds the image's own bottom rows."""
        return self.comm.rank == self.comm.size - 1

    def edge_pad(self, pad: int) -> tuple[int, int]:
        """A 'same' conv's zero rows (top, bottom) on this shard: `pad` at the image's own edges,
        none between shards (the halo rows stand there)."""
        return (pad if self.first else 0, pad if self.last else 0)

    @property
    def rows(self) -> tuple[int, int]:
        """(the whole's, this shard's) latent rows: at any one scale their ratio turns a shard's
        element count into the whole's (convkernels.sharded_ops.exact_group_norm)."""
        return self.whole, self.own

    def scale(self, rows: int) -> int:
        """The rows a layer sees per latent row of the band, from the `rows` it was given."""
        if rows % self.own:
            raise ValueError(f"a layer's {rows} rows are not a whole multiple of the band's {self.own} latent rows")
        return rows // self.own

    def token_counts(self, rows: int, width: int) -> list[int]:
        """Every shard's token count at the scale of an activation of `rows` x `width` on this
        shard, rank order: what an all-gather of a layer's tokens brings from each, known without
        asking (the bands are split_rows of the whole)."""
        s = self.scale(rows)
        return [(hi - lo) * s * width for lo, hi in split_rows(self.whole, self.comm.size)]


def current() -> RowShard | None:
    """RowShard.current(), for layers."""
    return _CURRENT.get()
