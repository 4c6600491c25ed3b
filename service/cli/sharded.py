"""`convserve decode --shards N`: one image's decode split by rows over N local GPUs
(service.worker.shard_group; docs/sharding.md). Every refusal comes before any GPU work, in one line."""
from __future__ import annotations

import time

import numpy as np

from .checks import check_model_entries, fail, validated
from ..settings import ModelEntry


def decode_sharded(lat: np.ndarray, preset: str, weights: str | None, backend: str, shards: int,
                   settings, channels: str | None = None, answer: str = "npy") -> tuple[np.ndarray, float]:
    """(pixels N,(F,)H,W,3 float32 in [0, 1], seconds) of the latents decoded on the first `shards`
    GPUs a server would use; N,H,W,4 (RGBA) where the channels rule (service/alpha_option.py) asks
    alpha of a decoder with it: `channels` (rgba | rgb | None) for an answer of `answer` (the output's
    format)."""
    from models import sharding
    from models.contract import VIDEO_DECODER
    from models.registry import PRESETS, family_of

    from ..alpha_option import decide_alpha

    check_model_entries([ModelEntry(preset, preset, weights)])
    if backend not in ("auto", "cuda"):
        fail(f"--shards {shards} runs on the cuda backend (one GPU per shard), not {backend}")
    info = PRESETS[preset]
    if info.family not in sharding.family_modules():
        fail(f"--shards {shards}: preset {preset} has no sharded decode; {sharding.OFFERED} have one")
    video = info.kind == VIDEO_DECODER
    # an image decoder's class says whether it decodes alpha (models/contract.py AlphaDecoder), as
    # HostedModel.decodes_alpha reads its model: known before anything loads
    family = family_of(info.family, {})
    alpha = validated(decide_alpha, preset, not video and bool(getattr(family and family.model, "decodes_alpha", False)),
                      channels, answer)
    if video != (lat.ndim == 5) and not (lat.ndim == 5 and lat.shape[2] == 1):  # Qwen-Image's N,C,1,h,w
        fail(f"--shards {shards}: preset {preset} decodes {'video' if video else 'image'} latents "
             f"({'N,C,T,h,w' if video else 'N,C,h,w'}), not shape {list(lat.shape)}")
    rows = lat.shape[sharding.LATENT_ROWS]
    from convkernels.registry import cuda_status

    ok, why = cuda_status()
    if not ok:
        fail(f"--shards {shards} needs CUDA: {why}")
    from ..process_plan import plan_devices

    try:  # the GPUs a server would use: CONVSERVE_DEVICES, within CUDA_VISIBLE_DEVICES
        gpus = [d.cuda_visible for d in plan_devices(settings) if d.cuda_visible is not None]
    except ValueError as exc:
        fail(str(exc))
    if len(gpus) < shards:
        fail(f"--shards {shards} needs {shards} GPUs; {len(gpus)} usable")
    if rows < shards:
        fail(f"--shards {shards}: {rows} latent rows cannot make {shards} bands")
    from ..worker.shard_group import decode_on_gpus

    t0 = time.perf_counter()
    try:
        res = decode_on_gpus(preset, lat, gpus[:shards], settings.dtype or "float16", weights=weights,
                             cuda_options=settings.backend_options()["cuda_options"], alpha=alpha)
    except (RuntimeError, TimeoutError) as exc:
        fail(str(exc), 1)
    return res.images, time.perf_counter() - t0
