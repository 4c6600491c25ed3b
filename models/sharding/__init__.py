"""The one runner of a decode split by latent rows over shards: the service's model workers
(its shard leader and members), the CLI's shard group, the benchmarks and the tests' emulated
shards all call here, and none knows a family.

A family offers a row-split decode by naming it in its FAMILY (ModelFamily.row_sharding): every
decoder family does (SD/SDXL/FLUX.1, FLUX.2, Qwen-Image, Qwen-Image 2.1, TAESD, HunyuanImage 2.1, LTX-2, SANA's DC-AE, Wan 2.1 and 2.2);
encoders do not. There is no second walk of any decoder: each shard runs the model's own decode on its rows
of the latents with its RowShard current (models/nn/row_shard.py), and the layers that need
other shards' rows exchange them through the shard's communicator. The decode is untiled; its
de-normalisation, unpatchify and output clip are row-local and run on each shard as they are.

Latent rows are axis -2 of every family's latents (N,C,h,w; N,C,T,h,w; N,C,1,h,w) and pixel rows
axis -3 of its pixels (N,H,W,3, an AlphaDecoder's RGBA N,H,W,4; N,F,H,W,3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from convkernels.collectives.shard_comm import ShardComm, run_sharded, run_together, split, split_rows, thread_group

from ..contract import VIDEO_DECODER
from ..nn.row_shard import RowShard
from ..registry import FAMILIES as FAMILY_PACKAGES, family_of
from ..wan_vae.chunk_plan import ChunkPlan

__all__ = ["ChunkPlan", "LATENT_ROWS", "OFFERED", "PIXEL_ROWS", "ShardedFamily", "bands", "check", "decode_band",
           "declared", "decode_emulated", "family", "family_modules", "frame_groups_band", "frame_groups_emulated"]

#: the latents' and the pixels' row axes, for every family
LATENT_ROWS, PIXEL_ROWS = -2, -3


@dataclass(frozen=True)
class ShardedFamily:
    """A family whose decode splits by rows: `name` (its FAMILY's row_sharding: what
    service's measured shard rules are kept by) and whether it is a video decoder (its frame
    groups stream)."""
    name: str
    video: bool


def _read_declarations() -> dict[str, ShardedFamily]:
    out = {}
    for package in FAMILY_PACKAGES:
        fam = family_of(package, {})
        if fam is not None and fam.row_sharding:
            out[package] = ShardedFamily(fam.row_sharding, fam.kind == VIDEO_DECODER)
    return out


_DECLARED: dict[str, ShardedFamily] | None = None


def declared() -> dict[str, ShardedFamily]:
    """models/<package> -> its ShardedFamily, for every family package that declares one (read
    from the FAMILY declarations once)."""
    global _DECLARED
    if _DECLARED is None:
        _DECLARED = _read_declarations()
    return _DECLARED


def family_modules() -> set[str]:
    """The family packages (models/<family>/) whose models decode sharded: a preset's
    (models.registry.PresetInfo.family) is checked by it before any model loads."""
    return set(declared())


def _titles() -> str:
    titles = [family_of(p, {}).title for p in FAMILY_PACKAGES if p in declared()]
    return ", ".join(titles[:-1]) + " and " + titles[-1] if len(titles) > 1 else "".join(titles)


def __getattr__(name: str):
    if name == "OFFERED":  # what a refusal names: every family that offers a row-split decode
        return f"the {_titles()} decoders"
    raise AttributeError(name)


def family(model) -> ShardedFamily | None:
    """The model's sharded family (by the package its class is defined in), or None where its
    family offers no row-split decode."""
    parts = type(model).__module__.split(".")
    if len(parts) < 2 or parts[0] != __package__.split(".")[0]:
        return None
    return declared().get(parts[1])


def check(model) -> ShardedFamily:
    """model's sharded family, or a ValueError that names it."""
    fam = family(model)
    if fam is None:
        raise ValueError(f"{model.name}: a sharded decode is offered for the {_titles()} decoders, "
                         f"not {type(model).__name__}")
    return fam


