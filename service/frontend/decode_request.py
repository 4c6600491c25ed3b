"""One decode request, its options decided once: every route that decodes (REST /v1 decode, the
streamed decode, KServe v2 infer, diffusers' remote VAE) builds a `DecodeRequest` (`build`) and
hands it on whole: to `Service.decode`, to a stream's `FrameGroups`, to the compute cap's key of new
shapes, to the worker's message (`worker_options`) and to the choice of the worker it goes to
(`link`). Nothing downstream parses, derives or checks an option again.

The `shards` option: `1` (the default: one device), `N` (the first N devices decode it together,
exactly, service/worker/shard_leader.py) or `auto` (service/frontend/shard_option.py's measured rule
decides). Read on REST (`?shards=`) and in KServe's request parameters (`parse_shards`, before the
body is read), and decided against the model, the server's devices and the latents once, in
`build` (`decide_shards`).

The `channels` option: `rgba` or `rgb` (None: the model's own), decided in `build` by
service/alpha_option.py's `decide_alpha`, the rule the local `convserve decode` applies too: a
decoder with alpha answers RGBA by default except as JPEG (or MP4); rgba it cannot give is a 422.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..alpha_option import decide_alpha
from ..hosted_model import HostedModel
from ..ipc import worker_protocol as wp
from ..problems import Problem
from . import validation
from .engine import NoWorker
from .shard_option import auto_shards

AUTO = "auto"
#: the most shards a request may name (one per GPU of the largest hosts)
MAX_SHARDS = 64
#: models.sharding.LATENT_ROWS (every family's latent rows are axis -2), copied: a front end holds
#: model views, never model code, and importing models.sharding loads the sharded families (the
#: import-linter contracts in pyproject.toml); tests/test_shard_option.py holds the two equal. The
#: families a sharded decode is offered for come from the workers (their status' shard_offered).
LATENT_ROWS = -2
#: answers that are files: their pixels leave the device as uint8 (a quarter of float32's bytes)
FILE_FORMATS = frozenset({"png", "jpeg", "webp", "mp4"})


@dataclass(frozen=True, eq=False)
class DecodeRequest:
    """A decode as the routes decided it (built by `build`, never by hand outside the tests)."""
    hm: HostedModel
    latents: np.ndarray  # validation.latents' output: float32 in the model's layout, checked
    #: png | jpeg | webp | mp4: a file (uint8 pixels); npy: an array of `dtype`; tensor: float32
    #: pixels the route formats itself (KServe, diffusers' remote VAE, which rounds as diffusers does)
    format: str
    dtype: str = "float32"  # npy's pixel type: float32 | float16 | uint8
    tiled: bool | None = None  # None lets the model choose
    shards: int = 1  # decided (decide_shards): 1, or N > 1 devices the model, server and latents take
    clamp: bool = True  # False: the unclamped decoder output (remote_decode `pt`)
    alpha: bool = False  # decided (decide_alpha): RGBA pixels, N,H,W,4, of an AlphaDecoder

    @property
    def uint8(self) -> bool:
        """The pixels leave the device as uint8 (converted there): files, and npy of uint8."""
        return self.format in FILE_FORMATS or self.dtype == "uint8"

    @property
    def out_shape(self) -> tuple[int, ...]:
        return self.hm.output_shape(self.latents.shape, self.alpha)

    @property
    def first_run_key(self) -> tuple:
        """What decides the decode's conv shapes, for the compute cap's new shapes (compute_cap.py)."""
        return ("decode", self.latents.shape, self.tiled, self.shards)

    def worker_options(self) -> wp.Options:
        """The options of the worker's message (decode and stream_open); a sharded decode is untiled."""
        return wp.Options(tiled=False if self.shards > 1 else self.tiled, clamp=self.clamp, uint8=self.uint8,
                          shards=self.shards, alpha=self.alpha)

    def link(self, engine):
        """The worker the decode goes to: None (any worker serving the model) on one device; for
        N > 1 the group's leader, the first device's worker (503 with Retry-After while any of the
        first N devices' workers is not ready)."""
        if self.shards == 1:
            return None
        try:
            return engine.shard_leader(self.hm.name, self.shards)
        except NoWorker:
            raise Problem(503, "shard-group-not-ready", f"the first {self.shards} devices' workers are not all up; "
                          "retry shortly", headers={"Retry-After": "2"}) from None


async def build(svc, hm: HostedModel, latents: np.ndarray, *, format: str, dtype: str = "float32",
                tiled: bool | None = None, shards: int | str = 1, clamp: bool = True,
                channels: str | None = None, answer: str | None = None) -> DecodeRequest:
    """The request of `latents` as a client sent them: validated (validation.latents, a large
    body's NaN scan in the codec pool) and its `shards` (parse_shards' value) and `channels`
    (rgba | rgb | None) decided, once. answer: what the route makes of the pixels, where `format`
    (tensor) does not say (remote_decode's image file: jpg | png). svc: the front end's Service
    (its settings, codec pool and links to the workers)."""
    alpha = decide_alpha(hm.name, hm.decodes_alpha, channels, answer or format)
    lat = await svc.offload(latents.nbytes, validation.latents, hm, latents, svc.settings)
    engine = svc.engine
    n = decide_shards(hm, lat.shape, shards, tiled, engine.device_count,
                      groups_off(engine.backend_name, svc.settings), engine.shard_offered)
    return DecodeRequest(hm, lat, format, dtype, tiled, n, clamp, alpha)


def parse_tiled(value: str) -> bool | None:
    """The `tiled` query value: on | off | auto (None: the model's rule)."""
    return {"on": True, "off": False}.get(value)


def parse_shards(value) -> int | str:
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


def decide_shards(hm, latents_shape: tuple[int, ...], requested: int | str, tiled: bool | None, devices: int,
                  off: tuple[str, str] | None = None, offered: str = "") -> int:
    """How many devices decode the request: 1, or N > 1 after checking the model (its card's
    shard family), the server and the latents can take it (a Problem 422 naming what cannot).
    off: why this server forms no shard groups (groups_off): then auto is 1 and N > 1 a 501 that
    says why. offered: the families a sharded decode is offered for (models.sharding.OFFERED as
    the workers say it)."""
    if off is not None:
        if requested == AUTO or int(requested) == 1:
            return 1
        raise Problem(501, *off)
    family = getattr(hm.model, "shard_family", None)
    if requested == AUTO:
        if tiled:
            return 1  # tiled=on asks for one device's bounded memory
        n = auto_shards(family, math.prod(hm.output_shape(latents_shape)[:-1]), devices)
    else:
        n = int(requested)
    if n == 1:
        return 1
    if family is None:
        raise Problem(422, "not-shardable", f"{hm.name}: a sharded decode is offered for "
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
