"""Which served models a decode can be split over shards for, and the one call each shard makes
(issue #32): the service's model workers (service/shard_leader.py) and the standalone group
(service/shard_group.py) ask here instead of knowing the families.

Two families are sharded, by latent rows:
- the AutoencoderKL image VAEs (SD, SDXL, FLUX.1): models/sharded_decode.py, latents N,C,h,w;
- the Wan 2.1 video VAE: models/sharded_wan_decode.py, latents N,C,T,h,w.
Every other family (FLUX.2, TAESD, Qwen-Image, Wan 2.2) is refused by name: a layer walk written
for another architecture would decode it wrongly rather than fail.
"""
from __future__ import annotations

import numpy as np

from typing import Iterator

from convkernels.shard_comm import ShardComm, run_sharded, run_together, split, split_rows, thread_group

from .autoencoder_kl import AutoencoderKLModel
from .sharded_decode import sharded_decode
from .sharded_wan_decode import ChunkPlan, sharded_wan_decode, sharded_wan_frame_groups
from .wan_vae import WanVAEDecoder

IMAGE, VIDEO = "image", "video"


def family(model) -> str | None:
    """IMAGE, VIDEO, or None where no sharded decode is written for the model's family. Exact
    types: Qwen-Image and Wan 2.2 subclass the Wan 2.1 decoder but differ in layout."""
    if type(model) is AutoencoderKLModel:
        return IMAGE
    if type(model) is WanVAEDecoder:
        return VIDEO
    return None


def check(model) -> str:
    """model's family, or a ValueError that names it."""
    fam = family(model)
    if fam is None:
        raise ValueError(f"{model.name}: a sharded decode is offered for the AutoencoderKL image VAEs (SD, SDXL, "
                         f"FLUX.1) and the Wan 2.1 video VAE, not {type(model).__name__}")
    return fam


def rows_axis(fam: str) -> int:
    """The latents' row axis (N,C,h,w or N,C,T,h,w); the pixels' is one less (N,H,W,3, N,F,H,W,3)."""
    return 2 if fam == IMAGE else 3


def bands(model, latents_shape: tuple[int, ...], shards: int) -> list[tuple[int, int]]:
    """Each shard's [start, stop) latent rows; a ValueError when there are fewer rows than shards."""
    return split_rows(latents_shape[rows_axis(check(model))], shards)


def decode_band(model, comm: ShardComm, band: np.ndarray, total_rows: int, clamp: bool = True) -> np.ndarray:
    """This shard's rows of model.decode(latents, tiled=False), float32 pixels: band is its rows
    of the latents as the pipeline hands them; every shard of the group calls this together."""
    if check(model) == IMAGE:
        return sharded_decode(model, comm, band, clamp, total_rows=total_rows)
    return sharded_wan_decode(model, comm, band, clamp, total_rows=total_rows)


def decode_emulated(model, latents: np.ndarray, shards: int, clamp: bool = True,
                    comm_wrapper=None) -> np.ndarray:
    """model.decode(latents, tiled=False) on `shards` emulated shards of one backend (threads,
    convkernels.shard_comm.ThreadShards): each band decoded by decode_band, the pixel rows joined.
    comm_wrapper(comm, rank) -> comm, if given, stands between each shard and its communicator
    (tests and injected faults break one shard with it)."""
    lat = np.asarray(latents)
    axis = rows_axis(check(model))
    parts = split(lat, bands(model, lat.shape, shards), axis=axis)

    def shard(comm, rank):
        return decode_band(model, comm_wrapper(comm, rank) if comm_wrapper else comm, parts[rank],
                           lat.shape[axis], clamp)

    return np.concatenate(run_sharded(shards, shard), axis=axis - 1)


def frame_groups_band(model, comm: ShardComm, band: np.ndarray, total_rows: int,
                      clamp: bool = True, plan: ChunkPlan | None = None,
                      uint8: bool = False) -> Iterator[np.ndarray]:
    """A video decoder's frame groups, this shard's rows of each (every shard steps together);
    band is its rows of the latents, split from the whole's total_rows by bands(). plan: how
    the shards step their frames (benchmarks compare plans; by default the band decides).
    uint8=True: uint8 pixels, converted on the device."""
    if check(model) != VIDEO:
        raise ValueError(f"{model.name}: a streamed sharded decode is a video decoder's")
    return sharded_wan_frame_groups(model, comm, band, clamp, total_rows=total_rows, plan=plan, uint8=uint8)


def frame_groups_emulated(model, latents: np.ndarray, shards: int, clamp: bool = True,
                          comm_wrapper=None, uint8: bool = False) -> Iterator[np.ndarray]:
    """model.decode_frames(latents, tiled=False, uint8=uint8) on `shards` emulated shards: each
    group's rows from every shard, joined, as the shards complete it."""
    lat = np.asarray(latents)
    parts = split(lat, bands(model, lat.shape, shards), axis=rows_axis(check(model)))
    comms = thread_group(shards)
    total = lat.shape[rows_axis(VIDEO)]
    gens = [frame_groups_band(model, comm_wrapper(c, c.rank) if comm_wrapper else c, parts[c.rank], total, clamp,
                              uint8=uint8) for c in comms]
    try:
        for _ in range(lat.shape[2]):
            yield np.concatenate(run_together(comms, [g.__next__ for g in gens]), axis=2)
    finally:
        for g in gens:
            g.close()
