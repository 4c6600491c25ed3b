"""Loading and warming up the served models in a model worker (through models.load_model and the
typed model contract, models/contract.py), and the view of each that its front ends get
(`view_of`: service/hosted_model.py's ModelView). The CLI's local commands load through here too."""
from __future__ import annotations

import functools
import itertools
import logging
import time
from typing import TYPE_CHECKING, cast

import numpy as np

from models.contract import IMAGE_ENCODER, ServedModel, example_input, forward

from .. import metrics
from ..hosted_model import HostedModel, ModelView
from ..settings import ModelEntry

if TYPE_CHECKING:
    from convkernels import Backend

log = logging.getLogger("convserve.models")


@functools.cache
def shard_offered() -> str:
    """models.sharding.OFFERED, read once: the families a sharded decode is offered for, which the
    worker's status tells its front ends."""
    from models import sharding

    return sharding.OFFERED


def view_of(model: ServedModel) -> ModelView:
    """What a front end gets of a loaded model: the contract's attributes and the card, copied."""
    from models import sharding

    return ModelView(model.name, model.kind, model.card(), model.weights_source, model.weights_provenance,
                     **{a: getattr(model, a) for a in ModelView._ATTRS if hasattr(model, a)},
                     shard_family=getattr(sharding.family(model), "name", None))


def load_entry(entry: ModelEntry, backend: Backend, tile_size: int | None = None,
               device: str = "local") -> HostedModel:
    from models import ModelOptions, load_model  # the models layer; imported late so settings errors come first

    t0 = time.perf_counter()
    model = load_model(entry.name, entry.preset, backend, weights=entry.weights,
                       options=ModelOptions(tile_size=tile_size))
    secs = time.perf_counter() - t0
    metrics.MODEL_LOAD_SECONDS.labels(entry.name).set(secs)
    metrics.MODEL_LOADS.labels(entry.name, device).inc()
    log.info("loaded %s (preset %s, %s) in %.2fs", entry.name, entry.preset,
             model.weights_source or entry.weights or "random init", secs)
    return HostedModel(entry, model, secs)


def warm_up(hm: HostedModel, sizes: list[tuple[int, int]] = (), calls_per_size: int = 1,
            batches: tuple[int, ...] = (1,)) -> None:
    """One small call per model, so first requests do not pay for path choice and allocation;
    then `calls_per_size` calls per requested image size (H, W) (2 where the backend records a
    CUDA graph on the second call) and per batch size in `batches` (the sizes the batcher runs:
    each is a new shape for the kernels' plans and graphs): decoders produce it (rounded down to
    their latent grid; video decoders two latent frames, which covers the first-frame and later
    chunk shapes, at batch 1 only), encoders take it, as float and as uint8 pixels."""
    m = cast(ServedModel, hm.model)
    rng = np.random.default_rng(0)
    t0 = time.perf_counter()
    out = forward(m, example_input(m, rng))
    if hm.kind == IMAGE_ENCODER:
        logits = out.get("logits")
        hm.extra["has_logits"] = logits is not None
        hm.extra["logits_dim"] = None if logits is None else int(logits.shape[1])
    for (h, w), n in itertools.product(sizes, (1,) if hm.is_video else batches):
        t1 = time.perf_counter()
        x = example_input(m, rng, n=n, pixels=(h, w))
        for _ in range(calls_per_size):
            forward(m, x)
            if hm.kind == IMAGE_ENCODER:  # uint8 pixels take a forward of their own
                forward(m, (x * 255).astype(np.uint8))
        log.info("warmed up %s at %dx%d, batch %d, in %.2fs", hm.name, h, w, n, time.perf_counter() - t1)
    hm.warmup_seconds = time.perf_counter() - t0
    metrics.MODEL_WARMUP_SECONDS.labels(hm.name).set(hm.warmup_seconds)
    log.info("warmed up %s in %.2fs", hm.name, hm.warmup_seconds)
