"""The image VAE's decode split by rows over shards, equal to the unsharded decode.

Every shard runs the decoder of one `AutoencoderKLModel` (models/autoencoder_kl/model.py; SD, SDXL,
FLUX.1, and FLUX.2's `Flux2VAEModel`, whose decoder is the same), with the model's own
parameters, on its rows of the latents, de-normalised by the model's own decoder_latents (FLUX.2's
unpatchify turns each latent row into two of the decoder's: row-local), and talks to the other
shards only through its communicator (convkernels.collectives.shard_comm.ShardComm):
- each 3x3 conv (conv_in, the resnets' convs, the upsamplers' convs, conv_out) gets its halo, one
  row above and one below, from its neighbours (sharded_ops.halo_conv2d); 1x1 convs
  (post_quant_conv, conv_shortcut) are row-local and run as they are;
- every GroupNorm takes its statistics over the whole image by an all-reduce
  (sharded_ops.exact_group_norm);
- the upsample (rows [a, b) become [2a, 2b)) in the model's own mode: "subpixel" (the default)
  as one op, upsample_conv2d (a transposed conv on CUDA), on the shard's rows with one row of
  each neighbour (sharded_ops.halo_upsample_conv2d); "nearest" as nearest 2x of the shard's own
  rows, then the halo conv;
- the mid-block attention: each shard's queries attend to the keys and values of every token,
  all-gathered from every shard in rank order, so the softmax runs over the whole image.

conv_out already holds diffusers' output mapping x / 2 + 0.5 (folded at load), so the shard's
output is clipped to [0, 1] as model.decode clips it. models.sharding.decode_emulated runs the lot
on threads (ThreadShards, NCCL's collective semantics) and joins the shards' rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from convkernels.collectives.shard_comm import ShardComm, split_rows
from convkernels.sharded_ops import exact_group_norm, halo_conv2d, halo_upsample_conv2d

from ..contract import PIXEL_RANGE


@dataclass(frozen=True)
class Shard:
    """What every sharded layer needs besides its own backend: the communicator, and the share of
    the image's rows this shard holds (total, own) in latent rows, which turns a GroupNorm's element
    count into the whole image's without asking the others."""
    comm: ShardComm
    rows: tuple[int, int] | None = None
    #: the decoder's latent rows per row of the band (FLUX.2's unpatchify makes two of each)
    row_scale: int = 1

    def token_counts(self, width: int) -> list[int] | None:
        """Every shard's token count at the decoder's latent scale (its rows x width), rank order:
        what an all-gather of the mid-block's tokens brings from each, known without asking (the
        bands are split_rows of the whole, as models.sharding.bands splits them). None: rows unknown."""
        if self.rows is None:
            return None
        return [(hi - lo) * self.row_scale * width for lo, hi in split_rows(self.rows[0], self.comm.size)]


def _group_norm(sh: Shard, norm, x, activation: str | None = "silu"):
    return exact_group_norm(norm.backend, sh.comm, x, norm.groups, norm.weight, norm.bias, norm.eps, activation,
                            rows=sh.rows)


def _conv3x3(sh: Shard, conv, x, residual=None):
    return halo_conv2d(conv.backend, sh.comm, x, conv.weight, conv.bias, residual=residual)


def _resnet(sh: Shard, block, x):
    """layers.ResnetBlock2D: norm-SiLU-conv twice, the skip added in conv2's epilogue."""
    h = _conv3x3(sh, block.conv1, _group_norm(sh, block.norm1, x))
    h = _group_norm(sh, block.norm2, h)
    skip = block.conv_shortcut(x) if block.conv_shortcut is not None else x  # 1x1: row-local
    return _conv3x3(sh, block.conv2, h, residual=skip)


def _attention(sh: Shard, attn, x):
    """layers.SpatialAttention with this shard's tokens as queries and every shard's as keys and
    values: K and V travel as one all-gathered array (channels concatenated), split on arrival."""
    backend = attn.backend
    n, h, w, c = x.shape
    tokens = backend.reshape(_group_norm(sh, attn.group_norm, x, activation=None), (n, h * w, c))
    q = attn.to_q(tokens)
    kv = backend.concat([attn.to_k(tokens), attn.to_v(tokens)], axis=-1)
    every = backend.concat(sh.comm.allgather(kv, sh.token_counts(w)), axis=1)  # rank order = row order = token order
    k, v = backend.slice(every, -1, 0, c), backend.slice(every, -1, c, 2 * c)
    out = attn.proj(backend.attention(q, k, v), residual=backend.reshape(x, (n, h * w, c)))
    return backend.reshape(out, (n, h, w, c))


def _upsample(sh: Shard, upsampler, x):
    """layers.Upsample2D in the model's own mode: "subpixel" as one op on the haloed rows
    (halo_upsample_conv2d), "nearest" as nearest 2x of the shard's rows, then the halo conv."""
    if upsampler.mode == "nearest":
        return _conv3x3(sh, upsampler.conv, upsampler.backend.upsample_nearest(x, 2))
    return halo_upsample_conv2d(upsampler.backend, sh.comm, x, upsampler.conv.weight, upsampler.conv.bias)


def sharded_decoder_forward(model, sh: Shard, z):
    """The model's decoder forward (post_quant_conv, then decoder) on this shard's rows of the
    unscaled latents (backend array, N, rows, w, C) -> this shard's image rows (backend array,
    conv_out's x / 2 + 0.5 included, unclipped)."""
    dec = model.decoder
    if model.post_quant_conv is not None:
        z = model.post_quant_conv(z)  # 1x1
    x = _conv3x3(sh, dec.conv_in, z)
    mid = dec.mid_block
    x = _resnet(sh, mid.resnets[0], x)
    if mid.attention is not None:
        x = _attention(sh, mid.attention, x)
    x = _resnet(sh, mid.resnets[1], x)
    for resnets, upsampler in dec.stages:
        for block in resnets:
            x = _resnet(sh, block, x)
        if upsampler is not None:
            x = _upsample(sh, upsampler, x)
    x = _group_norm(sh, dec.conv_norm_out, x)
    return _conv3x3(sh, dec.conv_out, x)


def sharded_decode(model, comm: ShardComm, z_rows, clamp: bool = True,
                   total_rows: int | None = None) -> np.ndarray:
    """This shard's part of model.decode (untiled): z_rows are its rows of the latents as the
    pipeline hands them, host (N, C, rows, w), of the whole's total_rows; the result is its rows of
    the images, host float32 (N, f rows, f w, 3) for the model's spatial factor f, in [0, 1] unless
    clamp=False (as model.decode's). The model's own decoder_latents de-normalises them (and for
    FLUX.2 unpatchifies: its decoder then sees two rows for each of the band's)."""
    z = model.decoder_latents(z_rows)
    band = np.shape(z_rows)[2]
    sh = Shard(comm, None if total_rows is None else (total_rows, band), z.shape[1] // band)
    backend = model.backend
    out = sharded_decoder_forward(model, sh, backend.asarray(z))
    return backend.to_host_async(out, PIXEL_RANGE if clamp else None).result()
