"""How a Wan decode steps its latent frames after the first: one at a time through a recorded
graph unsharded, and in runs of frames on a row shard whose band is small (models/nn/row_shard.py).

The first latent frame always goes alone: it gives one frame and changes the cache's layout. Any
run of frames is exact: the causal convs read the cached frames in front of the run, the time
doubling interleaves each input frame's two outputs, the attention is per frame (diffusers' own
encoder steps 1 then 4). A longer run gives a shard's kernels more work each (a band of 15 latent
rows leaves an H200's kernels short) and halves the launches and exchanges, at its activations'
memory.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ChunkPlan:
    """`frames` latent frames at a time after the first, and the steady chunks (the third on)
    through a recorded graph where `graphed` (and the backend records one)."""
    frames: int
    graphed: bool


#: the unsharded decode's: one latent frame at a time, steady frames replayed from a graph
UNSHARDED = ChunkPlan(1, True)

#: (a shard's latent positions per frame (band rows x width) up to, its chunk plan); larger bands
#: step one frame at a time, eagerly. Measured 2026-11-26 (benchmarks/HISTORY.md, "Sharded Wan in
#: runs of latent frames"), Wan 2.1 81x480x832 bf16: on 4 GPUs (15 x 104 = 1560 positions) runs of
#: 3 took 283.8 ms on 4x H200 (4: 269.7 ms at 1.24x the memory; one frame graphed, the earlier
#: default, 370 ms against 2 eager 350 on 4x H100); on 2 GPUs (3120) runs of 2 took 520.3 ms (4:
#: no faster, at 1.8x the memory). Graphed runs were slower than eager ones on both (a graph's pool
#: holds the run's activations and the causal cache twice more). 121x720x1280 on 4 GPUs (3680) ran
#: one frame at a time in 1072 ms at 0.35x one GPU's memory.
CHUNK_RULES: tuple[tuple[int, ChunkPlan], ...] = ((1600, ChunkPlan(3, False)), (3200, ChunkPlan(2, False)))
ONE_FRAME_EAGER = ChunkPlan(1, False)


def chunk_plan(band_positions: int) -> ChunkPlan:
    """The plan for a shard whose band has this many latent positions per frame (CHUNK_RULES)."""
    return next((plan for limit, plan in CHUNK_RULES if band_positions <= limit), ONE_FRAME_EAGER)
