"""Which served models a decode can be split over shards for, and the one call each shard makes:
the service's model workers (service/shard_leader.py) and the standalone group
(service/shard_group.py) ask here instead of knowing the families.

Five families are sharded, by latent rows (FAMILIES, one place):
- the AutoencoderKL image VAEs (SD, SDXL, FLUX.1): models/sharding/autoencoder_kl.py, latents N,C,h,w;
- FLUX.2's, the same decoder behind its BatchNorm de-normalisation and 2x2 unpatchify (a
  latent row of its patched grid is two of the decoder's: row-local);
- the Wan 2.1 video VAE and Wan 2.2's (its residual up blocks and output patches):
  models/sharding/wan.py, latents N,C,T,h,w;
- Qwen-Image's, the Wan 2.1 decoder on one frame, latents N,C,h,w or N,C,1,h,w.
TAESD is not: it has no norm and no attention, so its shards would only trade halos, and one
GPU decodes a 1024x1024 image in ~2 ms; sharding cannot pay there. A family not in FAMILIES is
refused by name: a layer walk written for another architecture would decode it wrongly rather
than fail.

Latent rows are axis -2 of every family's latents (N,C,h,w; N,C,T,h,w; N,C,1,h,w) and pixel rows
axis -3 of its pixels (N,H,W,3; N,F,H,W,3).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from convkernels.collectives.shard_comm import ShardComm, run_sharded, run_together, split, split_rows, thread_group

from ..autoencoder_kl.model import AutoencoderKLModel
from ..flux2_vae.model import Flux2VAEModel
from ..qwen_image_vae.model import QwenImageVAEDecoder
from .autoencoder_kl import sharded_decode
from .wan import ChunkPlan, sharded_wan_decode, sharded_wan_frame_groups
from ..wan22_vae.model import Wan22VAEDecoder
from ..wan_vae.model import WanVAEDecoder

#: the latents' and the pixels' row axes, for every family
LATENT_ROWS, PIXEL_ROWS = -2, -3


def _image_band(model, comm: ShardComm, band, total_rows: int, clamp: bool) -> np.ndarray:
    return sharded_decode(model, comm, band, clamp, total_rows=total_rows)


def _wan_band(model, comm: ShardComm, band, total_rows: int, clamp: bool) -> np.ndarray:
    return sharded_wan_decode(model, comm, band, clamp, total_rows=total_rows)


def _qwen_image_band(model, comm: ShardComm, band, total_rows: int, clamp: bool) -> np.ndarray:
    # its one latent frame through the Wan decode; always clamped, as QwenImageVAEDecoder.decode
    return sharded_wan_decode(model, comm, model._one_frame(band), True, total_rows=total_rows)[:, 0]


@dataclass(frozen=True)
class ShardedFamily:
    """A family whose decode splits by rows: `name` (what service.shard_option's measured rules
    are kept by), whether it is a video decoder (its frame groups stream), and the call that
    decodes one shard's band: (model, comm, band, total_rows, clamp) -> its pixel rows."""
    name: str
    video: bool
    decode_band: Callable[..., np.ndarray]


#: by exact type: Flux2VAEModel, Wan22VAEDecoder and QwenImageVAEDecoder subclass the first and
#: third, and each needs its own entry (its latents or its layers differ)
FAMILIES: dict[type, ShardedFamily] = {
    AutoencoderKLModel: ShardedFamily("autoencoder-kl", False, _image_band),
    Flux2VAEModel: ShardedFamily("flux2", False, _image_band),
    WanVAEDecoder: ShardedFamily("wan2.1", True, _wan_band),
    Wan22VAEDecoder: ShardedFamily("wan2.2", True, _wan_band),
    QwenImageVAEDecoder: ShardedFamily("qwen-image", False, _qwen_image_band),
}

#: what a refusal names
OFFERED = "the SD, SDXL, FLUX.1 and FLUX.2 image VAEs, Qwen-Image's, and the Wan 2.1 and Wan 2.2 video VAEs"


def family_modules() -> set[str]:
    """The family packages (models/<family>/) whose models decode sharded: a preset's
    (models.registry.PresetInfo.family) is checked by it before any model loads."""
    return {cls.__module__.split(".")[1] for cls in FAMILIES}


def family(model) -> ShardedFamily | None:
    """The model's sharded family, or None where no sharded decode is written for it."""
    return FAMILIES.get(type(model))


def check(model) -> ShardedFamily:
    """model's sharded family, or a ValueError that names it."""
    fam = family(model)
    if fam is None:
        raise ValueError(f"{model.name}: a sharded decode is offered for {OFFERED}, not {type(model).__name__}")
    return fam


def bands(model, latents_shape: tuple[int, ...], shards: int) -> list[tuple[int, int]]:
    """Each shard's [start, stop) latent rows; a ValueError when there are fewer rows than shards."""
    check(model)
    return split_rows(latents_shape[LATENT_ROWS], shards)


def decode_band(model, comm: ShardComm, band: np.ndarray, total_rows: int, clamp: bool = True) -> np.ndarray:
    """This shard's rows of model.decode(latents, tiled=False), float32 pixels: band is its rows
    of the latents as the pipeline hands them; every shard of the group calls this together."""
    return check(model).decode_band(model, comm, band, total_rows, clamp)


def decode_emulated(model, latents: np.ndarray, shards: int, clamp: bool = True,
                    comm_wrapper=None) -> np.ndarray:
    """model.decode(latents, tiled=False) on `shards` emulated shards of one backend (threads,
    convkernels.collectives.shard_comm.ThreadShards): each band decoded by decode_band, the pixel rows joined.
    comm_wrapper(comm, rank) -> comm, if given, stands between each shard and its communicator
    (tests and injected faults break one shard with it)."""
    lat = np.asarray(latents)
    parts = split(lat, bands(model, lat.shape, shards), axis=LATENT_ROWS)

    def shard(comm, rank):
        return decode_band(model, comm_wrapper(comm, rank) if comm_wrapper else comm, parts[rank],
                           lat.shape[LATENT_ROWS], clamp)

    return np.concatenate(run_sharded(shards, shard), axis=PIXEL_ROWS)


def frame_groups_band(model, comm: ShardComm, band: np.ndarray, total_rows: int,
                      clamp: bool = True, plan: ChunkPlan | None = None,
                      uint8: bool = False) -> Iterator[np.ndarray]:
    """A video decoder's frame groups, this shard's rows of each (every shard steps together);
    band is its rows of the latents, split from the whole's total_rows by bands(). plan: how
    the shards step their frames (benchmarks compare plans; by default the band decides).
    uint8=True: uint8 pixels, converted on the device."""
    if not check(model).video:
        raise ValueError(f"{model.name}: a streamed sharded decode is a video decoder's")
    return sharded_wan_frame_groups(model, comm, band, clamp, total_rows=total_rows, plan=plan, uint8=uint8)


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
        for _ in range(lat.shape[2]):
            yield np.concatenate(run_together(comms, [g.__next__ for g in gens]), axis=PIXEL_ROWS)
    finally:
        for g in gens:
            g.close()
