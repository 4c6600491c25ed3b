"""The `shards` option's `auto` rule: how many devices a decode of a family at a size is split over
when its request asks for `auto` (service/frontend/decode_request.py parses and decides the option).

`auto` shards a request only where sharding was measured to pay: one GPU's decode has to be long
enough for the halo exchanges, statistics all-reduces and launches of the sharded path to be a
small part of it. The rule is data (`AUTO_RULES`), each row naming the measurement behind it; a
shape below every row stays on one device, as it also does on a server with one device. Most rows
were measured on H200s, where one GPU's decode is faster than on an H100, so they are on the safe
side there; FLUX.2's and Qwen-Image's 2-GPU rows were measured on H100s.
"""
from __future__ import annotations

from dataclasses import dataclass


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


def auto_shards(family: str | None, pixels: int, devices: int) -> int:
    """AUTO_RULES' choice for a request of `pixels` decoded pixels on a server of `devices`: the
    most devices a row measured to pay at that size or smaller, and that the server has; else 1.
    A count no row names is never chosen (a row is a measured gain, not a guess)."""
    return max((r.shards for r in AUTO_RULES
                if r.family == family and pixels >= r.min_pixels and r.shards <= devices), default=1)
