"""The Wan 2.2 VAE decoder's own blocks (diffusers `AutoencoderKLWan` with `is_residual=True`):
the residual up block with its parameter-free DupUp3D shortcut, the decoder built from them, and
unpatchify. Everything else (causal convs, RMS norms, resnets, attention, the resampler and the
feature cache) is Wan 2.1's, models/wan_vae/layers.py.

Activations are channels-last (N, T, H, W, C) as in the Wan 2.1 layers; a shortcut is a backend
pixel_shuffle handed to the upsampler's op unmade (a ShuffledResidual), unpatchify a reshape and one
transpose on the backend, no per-element loops.
"""
from __future__ import annotations

from convkernels import ShuffledResidual

from ..nn.module import Module
from ..wan_vae.layers import ChannelRMSNorm, CausalConv3d, FeatureCache, MidBlock, Resample, ResidualBlock


def dup_up_residual(x, out_channels: int, factor_t: int, factor_s: int, first_chunk: bool = False):
    """DupUp3D of (N, T, H, W, Cin) -> (N, T*ft, H*fs, W*fs, Cout) as a ShuffledResidual: one
    backend.pixel_shuffle, which the upsampler's op adds frame by frame (and the CUDA backend reads
    where x lies). Channel j of the channel-repeated input (each input channel `repeats` times in a
    row, repeat_interleave) is, read as (Cout, ft, fs, fs), output channel o at time offset t and
    pixel offset (s1, s2). On the first chunk only the last time offset is kept (diffusers'
    first_chunk: x[:, :, ft - 1:])."""
    cin = x.shape[-1]
    factor = factor_t * factor_s * factor_s
    if (out_channels * factor) % cin:
        raise ValueError(f"DupUp3D: {out_channels} channels x {factor} is not a multiple of {cin}")
    start = factor_t - 1 if first_chunk and factor_t > 1 else 0
    return ShuffledResidual(x, (factor_t, factor_s, factor_s), out_channels * factor // cin, start)


def unpatchify(backend, x, patch: int):
    """diffusers' unpatchify, channels-last: (N, T, H, W, C*p*p) -> (N, T, H*p, W*p, C). Channel
    c*p*p + a*p + b lands on pixel (row H*p + b, column W*p + a): the first patch index is the
    column offset, as diffusers' permute (0, 1, 4, 5, 3, 6, 2) has it."""
    if patch == 1:
        return x
    b = backend
    n, t, h, w, cp = x.shape
    c = cp // (patch * patch)
    x = b.reshape(x, (n, t, h, w, c, patch, patch))
    x = b.transpose(x, (0, 1, 2, 6, 3, 5, 4))
    return b.reshape(x, (n, t, h * patch, w * patch, c))


class ResidualUpBlock(Module):
    """WanResidualUpBlock: num_res_blocks + 1 resnets, an optional upsampler to the same width
    (`upsampler`, not Wan 2.1's `upsamplers.0`), plus the DupUp3D shortcut of the block's input."""

    def __init__(self, cin: int, cout: int, num_res_blocks: int, temperal_upsample: bool, up_flag: bool):
        super().__init__()
        self.cout = cout
        self.resnets = [self.add(f"resnets.{i}", ResidualBlock(cin if i == 0 else cout, cout))
                        for i in range(num_res_blocks + 1)]
        self.upsampler = None
        self.factor_t = 2 if up_flag and temperal_upsample else 1
        if up_flag:
            mode = "upsample3d" if temperal_upsample else "upsample2d"
            self.upsampler = self.add("upsampler", Resample(cout, mode, out_dim=cout))

    def __call__(self, x, state: FeatureCache, first_chunk: bool):
        skip = x
        for resnet in self.resnets:
            x = resnet(x, state)
        if self.upsampler is None:
            return x

        def shortcut(above: bool, below: bool):
            return self._shortcut(skip, first_chunk, above, below)

        return self.upsampler(x, state, residual_for=shortcut)  # the shortcut joins in the conv's epilogue

    def _shortcut(self, x, first_chunk: bool, above: bool, below: bool):
        """DupUp3D of the block's input x for the upsampler's op. DupUp3D maps each row to two of
        its own (row-local); on a row shard the op computes two output rows more on each side
        where a halo row came (`above`, `below`), then drops them, so the shortcut's rows there
        only have to exist: x's own edge row stands in for the neighbour's (no exchange, no
        upload, so a recorded graph holds it too)."""
        b, rows = self.backend, x.shape[2]
        parts = [*([b.slice(x, 2, 0, 1)] if above else []), x, *([b.slice(x, 2, rows - 1, rows)] if below else [])]
        return dup_up_residual(b.concat(parts, axis=2) if len(parts) > 1 else x, self.cout, self.factor_t, 2,
                               first_chunk)


class ResidualDecoder3d(Module):
    """WanDecoder3d with is_residual=True (Wan 2.2): conv_in, mid block, residual up blocks (no
    channel halving between blocks), RMS norm + SiLU, conv_out to out_channels (3 * patch^2).
    Called once per latent frame with the decode's FeatureCache; its first chunk is the one that
    finds the cache empty (diffusers' first_chunk=True)."""

    def __init__(self, dim: int, z_dim: int, dim_mult, num_res_blocks: int, temperal_upsample,
                 out_channels: int):
        super().__init__()
        dims = [dim * u for u in [dim_mult[-1], *dim_mult[::-1]]]
        self.conv_in = self.add("conv_in", CausalConv3d(z_dim, dims[0], 3, padding=1))
        self.mid_block = self.add("mid_block", MidBlock(dims[0]))
        self.up_blocks = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            up_flag = i != len(dim_mult) - 1
            self.up_blocks.append(self.add(f"up_blocks.{i}", ResidualUpBlock(
                cin, cout, num_res_blocks, bool(temperal_upsample[i]) if up_flag else False, up_flag)))
        self.norm_out = self.add("norm_out", ChannelRMSNorm(dims[-1], images=False))
        self.conv_out = self.add("conv_out", CausalConv3d(dims[-1], out_channels, 3, padding=1))

    def __call__(self, x, state: FeatureCache):
        first_chunk = not state.slots
        state.start_chunk()
        x = self.conv_in.cached(x, state)
        for step in self.mid_block.steps():
            x = step(x, state)
        for up in self.up_blocks:
            x = up(x, state, first_chunk)
        x, lo = self.conv_out.with_cache(x, state, self.norm_out)
        return self.conv_out.padded(x, lo)
