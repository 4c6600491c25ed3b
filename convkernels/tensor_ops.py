"""The tensor ops of the Backend contract other than convolutions: normalisation, activations,
resampling, padding, dense ops and array plumbing. Each public method validates its arguments
(clear ValueErrors) and dispatches to an underscored primitive: the abstract ones below are
what a backend implements; the others are generic routes a backend may override with a faster
one. BackendBase (backend.py) extends this class."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .spec import ACTIVATIONS, PAD_MODES, PaddingArg, normalize_padding

Array = Any

HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")


@dataclass(frozen=True)
class ShuffledResidual:
    """pixel_shuffle(source, factors, repeats, start) of an (N, T, H, W, C) source, as a residual of
    upsample_conv2d: its (N, T', H', W', C') result read as N*T' frames. Wan 2.2's DupUp3D shortcut
    is one. A backend that can read it where it lies (CUDA's phase form) never makes the shuffled
    copy, an output-sized write and read; the others make it first (TensorOps.shuffled_frames)."""
    source: Any
    factors: tuple[int, int, int]
    repeats: int = 1
    start: int = 0

    @property
    def frames_shape(self) -> tuple[int, int, int, int]:
        """(N*T', H', W', C'): the shape of the residual it stands for."""
        if len(self.source.shape) != 5 or len(self.factors) != 3:
            raise ValueError(f"ShuffledResidual: an (N, T, H, W, C) source and 3 factors, got shape "
                             f"{tuple(self.source.shape)} and factors {self.factors}")
        n, t, h, w, c = (int(d) for d in self.source.shape)
        ft, fh, fw = self.factors
        return n * (t * ft - self.start), h * fh, w * fw, c * self.repeats // (ft * fh * fw)


class TensorOps(ABC):
    """The non-conv ops of BackendBase."""

    # ---- primitives a backend implements ------------------------------------------------------
    @abstractmethod
    def dtype_of(self, x: Array) -> str:
        """numpy-style dtype name of a device array ('float32', 'float16', 'bfloat16', ...)."""

    @abstractmethod
    def _group_norm(self, x, num_groups, weight, bias, eps, activation): ...

    @abstractmethod
    def _layer_norm(self, x, weight, bias, eps, activation): ...

    @abstractmethod
    def _activation(self, x, activation: str): ...

    @abstractmethod
    def _upsample_nearest(self, x, scale: tuple[int, ...]): ...

    @abstractmethod
    def _pad(self, x, pads: tuple[tuple[int, int], ...], modes: tuple[str, ...]): ...

    @abstractmethod
    def _matmul(self, a, b): ...

    @abstractmethod
    def _attention(self, q, k, v, scale: float): ...

    @abstractmethod
    def _softmax(self, x, axis: int): ...

    @abstractmethod
    def _concat(self, xs, axis: int): ...

    @abstractmethod
    def _mean(self, x, axes: tuple[int, ...], keepdims: bool): ...

    # ---- helpers ------------------------------------------------------------------------
    def _check_dtype(self, x, what: str) -> None:
        dt = self.dtype_of(x)
        if dt not in HOST_DTYPES:
            raise ValueError(f"{what}: unsupported dtype {dt}; use one of {HOST_DTYPES}")

    # ---- normalisation and activations ----------------------------------------------------
    def group_norm(self, x, num_groups: int, weight=None, bias=None, eps: float = 1e-5,
                   activation: str | None = None):
        """GroupNorm over channels-last x (N, *spatial, C), optional fused activation."""
        c = x.shape[-1]
        if x.ndim < 2:
            raise ValueError(f"group_norm needs N,...,C input, got shape {tuple(x.shape)}")
        if num_groups < 1 or c % num_groups:
            raise ValueError(f"group_norm: {num_groups} groups must divide {c} channels")
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and tuple(p.shape) != (c,):
                raise ValueError(f"group_norm: {name} must have shape ({c},), got {tuple(p.shape)}")
        self._check_activation(activation, "group_norm")
        return self._group_norm(x, num_groups, weight, bias, float(eps), activation)

    def group_norm_sums(self, x, num_groups: int):
        """group_norm's statistics alone: (N, G, 2) float64 sums of x and of x*x over each group.
        Summed over the shards of an image split by rows (convkernels/sharded_ops.py) they are
        the whole image's, and group_norm_apply then normalises each shard exactly as group_norm
        normalises the whole. Float64 sums make the one-pass variance (E[x^2] - mean^2) as exact
        as the two-pass one at these sizes."""
        if x.ndim < 2 or num_groups < 1 or x.shape[-1] % num_groups:
            raise ValueError(f"group_norm_sums: {num_groups} groups must divide the channels of N,...,C "
                             f"input, got shape {tuple(x.shape)}")
        return self._group_norm_sums(x, num_groups)

    def group_norm_apply(self, x, sums, count: float, num_groups: int, weight=None, bias=None,
                         eps: float = 1e-5, activation: str | None = None):
        """group_norm of x with the statistics `sums` (group_norm_sums' layout) of `count`
        elements per group and sample, which may span more than x (every shard's rows)."""
        n, c = x.shape[0], x.shape[-1]
        if tuple(sums.shape) != (n, num_groups, 2) or count <= 0:
            raise ValueError(f"group_norm_apply: sums must have shape ({n}, {num_groups}, 2) and count be "
                             f"positive, got {tuple(sums.shape)} and {count}")
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and tuple(p.shape) != (c,):
                raise ValueError(f"group_norm_apply: {name} must have shape ({c},), got {tuple(p.shape)}")
        self._check_activation(activation, "group_norm_apply")
        return self._group_norm_apply(x, sums, float(count), num_groups, weight, bias, float(eps), activation)

    # the generic route of the split GroupNorm: on the host, in float64 (the readable reference;
    # CUDA runs its own two kernels). The sums are a host array here.
    def _group_norm_sums(self, x, num_groups):
        h = np.asarray(self.to_host(x), np.float64)
        g = h.reshape(h.shape[0], -1, num_groups, h.shape[-1] // num_groups)
        return np.stack([g.sum(axis=(1, 3)), np.square(g).sum(axis=(1, 3))], axis=-1)

    def _group_norm_apply(self, x, sums, count, num_groups, weight, bias, eps, activation):
        sums = np.asarray(sums, np.float64)
        h = np.asarray(self.to_host(x), np.float64)
        n, c = h.shape[0], h.shape[-1]
        mean = sums[..., 0] / count
        rstd = 1.0 / np.sqrt(np.maximum(sums[..., 1] / count - mean * mean, 0.0) + eps)
        per_channel = np.repeat(np.arange(num_groups), c // num_groups)
        scale = rstd[:, per_channel] * (1.0 if weight is None else np.asarray(self.to_host(weight), np.float64))
        shift = (0.0 if bias is None else np.asarray(self.to_host(bias), np.float64)) - mean[:, per_channel] * scale
        lead = (n,) + (1,) * (h.ndim - 2) + (c,)
        y = h * scale.reshape(lead) + shift.reshape(lead)
        if activation == "silu":
            y = y / (1.0 + np.exp(-y))
        elif activation is not None:
            y = self.to_host(self._activation(self.asarray(y.astype(np.float32)), activation))
        return self.asarray(np.asarray(y, np.float32), self.dtype_of(x))

    def layer_norm(self, x, weight=None, bias=None, eps: float = 1e-5, activation: str | None = None):
        """LayerNorm over the last (channel) axis."""
        c = x.shape[-1]
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and tuple(p.shape) != (c,):
                raise ValueError(f"layer_norm: {name} must have shape ({c},), got {tuple(p.shape)}")
        self._check_activation(activation, "layer_norm")
        return self._layer_norm(x, weight, bias, float(eps), activation)

    def rms_norm(self, x, weight=None, eps: float = 1e-6, activation: str | None = None, prefix=None,
                 rows=None):
        """RMSNorm over the last (channel) axis: x / sqrt(mean(x^2) + eps) * weight, optional
        fused activation. (Wan's WanRMS_norm, F.normalize * sqrt(C) * gamma, is this with
        eps = 1e-24 / C.) prefix: frames to put in front along axis 1, as concat([prefix,
        rms_norm(x)], axis=1) but without copying the norm's output (a causal conv's cache).
        rows = (above, below), either None: rows to join to x's on axis -3 first (a sharded
        conv's halo from its neighbours), as rms_norm(concat([above, x, below], axis=-3)) but
        without the joined copy of the input; with a prefix, x is N,T,H,W,C."""
        c = x.shape[-1]
        if weight is not None and tuple(weight.shape) != (c,):
            raise ValueError(f"rms_norm: weight must have shape ({c},), got {tuple(weight.shape)}")
        self._check_activation(activation, "rms_norm")
        parts = self._joined_rows(x, rows, prefix)
        if prefix is None:
            if len(parts) > 1:
                return self._rms_norm_joined(None, parts, weight, float(eps), activation)
            return self._rms_norm(x, weight, float(eps), activation)
        whole = (*x.shape[:-3], sum(p.shape[-3] for p in parts), *x.shape[-2:])
        if x.ndim < 3 or prefix.ndim != x.ndim or tuple(prefix.shape[:1]) != whole[:1] \
                or tuple(prefix.shape[2:]) != whole[2:]:
            raise ValueError(f"rms_norm: prefix must match x {whole}{' with its rows' if len(parts) > 1 else ''} "
                             f"on every axis but 1, got {tuple(prefix.shape)}")
        if self.dtype_of(prefix) != self.dtype_of(x):
            raise ValueError(f"rms_norm: prefix dtype {self.dtype_of(prefix)} differs from x's {self.dtype_of(x)}")
        if len(parts) > 1:
            return self._rms_norm_joined(prefix, parts, weight, float(eps), activation)
        return self._rms_norm_after(prefix, x, weight, float(eps), activation)

    def _joined_rows(self, x, rows, prefix) -> list:
        """[above, x, below] less the Nones, each checked against x (every axis but -3, dtype)."""
        if rows is None:
            return [x]
        parts = [p for p in (rows[0], x, rows[1]) if p is not None]
        if len(parts) > 1 and (x.ndim < 4 or (prefix is not None and x.ndim != 5)):
            raise ValueError(f"rms_norm: rows join on axis -3 of N,H,W,C or N,T,H,W,C (with a prefix: "
                             f"N,T,H,W,C), got x {tuple(x.shape)}")
        for p in parts:
            if p.ndim != x.ndim or tuple(p.shape[:-3]) != tuple(x.shape[:-3]) \
                    or tuple(p.shape[-2:]) != tuple(x.shape[-2:]) or self.dtype_of(p) != self.dtype_of(x):
                raise ValueError(f"rms_norm: rows {tuple(p.shape)} {self.dtype_of(p)} must match x "
                                 f"{tuple(x.shape)} {self.dtype_of(x)} on every axis but -3")
        return parts

    def _rms_norm_joined(self, prefix, parts, weight, eps, activation):
        """rms_norm of parts joined on axis -3, behind prefix's frames if given; a backend that can
        write each part's norm into its rows of one buffer overrides it."""
        x = self.concat(parts, axis=parts[0].ndim - 3)
        if prefix is None:
            return self._rms_norm(x, weight, eps, activation)
        return self._rms_norm_after(prefix, x, weight, eps, activation)

    def _rms_norm_after(self, prefix, x, weight, eps, activation):
        """concat([prefix, rms_norm(x)], axis=1); a backend that can write the norm into part
        of a buffer overrides it."""
        return self.concat([prefix, self._rms_norm(x, weight, eps, activation)], axis=1)

    #: the generic _rms_norm's temporaries are several times its input: inputs above this many
    #: bytes (as float32) go through it in bands of rows (axis -3) and only the output is full size
    RMS_BAND_BYTES = 32 * 1024 * 1024

    def _rms_norm(self, x, weight, eps, activation):
        """Generic route for backends without an RMS kernel (override it: a kernel does about
        a third of this work and needs no bands). On [x, -x] the mean is exactly zero, so
        layer_norm's variance is mean(x^2) and its first C outputs are the RMS norm; the -x half
        is dropped. Bands are large enough that a GPU pays a handful of extra launches per norm,
        not hundreds (a 480x832 4-frame Wan chunk: ~20 bands)."""
        rows = x.shape[-3] if x.ndim >= 3 else 1
        row_bytes = 4 * int(np.prod(x.shape)) // max(rows, 1)  # as float32: conservative for halves
        band = max(1, self.RMS_BAND_BYTES // max(row_bytes, 1))
        if band < rows:
            return self.concat([self._rms_norm(self.slice(x, -3, s, min(s + band, rows)), weight, eps, activation)
                                for s in range(0, rows, band)], axis=-3)
        c = x.shape[-1]
        w2 = None if weight is None else self.concat([weight, self.mul(weight, 0.0)], axis=0)
        y = self.layer_norm(self.concat([x, self.mul(x, -1.0)], axis=-1), w2, None, eps, activation)
        return self.slice(y, -1, 0, c)

    @staticmethod
    def _check_activation(activation, what):
        if activation not in ACTIVATIONS:
            raise ValueError(f"{what}: activation must be one of {ACTIVATIONS}, got {activation!r}")

    def silu(self, x):
        return self._activation(x, "silu")

    def gelu(self, x, approximate: bool = False):
        return self._activation(x, "gelu_tanh" if approximate else "gelu")

    def relu(self, x):
        return self._activation(x, "relu")

    # ---- resampling and padding -----------------------------------------------------------
    def upsample_nearest(self, x, scale: int | Sequence[int]):
        """Nearest upsample of every spatial axis of (N, *spatial, C) by integer factors."""
        nd = x.ndim - 2
        if nd < 1:
            raise ValueError(f"upsample_nearest needs N,spatial...,C input, got {tuple(x.shape)}")
        factors = (int(scale),) * nd if isinstance(scale, int) else tuple(int(s) for s in scale)
        if len(factors) != nd or any(f < 1 for f in factors):
            raise ValueError(f"upsample_nearest: need {nd} positive integer factors, got {scale!r}")
        return self._upsample_nearest(x, factors)

    def pixel_shuffle(self, x, factors: Sequence[int], repeats: int = 1, start: int = 0):
        """Channels to space: (N, *S, Cin) -> (N, *(S * factors), Cout), Cout = Cin * repeats /
        prod(factors). Each input channel is first repeated `repeats` times in a row (torch's
        repeat_interleave); channel c * prod(factors) + r of that then lands on offset r within
        its input position's block of the output (torch's pixel_shuffle order: the spatial axes'
        offsets in axis order, the last fastest). `start` drops that many leading positions of
        the first spatial axis (Wan 2.2's DupUp3D keeps a first chunk's last frame only)."""
        nd = x.ndim - 2
        factors = tuple(int(f) for f in factors)
        if nd < 1 or len(factors) != nd or any(f < 1 for f in factors) or repeats < 1:
            raise ValueError(f"pixel_shuffle: {nd} spatial axes, factors {factors}, repeats {repeats}")
        block = int(np.prod(factors))
        if (x.shape[-1] * repeats) % block:
            raise ValueError(f"pixel_shuffle: {x.shape[-1]} channels x {repeats} do not split into blocks of {block}")
        if not 0 <= start < x.shape[1] * factors[0]:
            raise ValueError(f"pixel_shuffle: start {start} outside {x.shape[1] * factors[0]} positions")
        return self._pixel_shuffle(x, factors, int(repeats), int(start))

    def shuffled_frames(self, r: ShuffledResidual):
        """The residual r stands for, made: (N*T', H', W', C')."""
        return self.reshape(self.pixel_shuffle(r.source, r.factors, r.repeats, r.start), r.frames_shape)

    def _pixel_shuffle(self, x, factors, repeats, start):
        """The reference route, in the backend's own reshape, concat, transpose and slice."""
        n, *space, cin = x.shape
        nd, cout = len(space), cin * repeats // int(np.prod(factors))
        if repeats > 1:
            col = self.reshape(x, (*x.shape, 1))
            x = self.reshape(self.concat([col] * repeats, axis=-1), (n, *space, cin * repeats))
        x = self.reshape(x, (n, *space, cout, *factors))
        # (n, s1, f1, s2, f2, ..., cout): each spatial axis followed by its offset
        order = [0] + [a for i in range(nd) for a in (1 + i, 2 + nd + i)] + [1 + nd]
        x = self.reshape(self.transpose(x, order), (n, *(s * f for s, f in zip(space, factors)), cout))
        return self.slice(x, 1, start, x.shape[1]) if start else x

    def pad(self, x, padding: PaddingArg, mode: str | Sequence[str] = "zeros"):
        """Pad the spatial axes of (N, *spatial, C). mode: 'zeros', 'replicate' (the edge line
        repeated) or 'reflect' (mirrored about the edge line, which is not repeated: the pad must
        be narrower than its axis), or one of those per spatial axis."""
        pads = normalize_padding(padding, x.ndim - 2)
        modes = (mode,) * len(pads) if isinstance(mode, str) else tuple(mode)
        if len(modes) != len(pads) or any(m not in PAD_MODES for m in modes):
            raise ValueError(f"pad: mode must be one of {PAD_MODES}, or one per spatial axis ({len(pads)}), "
                             f"got {mode!r}")
        for axis, ((lo, hi), m, size) in enumerate(zip(pads, modes, x.shape[1:-1]), start=1):
            if m == "reflect" and max(lo, hi) >= size:
                raise ValueError(f"pad: a reflected pad must be narrower than its axis: {max(lo, hi)} lines "
                                 f"of axis {axis}'s {size}")
        return self._pad(x, pads, modes)

    # ---- dense ops --------------------------------------------------------------------------
    def matmul(self, a, b):
        if a.ndim < 2 or b.ndim < 2 or a.shape[-1] != b.shape[-2]:
            raise ValueError(f"matmul: shapes {tuple(a.shape)} and {tuple(b.shape)} do not chain")
        return self._matmul(a, b)

    def linear(self, x, weight, bias=None, *, residual=None, activation: str | None = None):
        """x (..., I) @ weight(O, I).T + bias, optional activation, then + residual
        (the same epilogue order as conv)."""
        if weight.ndim != 2 or x.shape[-1] != weight.shape[1]:
            raise ValueError(f"linear: input features {x.shape[-1]} vs weight {tuple(weight.shape)} (O, I)")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"linear: bias must have shape ({weight.shape[0]},)")
        self._check_activation(activation, "linear")
        return self._linear(x, weight, bias, residual, activation)

    def _linear(self, x, weight, bias, residual, activation):
        lead = tuple(x.shape[:-1])
        out = self._matmul(self.reshape(x, (-1, x.shape[-1])), self.transpose(weight, (1, 0)))
        if bias is not None:
            out = out + bias
        if activation is not None:
            out = self._activation(out, activation)
        out = self.reshape(out, (*lead, weight.shape[0]))
        if residual is not None:
            out = out + residual
        return out

    def attention(self, q, k, v, scale: float | None = None):
        """softmax(q @ k^T * scale) @ v over (..., L, D) inputs (batch and head axes lead)."""
        if q.ndim < 2 or q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
            raise ValueError(f"attention: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)} do not fit")
        if scale is None:
            scale = 1.0 / float(np.sqrt(q.shape[-1]))
        return self._attention(q, k, v, float(scale))

    def softmax(self, x, axis: int = -1):
        return self._softmax(x, axis)

    # ---- array plumbing (every backend's arrays support these natively) ------------------------
    def concat(self, xs: Sequence[Array], axis: int = -1):
        if not xs:
            raise ValueError("concat: nothing to concatenate")
        return self._concat(list(xs), axis)

    def slice(self, x, axis: int, start: int, stop: int, step: int = 1):
        idx = [slice(None)] * x.ndim
        idx[axis] = slice(start, stop, step)
        return x[tuple(idx)]

    def reshape(self, x, shape):
        return x.reshape(tuple(shape))

    def transpose(self, x, axes):
        return x.transpose(tuple(axes))

    def add(self, a, b):
        return a + b

    def mul(self, a, b):
        return a * b

    def divide(self, a, b):
        """a / b elementwise, NumPy broadcasting (a linear attention's normaliser)."""
        return a / b

    def astype(self, x, dtype: str):
        """x stored as `dtype` ('float32', 'float16', 'bfloat16'): for a layer that computes in
        float32 on a half-precision backend, as diffusers upcasts a linear attention's sums."""
        return x if self.dtype_of(x) == dtype else self._astype(x, dtype)

    def _astype(self, x, dtype: str):
        return x.astype(dtype)

    def mean(self, x, axes: int | Sequence[int], keepdims: bool = False):
        axes_t = (axes,) if isinstance(axes, int) else tuple(axes)
        return self._mean(x, axes_t, keepdims)

