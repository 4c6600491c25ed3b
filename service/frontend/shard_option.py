"""A decode's `shards` option: `1` (the default: one device), `N` (the first N devices
decode it together, exactly, service/worker/shard_leader.py) or `auto` (the rule below decides). Read on
REST (`?shards=`), in KServe's request parameters, and by the CLI's `decode --shards`.

`auto` shards a request only where sharding was measured to pay: one GPU's decode has to be long
enough for the halo exchanges, statistics all-reduces and launches of the sharded path to be a
small part of it. The rule is data (`AUTO_RULES`), each row naming the measurement behind it; a
shape below every row stays on one device, as it also does on a server with one device. Most rows
were measured on H200s, where one GPU's decode is faster than on an H100, so they are on the safe
side there; FLUX.2's and Qwen-Image's 2-GPU rows were measured on H100s.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from ..problems import Problem
from .engine import NoWorker

AUTO = "auto"
#: the most shards a request may name (one per GPU of the largest hosts)
MAX_SHARDS = 64
#: models.sharding.LATENT_ROWS (every family's latent rows are axis -2), copied: a front end holds
#: model views, never model code, and importing models.sharding loads the sharded families (the
#: import-linter contracts in pyproject.toml); tests/test_shard_option.py holds the two equal. The
#: families a sharded decode is offered for come from the workers (their status' shard_offered).
LATENT_ROWS = -2


@dataclass(frozen=True)
class AutoRule:
    family: str       # models.sharding.ShardedFamily.name: a row is measured on that family alone
    min_pixels: int   # decoded pixels of the whole request (N x frames x H x W) from which it paid
    shards: int       # how many devices paid there
    evidence: str     # the measurement behind the row (benchmarks/HISTORY.md, "sharded_decode")


SD_LAYOUT, WAN21 = "autoencoder-kl", "wan2.1"
_H200X4 = "4x H200, 2026-11-26, benchmarks/gpu/sharded_decode.py"
_H100X2 = "2x H100, 2026-11-26 ~17:43 UTC, benchmarks/gpu/sharded_decode.py"
AUTO_RULES: tuple[AutoRule, ...] = (
    AutoRule(SD_LAYOUT, 4096 * 4096, 2, f"SD-VAE 4096x4096 fp16: 2 GPUs 0.52x one GPU's time ({_H200X4})"),
    AutoRule(SD_LAYOUT, 4096 * 4096, 4, f"SD-VAE 4096x4096 fp16: 4 GPUs 0.26x ({_H200X4})"),
    # the Wan rows with the sharded steady chunks replayed from CUDA graphs and no halo copies
    # (before both, 81x480x832 on 2 GPUs took 0.98x and had no row)
    AutoRule(WAN21, 81 * 480 * 832, 2, f"Wan 2.1 81x480x832 bf16: 2 GPUs 0.65x ({_H200X4})"),
    AutoRule(WAN21, 81 * 480 * 832, 4, f"Wan 2.1 81x480x832 bf16: 4 GPUs 0.37x ({_H200X4})"),
    AutoRule(WAN21, 121 * 720 * 1280, 2, f"Wan 2.1 121x720x1280 bf16: 2 GPUs 0.60x ({_H200X4})"),
    AutoRule(WAN21, 121 * 720 * 1280, 4, f"Wan 2.1 121x720x1280 bf16: 4 GPUs 0.33x ({_H200X4})"),
    # the 2026 families, each at the size it was measured (~14:10 UTC); smaller sizes stay on one device
    AutoRule("wan2.2", 121 * 704 * 1280, 2, f"Wan 2.2 121x704x1280 bf16: 2 GPUs 0.58x ({_H200X4})"),
    AutoRule("wan2.2", 121 * 704 * 1280, 4, f"Wan 2.2 121x704x1280 bf16: 4 GPUs 0.30x ({_H200X4})"),
    AutoRule("flux2", 4096 * 4096, 4, f"FLUX.2 4096x4096 bf16: 4 GPUs 0.25x ({_H200X4})"),
    AutoRule("qwen-image", 4096 * 4096, 4, f"Qwen-Image 4096x4096 bf16: 4 GPUs 0.25x ({_H200X4})"),
    # measured after attention moved to bf16 products, which halved one GPU's time at this size
    AutoRule("flux2", 4096 * 4096, 2, f"FLUX.2 4096x4096 bf16: 2 GPUs 0.52x ({_H100X2})"),
    AutoRule("qwen-image", 4096 * 4096, 2, f"Qwen-Image 4096x4096 bf16: 2 GPUs 0.48x ({_H100X2})"),
)


def parse(value) -> int | str:
    """The option as a client sent it (query text, a JSON value, None) -> 1..MAX_SHARDS or AUTO."""
    if value is None or value == "":
        return 1
    if isinstance(value, str) and value.strip().lower() == AUTO:
        return AUTO
    try:
        n = int(value)
        if isinstance(value, float) and value != n or isinstance(value, bool):
            raise ValueError
    except (TypeError, ValueError):
        raise Problem(422, "bad-shards", f"shards must be 'auto' or a whole number 1..{MAX_SHARDS}, "
                      f"not {value!r}") from None
    if not 1 <= n <= MAX_SHARDS:
        raise Problem(422, "bad-shards", f"shards must be 'auto' or 1..{MAX_SHARDS}, not {n}")
    return n


def auto_shards(family: str | None, pixels: int, devices: int) -> int:
    """AUTO_RULES' choice for a request of `pixels` decoded pixels on a server of `devices`: the
    most devices a row measured to pay at that size or smaller, and that the server has; else 1.
    A count no row names is never chosen (a row is a measured gain, not a guess)."""
    return max((r.shards for r in AUTO_RULES
                if r.family == family and pixels >= r.min_pixels and r.shards <= devices), default=1)


def decide(requested: int | str, model_name: str, family: str | None, latents_shape: tuple[int, ...],
           out_shape: tuple[int, ...], devices: int, tiled: bool | None, offered: str = "") -> int:
    """How many devices decode the request: 1, or N > 1 after checking the model, the server and
    the latents can take it (a Problem 422 naming what cannot; offered: the families a sharded
    decode is offered for, models.sharding.OFFERED as the workers say it)."""
    if requested == AUTO:
        if tiled:
            return 1  # tiled=on asks for one device's bounded memory
        n = auto_shards(family, math.prod(out_shape[:-1]), devices)
    else:
        n = int(requested)
    if n == 1:
        return 1
    if family is None:
        raise Problem(422, "not-shardable", f"{model_name}: a sharded decode is offered for "
                      f"{offered or 'other model families'}")
    if n > devices:
        raise Problem(422, "too-many-shards", f"shards={n}, but this server runs {devices} device"
                      f"{'s' if devices != 1 else ''} (CONVSERVE_DEVICES)")
    if tiled:
        raise Problem(422, "tiled-and-sharded", "a sharded decode is untiled and exact: ask for tiled=off "
                      "or auto with shards")
    rows = latents_shape[LATENT_ROWS]
    if rows < n:
        raise Problem(422, "too-many-shards", f"shards={n}, but the latents have only {rows} rows to split")
    return n


def groups_off(backend: str, settings) -> tuple[str, str] | None:
    """Why this server forms no shard groups, as (problem kind, detail), or None where it does: on
    GPUs with `shard_groups` off; on the mlx backend with `shard_comm` "auto" (its emulated shards
    would fail: MLX streams belong to the thread that made them, and the shards are threads)."""
    if backend == "cuda" and not settings.shard_groups:
        return "shard-groups-off", ("sharded requests on GPUs are off on this server: it runs with "
                                    "CONVSERVE_SHARD_GROUPS=0 (docs/sharding.md)")
    if backend == "mlx" and settings.shard_comm == "auto":
        return "shards-not-on-this-backend", ("the mlx backend serves no sharded requests: its shards would be "
                                              "threads, and MLX streams belong to the thread that made them; "
                                              "sharded decodes run on CUDA GPUs or the numpy backend "
                                              "(docs/sharding.md)")
    return None


def for_model(hm, latents_shape: tuple[int, ...], requested: int | str, tiled: bool | None, devices: int,
              off: tuple[str, str] | None = None, offered: str = "") -> int:
    """decide() for a served model (its card's shard family and output shape). off: why this server
    forms no shard groups (groups_off): then auto is 1 and N > 1 a 501 that says why."""
    if off is not None:
        if requested == AUTO or int(requested) == 1:
            return 1
        raise Problem(501, *off)
    return decide(requested, hm.name, getattr(hm.model, "shard_family", None), latents_shape,
                  hm.output_shape(latents_shape), devices, tiled, offered)


def leader_link(engine, model: str, shards: int, options: dict):
    """For shards > 1: the decode's options made untiled and sharded, and the link to the group's
    leader (503 with Retry-After while any of its workers is not ready); None for one device."""
    if shards == 1:
        return None
    options.update(tiled=False, shards=shards)
    try:
        return engine.shard_leader(model, shards)
    except NoWorker:
        raise Problem(503, "shard-group-not-ready", f"the first {shards} devices' workers are not all up; "
                      "retry shortly", headers={"Retry-After": "2"}) from None
