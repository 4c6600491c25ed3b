"""Building blocks of the Wan 2.1 video VAE decoder, written on the backend op API only.

Layout is channels-last: activations N,T,H,W,C; conv weights O,kT,kH,kW,I. Every layer knows
its checkpoint tensor names and PyTorch shapes (`expected()`), so one `check_state_dict` call
can name every problem of a bad checkpoint before anything is converted.

The semantics follow diffusers' `autoencoder_kl_wan.py` (Wan 2.1, `is_residual=False`) line
for line where it matters: causal time padding with zeros (2*p on the left, none on the
right), the per-conv feature cache of the last CACHE_T input frames, and the first-chunk
"Rep" rule of the temporal upsampler, which skips the time conv on the first latent frame.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from convkernels import Backend

from .weights import conv_weight_to_channels_last

Array = Any

#: frames of causal context each cached conv keeps between chunks (diffusers' CACHE_T)
CACHE_T = 2

#: marks a temporal upsampler that has seen the first chunk but has no frames cached yet
REPLICATE_FIRST = "Rep"

#: F.normalize divides by max(||x||, 1e-12); rms_norm's eps (1e-24 / C) plays that role
RMS_EPS = 1e-12


class Layer:
    """A node of the model tree: own parameters plus named children."""

    def own_params(self) -> dict[str, tuple[int, ...]]:
        """Checkpoint name (relative) -> PyTorch shape."""
        return {}

    def children(self) -> dict[str, "Layer"]:
        return {}

    def set_param(self, name: str, host: np.ndarray) -> None:
        raise KeyError(name)

    def expected(self, prefix: str = "") -> dict[str, tuple[int, ...]]:
        out = {prefix + k: s for k, s in self.own_params().items()}
        for name, child in self.children().items():
            out.update(child.expected(f"{prefix}{name}."))
        return out

    def load(self, tensors: dict[str, np.ndarray], prefix: str = "") -> None:
        for k in self.own_params():
            self.set_param(k, tensors[prefix + k])
        for name, child in self.children().items():
            child.load(tensors, f"{prefix}{name}.")


class FeatureCache:
    """Causal state of one decode: one slot per cached conv, visited in the same order on
    every chunk (diffusers' feat_cache/feat_idx). Holds at most CACHE_T frames per slot, so
    memory does not grow with clip length."""

    def __init__(self, slots=()) -> None:
        self.slots: list[Any] = list(slots)
        self.pos = 0

    def steady(self) -> bool:
        """Every slot holds frames (no first-chunk marker, none missing): from the third chunk
        on, when each chunk's inputs and cache have the same shapes as the last one's."""
        return bool(self.slots) and all(s is not None and not isinstance(s, str) for s in self.slots)

    def start_chunk(self) -> None:
        self.pos = 0

    def peek(self):
        if self.pos == len(self.slots):
            self.slots.append(None)
        return self.slots[self.pos]

    def put(self, value) -> None:
        self.slots[self.pos] = value
        self.pos += 1


def _own_copy(backend: Backend, x):
    """A tensor that does not pin its parent alive: a slice (of a 4-frame chunk, or of the
    2C-channel norm output, see ChannelRMSNorm) would keep all of it in memory for as long as
    it sits in the cache."""
    return backend.concat([x], axis=1)


def cache_tail(backend: Backend, x, prev):
    """The frames a causal conv keeps for the next chunk: the last CACHE_T input frames,
    topped up with the previous chunk's last frame when this chunk is a single frame."""
    t = x.shape[1]
    tail = backend.slice(x, 1, max(0, t - CACHE_T), t)
    if tail.shape[1] < CACHE_T and prev is not None and not isinstance(prev, str):
        last = backend.slice(prev, 1, prev.shape[1] - 1, prev.shape[1])
        return backend.concat([last, tail], axis=1)
    return _own_copy(backend, tail)


class Conv(Layer):
    """A 2-D or 3-D conv with PyTorch-named `weight`/`bias`, stored channels-last."""

    def __init__(self, backend: Backend, cin: int, cout: int, kernel: tuple[int, ...]):
        self.backend = backend
        self.cin, self.cout, self.kernel = cin, cout, tuple(kernel)
        self.weight = None
        self.bias = None

    def own_params(self):
        return {"weight": (self.cout, self.cin, *self.kernel), "bias": (self.cout,)}

    def set_param(self, name, host):
        if name == "weight":
            self.weight = self.backend.asarray(conv_weight_to_channels_last(host))
        elif name == "bias":
            self.bias = self.backend.asarray(np.ascontiguousarray(host))
        else:
            raise KeyError(name)


class Conv2d(Conv):
    def __init__(self, backend: Backend, cin, cout, k: int, padding: int = 0):
        super().__init__(backend, cin, cout, (k, k))
        self.padding = padding

    def __call__(self, x, residual=None):
        return self.backend.conv2d(x, self.weight, self.bias, padding=self.padding, residual=residual)


class CausalConv3d(Conv):
    """Conv3d padded causally in time: 2*p zero frames on the left, none on the right
    (diffusers pads with zeros, F.pad's default); cached frames of the previous chunk
    replace that many zero frames."""

    def __init__(self, backend: Backend, cin, cout, kernel, padding=0):
        kernel = (kernel,) * 3 if isinstance(kernel, int) else tuple(kernel)
        padding = (padding,) * 3 if isinstance(padding, int) else tuple(padding)
        super().__init__(backend, cin, cout, kernel)
        self.time_pad = 2 * padding[0]
        self.space_pad = ((padding[1], padding[1]), (padding[2], padding[2]))
        self._last_tap = None

    def set_param(self, name, host):
        super().set_param(name, host)
        self._last_tap = None

    def __call__(self, x, cache=None, residual=None):
        b = self.backend
        lo = self.time_pad
        if cache is not None and lo > 0:
            x = b.concat([cache, x], axis=1)
            lo -= cache.shape[1]
        kt = self.kernel[0]
        if kt > 1 and lo == kt - 1 and x.shape[1] == 1:
            # A lone frame with no cache (every conv of the first chunk): all taps but the
            # last fall on zero padding, so skip them, 1/kT of the work for the first frame.
            return b.conv3d(x, self._last_tap_weight(), self.bias, padding=((0, 0), *self.space_pad),
                            residual=residual)
        return b.conv3d(x, self.weight, self.bias, padding=((lo, 0), *self.space_pad), residual=residual)

    def _last_tap_weight(self):
        if self._last_tap is None:
            kt = self.kernel[0]
            b = self.backend
            self._last_tap = b.concat([b.slice(self.weight, 1, kt - 1, kt)], axis=1)
        return self._last_tap

    def cached(self, x, state: FeatureCache | None, residual=None):
        """Run on one chunk, reading and refreshing this conv's slot of the feature cache."""
        if state is None:
            return self(x, residual=residual)
        prev = state.peek()
        keep = cache_tail(self.backend, x, prev)
        out = self(x, prev, residual=residual)
        state.put(keep)
        return out


class ChannelRMSNorm(Layer):
    """WanRMS_norm: F.normalize over channels * sqrt(C) * gamma (no bias in the decoder), i.e.
    the backend's rms_norm with eps = 1e-24 / C (F.normalize's 1e-12 floor on ||x||). (A backend
    without an RMS kernel bounds its temporaries itself, Backend.RMS_BAND_BYTES.)"""

    def __init__(self, backend: Backend, dim: int, images: bool):
        self.backend = backend
        self.dim = dim
        self.shape = (dim, 1, 1) if images else (dim, 1, 1, 1)
        self.gamma = None
        self.eps = RMS_EPS ** 2 / dim

    def own_params(self):
        return {"gamma": self.shape}

    def set_param(self, name, host):
        if name != "gamma":
            raise KeyError(name)
        self.gamma = self.backend.asarray(np.ascontiguousarray(np.asarray(host).reshape(self.dim)))

    def __call__(self, x, activation=None):
        return self.backend.rms_norm(x, self.gamma, self.eps, activation)


class ResidualBlock(Layer):
    """WanResidualBlock: RMS norm, SiLU, causal 3x3x3 conv, twice, plus a (1x1x1) shortcut."""

    def __init__(self, backend: Backend, cin: int, cout: int):
        self.norm1 = ChannelRMSNorm(backend, cin, images=False)
        self.conv1 = CausalConv3d(backend, cin, cout, 3, padding=1)
        self.norm2 = ChannelRMSNorm(backend, cout, images=False)
        self.conv2 = CausalConv3d(backend, cout, cout, 3, padding=1)
        self.conv_shortcut = CausalConv3d(backend, cin, cout, 1) if cin != cout else None

    def children(self):
        out = {"norm1": self.norm1, "conv1": self.conv1, "norm2": self.norm2, "conv2": self.conv2}
        if self.conv_shortcut is not None:
            out["conv_shortcut"] = self.conv_shortcut
        return out

    def __call__(self, x, state):
        skip = x if self.conv_shortcut is None else self.conv_shortcut(x)
        h = self.conv1.cached(self.norm1(x, "silu"), state)
        return self.conv2.cached(self.norm2(h, "silu"), state, residual=skip)


class AttentionBlock(Layer):
    """WanAttentionBlock: single-head self-attention within each frame (no time mixing)."""

    def __init__(self, backend: Backend, dim: int):
        self.backend = backend
        self.dim = dim
        self.norm = ChannelRMSNorm(backend, dim, images=True)
        self.to_qkv = Conv2d(backend, dim, 3 * dim, 1)
        self.proj = Conv2d(backend, dim, dim, 1)

    def children(self):
        return {"norm": self.norm, "to_qkv": self.to_qkv, "proj": self.proj}

    def __call__(self, x):
        b = self.backend
        n, t, h, w, c = x.shape
        frames = b.reshape(x, (n * t, h, w, c))
        qkv = b.reshape(self.to_qkv(self.norm(frames)), (n * t, h * w, 3 * c))
        q, k, v = (b.slice(qkv, -1, i * c, (i + 1) * c) for i in range(3))
        attended = b.reshape(b.attention(q, k, v, scale=1.0 / math.sqrt(c)), (n * t, h, w, c))
        return b.reshape(self.proj(attended, residual=frames), (n, t, h, w, c))


class Resample(Layer):
    """WanResample in its decoder modes: 'upsample2d' (nearest x2 in space + 3x3 conv per
    frame) and 'upsample3d' (first a causal (3,1,1) time conv to 2C channels that become two
    frames each, then the same spatial step)."""

    def __init__(self, backend: Backend, dim: int, mode: str, out_dim: int | None = None):
        if mode not in ("upsample2d", "upsample3d"):
            raise ValueError(f"Resample: decoder modes are upsample2d/upsample3d, got {mode!r}")
        self.backend = backend
        self.dim, self.mode = dim, mode
        self.out_dim = dim // 2 if out_dim is None else out_dim
        self.conv = Conv2d(backend, dim, self.out_dim, 3, padding=1)
        self.time_conv = CausalConv3d(backend, dim, 2 * dim, (3, 1, 1), padding=(1, 0, 0)) \
            if mode == "upsample3d" else None

    def children(self):
        out = {"resample.1": self.conv}
        if self.time_conv is not None:
            out["time_conv"] = self.time_conv
        return out

    def _double_frames(self, x, state: FeatureCache):
        b = self.backend
        prev = state.peek()
        if prev is None:
            # first chunk: diffusers leaves it at one frame and only marks the slot
            state.put(REPLICATE_FIRST)
            return x
        keep = cache_tail(b, x, prev)
        if keep.shape[1] < CACHE_T and isinstance(prev, str):
            zeros = b.asarray(np.zeros(tuple(keep.shape), np.float32), dtype=b.dtype_of(keep))
            keep = b.concat([zeros, keep], axis=1)
        out = self.time_conv(x, None if isinstance(prev, str) else prev)
        state.put(keep)
        n, t, h, w, _ = x.shape
        c = self.dim
        # channel k*C + c of time step t is channel c of output frame 2t + k
        out = b.transpose(b.reshape(out, (n, t, h, w, 2, c)), (0, 1, 4, 2, 3, 5))
        return b.reshape(out, (n, 2 * t, h, w, c))

    def __call__(self, x, state: FeatureCache):
        b = self.backend
        if self.time_conv is not None:
            x = self._double_frames(x, state)
        n, t, h, w, c = x.shape
        frames = b.upsample_conv2d(b.reshape(x, (n * t, h, w, c)), self.conv.weight, self.conv.bias)
        return b.reshape(frames, (n, t, 2 * h, 2 * w, self.out_dim))


class UpBlock(Layer):
    """WanUpBlock: num_res_blocks + 1 residual blocks, then an optional upsampler."""

    def __init__(self, backend: Backend, cin: int, cout: int, num_res_blocks: int, upsample_mode: str | None):
        self.resnets = []
        for _ in range(num_res_blocks + 1):
            self.resnets.append(ResidualBlock(backend, cin, cout))
            cin = cout
        self.upsampler = Resample(backend, cout, upsample_mode) if upsample_mode else None

    def children(self):
        out = {f"resnets.{i}": r for i, r in enumerate(self.resnets)}
        if self.upsampler is not None:
            out["upsamplers.0"] = self.upsampler
        return out

    def __call__(self, x, state):
        for r in self.resnets:
            x = r(x, state)
        return x if self.upsampler is None else self.upsampler(x, state)


class MidBlock(Layer):
    """WanMidBlock (num_layers=1): residual, attention, residual."""

    def __init__(self, backend: Backend, dim: int):
        self.resnets = [ResidualBlock(backend, dim, dim), ResidualBlock(backend, dim, dim)]
        self.attention = AttentionBlock(backend, dim)

    def children(self):
        return {"resnets.0": self.resnets[0], "attentions.0": self.attention, "resnets.1": self.resnets[1]}

    def __call__(self, x, state):
        x = self.resnets[0](x, state)
        return self.resnets[1](self.attention(x), state)


class Decoder3d(Layer):
    """WanDecoder3d (Wan 2.1): conv_in, mid block, up blocks, RMS norm + SiLU, conv_out.
    Called once per latent frame with the decode's FeatureCache."""

    def __init__(self, backend: Backend, dim: int, z_dim: int, dim_mult, num_res_blocks: int,
                 temperal_upsample, out_channels: int = 3):
        dims = [dim * u for u in [dim_mult[-1], *dim_mult[::-1]]]
        self.conv_in = CausalConv3d(backend, z_dim, dims[0], 3, padding=1)
        self.mid_block = MidBlock(backend, dims[0])
        self.up_blocks = []
        for i, (cin, cout) in enumerate(zip(dims[:-1], dims[1:])):
            if i > 0:
                cin //= 2  # the previous upsampler halved the channels (Wan 2.1)
            up_flag = i != len(dim_mult) - 1
            mode = None
            if up_flag:
                mode = "upsample3d" if temperal_upsample[i] else "upsample2d"
            self.up_blocks.append(UpBlock(backend, cin, cout, num_res_blocks, mode))
        self.norm_out = ChannelRMSNorm(backend, dims[-1], images=False)
        self.conv_out = CausalConv3d(backend, dims[-1], out_channels, 3, padding=1)

    def children(self):
        out = {"conv_in": self.conv_in, "mid_block": self.mid_block}
        out.update({f"up_blocks.{i}": u for i, u in enumerate(self.up_blocks)})
        out.update({"norm_out": self.norm_out, "conv_out": self.conv_out})
        return out

    def __call__(self, x, state: FeatureCache):
        state.start_chunk()
        x = self.conv_in.cached(x, state)
        x = self.mid_block(x, state)
        for up in self.up_blocks:
            x = up(x, state)
        return self.conv_out.cached(self.norm_out(x, "silu"), state)
