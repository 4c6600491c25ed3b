"""Peak working memory of an image VAE's decode or encode, whole or one tile at a time: what the
tiling rules (models/nn/tiling.py) compare with the backend's work-memory budget to decide whether,
and how small, to tile. Deliberately on the high side."""
from __future__ import annotations

#: live activation tensors at once inside a resnet block (input, normed, conv out, skip) + slack
LIVE_TENSORS = 5
CONV_SCRATCH_PER_PIXEL_CHANNEL = 12
CONV_SCRATCH_BUFFERS = 3


def _itemsize(model) -> int:
    # the NumPy backend's bfloat16 keeps its activations in float32 (only its products round)
    half = model.backend.dtype in ("float16", "bfloat16") and model.backend.name != "numpy"
    return 2 if half else 4


def stage_bytes(model, px: int, ch: int) -> int:
    """One stage's live activations plus its conv scratch: unfold (9 values per pixel and channel)
    or Winograd transforms (about 12), each row-tiled by the backend under its limit, a few such
    buffers alive at once."""
    scratch = CONV_SCRATCH_PER_PIXEL_CHANNEL * px * ch * 4
    unfold_cap = model.backend.unfold_limit_bytes
    if unfold_cap:
        scratch = min(scratch, CONV_SCRATCH_BUFFERS * unfold_cap)
    return LIVE_TENSORS * px * ch * _itemsize(model) + scratch


def estimate_decode_peak_bytes(model, n: int, h: int, w: int) -> int:
    """Working memory of one untiled decode of (n, h, w) latents: the widest stage's live
    activations, the conv unfold buffer (capped by the backend's limit), the mid-block attention
    scores (row-chunked) and the host output. Deliberately on the high side."""
    cfg = model.config
    boc = list(reversed(cfg.block_out_channels))
    # the upsample conv and first resnet of a level still carry the previous level's width
    peak = max(stage_bytes(model, n * h * w * 4 ** level, max(ch, boc[level - 1]) if level else ch)
               for level, ch in enumerate(boc))
    if cfg.mid_block_add_attention:
        tokens = h * w
        be = model.backend
        if be.attention_chunk:
            chunk = be.attention_chunk
        elif be.attention_score_bytes:  # cuda: a block's rows are what fits the bound
            chunk = max(1, be.attention_score_bytes // (n * tokens * 4))
        else:
            chunk = tokens
        scores = 3 * n * min(tokens, chunk) * tokens * 4  # scores, exp, probabilities
        peak = max(peak, scores + LIVE_TENSORS * n * tokens * boc[0] * _itemsize(model))
    f = cfg.spatial_factor
    output = 2 * n * h * f * w * f * cfg.out_channels * 4  # decoder output + host copy
    return int(peak + output)


def estimate_encode_peak_bytes(model, n: int, h: int, w: int) -> int:
    """Working memory of one untiled encode of (n, h, w) images, on the decode estimate's terms."""
    boc = list(model.config.block_out_channels)
    peak = max(stage_bytes(model, n * -(-h // 2 ** level) * -(-w // 2 ** level),
                            max(ch, boc[level - 1]) if level else ch)
               for level, ch in enumerate(boc))
    return int(peak + 2 * n * h * w * model.config.in_channels * 4)


def estimate_tiled_peak_bytes(model, n: int, h: int, w: int, tile_latent: int) -> int:
    """One tile's untiled decode + the output image + the previous row's blend strips."""
    f = model.config.spatial_factor
    th, tw = min(h, tile_latent), min(w, tile_latent)
    out = n * h * f * w * f * model.config.out_channels * 4
    strips = 2 * n * (tile_latent * f) * (w * f) * model.config.out_channels * 4
    return estimate_decode_peak_bytes(model, n, th, tw) + out + strips