def bands(model, latents_shape: tuple[int, ...], shards: int) -> list[tuple[int, int]]:
    """Each shard's [start, stop) latent rows; a ValueError when there are fewer rows than shards."""
    check(model)
    return split_rows(latents_shape[LATENT_ROWS], shards)


def _shard(comm: ShardComm, band, total_rows: int) -> RowShard:
    return RowShard(comm, int(total_rows), int(np.shape(band)[LATENT_ROWS]))


def decode_band(model, comm: ShardComm, band: np.ndarray, total_rows: int, clamp: bool = True,
                alpha: bool = False) -> np.ndarray:
    """This shard's rows of model.decode(latents, tiled=False, clamp=clamp), float32 pixels: band
    is its rows of the latents as the pipeline hands them, of the whole's total_rows (split as
    bands() splits them); every shard of the group calls this together. alpha: an AlphaDecoder's
    RGBA rows (model.decode_rgba; models/contract.py)."""
    check(model)
    with _shard(comm, band, total_rows).running():
        if alpha:
            return model.decode_rgba(band, tiled=False)
        return model.decode(band, tiled=False, clamp=clamp)


def frame_groups_band(model, comm: ShardComm, band: np.ndarray, total_rows: int, clamp: bool = True,
                      plan: ChunkPlan | None = None, uint8: bool = False) -> Iterator[np.ndarray]:
    """A video decoder's frame groups (model.decode_frames, untiled), this shard's rows of each
    (every shard steps together); band is its rows of the latents, split from the whole's
    total_rows by bands(). plan: how the shards step their latent frames (benchmarks compare
    plans; by default the bands decide, models/wan_vae/chunk_plan.py). uint8=True: uint8 pixels,
    converted on the device. Bad latents raise here, before the first group."""
    if not check(model).video:
        raise ValueError(f"{model.name}: a streamed sharded decode is a video decoder's")
    shard = _shard(comm, band, total_rows)
    with shard.running():
        groups = model.decode_frames(band, tiled=False, uint8=uint8, clamp=clamp, chunks=plan)
    return shard.steps(groups)


def decode_emulated(model, latents: np.ndarray, shards: int, clamp: bool = True,
                    comm_wrapper=None, alpha: bool = False) -> np.ndarray:
    """model.decode(latents, tiled=False) on `shards` emulated shards of one backend (threads,
    convkernels.collectives.shard_comm.ThreadShards): each band decoded by decode_band, the pixel rows joined.
    comm_wrapper(comm, rank) -> comm, if given, stands between each shard and its communicator
    (tests and injected faults break one shard with it). alpha: decode_band's."""
    lat = np.asarray(latents)
    parts = split(lat, bands(model, lat.shape, shards), axis=LATENT_ROWS)

    def shard(comm, rank):
        return decode_band(model, comm_wrapper(comm, rank) if comm_wrapper else comm, parts[rank],
                           lat.shape[LATENT_ROWS], clamp, alpha)

    return np.concatenate(run_sharded(shards, shard), axis=PIXEL_ROWS)


def frame_groups_emulated(model, latents: np.ndarray, shards: int, clamp: bool = True,
                          comm_wrapper=None, uint8: bool = False) -> Iterator[np.ndarray]:
    """model.decode_frames(latents, tiled=False, uint8=uint8) on `shards` emulated shards: each
    group's rows from every shard, joined, as the shards complete it."""
    lat = np.asarray(latents)
    parts = split(lat, bands(model, lat.shape, shards), axis=LATENT_ROWS)
    comms = thread_group(shards)
    total = lat.shape[LATENT_ROWS]
    gens = [frame_groups_band(model, comm_wrapper(c, c.rank) if comm_wrapper else c, parts[c.rank], total, clamp,
                              uint8=uint8) for c in comms]
    try:
        for _ in range(lat.shape[2]):  # one group per latent frame
            yield np.concatenate(run_together(comms, [g.__next__ for g in gens]), axis=PIXEL_ROWS)
    finally:
        for g in gens:
            g.close()

