"""The backend interface: the op set every model is written on.

One backend object per device. Public methods validate (clear ValueErrors) and dispatch;
subclasses implement the underscored primitives and list their conv paths. Arrays are the
backend's native arrays (numpy.ndarray, mlx.core.array, cupy.ndarray), channels-last.
"""
from __future__ import annotations

import logging
import random
import time
from abc import ABC, abstractmethod
from typing import Any, Sequence

import numpy as np

from .metrics import CONV_SECONDS, CONV_TOTAL
from .paths import ConvPath, PathChooser
from .protocol import ConvHook
from .spec import ACTIVATIONS, ConvKey, ConvSpec, PaddingArg, normalize_padding, validate_conv

log = logging.getLogger("convkernels")

Array = Any

HOST_DTYPES = ("float16", "bfloat16", "float32", "float64")

CONV_OPS = {1: "conv1d", 2: "conv2d", 3: "conv3d"}
CONV_T_OPS = {2: "conv_transpose2d", 3: "conv_transpose3d"}


def pixels_to_uint8(x: np.ndarray) -> np.ndarray:
    """Images in [0, 1] as 8-bit: floor(clip(x, 0, 1) * 255 + 0.5), each step in float32 and
    rounded on its own (no fused multiply-add), as the service's codecs.to_uint8 computes on
    float32 arrays. Every backend's to_host_async(..., uint8=True) matches it bit for bit on
    the float32 values the same array would have come back as. NaN becomes 0 (NumPy's cast of
    NaN to uint8 is unspecified; the device kernels define it as 0)."""
    x = np.asarray(x, dtype=np.float32)
    y = np.clip(x, np.float32(0.0), np.float32(1.0))
    y *= np.float32(255.0)
    y += np.float32(0.5)
    nan = np.isnan(y)
    if nan.any():
        y[nan] = 0.0
    return y.astype(np.uint8)


class HostReady:
    """A to_host_async whose copy is already done."""

    def __init__(self, host: np.ndarray):
        self._host = host

    def result(self) -> np.ndarray:
        return self._host


class Backend(ABC):
    """Base of the numpy, mlx and cuda backends."""

    #: stable name used in metric labels and settings
    name: str = "abstract"
    #: dtypes this backend computes in (numpy names)
    supported_dtypes: tuple[str, ...] = ("float32",)
    #: the documented seam for wrapping convs (docs/interfaces.md): when set, called as
    #: before_conv(x, w, spec) ahead of every conv; whatever it raises is the conv's error
    before_conv: ConvHook | None = None
    #: bytes of working memory one model call may take; models tile beyond it. 1 GiB suits a
    #: CPU; the cuda backend sizes it from the device's memory
    work_memory_budget: int = 1 << 30
    #: ops return before the device has run them, and to_host_async overlaps its copy with the
    #: next work: a model may queue one more piece before it waits (Wan's frame groups)
    runs_ahead: bool = False

    def __init__(self, dtype: str = "float32", timing_sample_rate: float = 1.0):
        if dtype not in self.supported_dtypes:
            raise ValueError(f"backend {self.name} computes in {self.supported_dtypes}, not {dtype!r}")
        self.dtype = dtype
        self.timing_sample_rate = float(timing_sample_rate)
        self._rng = random.Random(0)
        self._metric_children: dict = {}
        self.paths = PathChooser(self.name, self.conv_paths(), self.measure_paths())

    # ---- to implement -------------------------------------------------------------------
    @abstractmethod
    def conv_paths(self) -> list[ConvPath]:
        """The path catalogue: each path's run(x, w, key, bias, residual, activation) -> out."""

    def measure_paths(self):
        """Optional autotune: a callable (key, valid_paths) -> path, or None for cost rules."""
        return None

    @abstractmethod
    def asarray(self, host: np.ndarray, dtype: str | None = None) -> Array:
        """Host numpy array (floating, or uint8: 8-bit pixels 0..255, which cross as they are and
        are widened on the device, exactly, to `dtype`) -> device array in `dtype` (default: the
        backend's dtype)."""

    @abstractmethod
    def to_host(self, x: Array) -> np.ndarray: ...

    def to_host_async(self, x: Array, clip: tuple[float, float] | None = None, *, uint8: bool = False):
        """Start moving x to the host: an object whose result() is to_host(x) in float32, clipped
        to clip = (lo, hi) when given (a device backend clips before the copy). A backend whose
        device runs ahead of the host (cuda) copies on a side stream, so the caller can queue its
        next work before it waits; the others copy at once.
        uint8=True: result() is pixels_to_uint8 of that float32 array instead (images in [0, 1] as
        8-bit, clip ignored: [0, 1] is implied), computed before the copy where there is a device."""
        host = np.asarray(self.to_host(x), dtype=np.float32)
        if uint8:
            return HostReady(pixels_to_uint8(host))
        return HostReady(host if clip is None else np.clip(host, clip[0], clip[1]))

    @abstractmethod
    def dtype_of(self, x: Array) -> str:
        """numpy-style dtype name of a device array ('float32', 'float16', 'bfloat16', ...)."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous backends)."""

    def flush_timings(self) -> None:
        """Harvest sampled conv timings into the metrics (after a batch completes)."""

    def graphed(self, fn):
        """fn(*xs) -> array or tuple of arrays, a model's forward on device arrays that depends on
        nothing but its inputs and the (fixed) weights; state carried between calls (a causal
        cache) goes in and out as arrays. A backend that can record a whole forward once and
        replay it (CUDA graphs) returns a replaying wrapper, whose `records(*xs)` is False once
        inputs like these run eagerly for good; the others return fn itself."""
        return fn

    @property
    def calls_to_warm(self) -> int:
        """Calls of a graphed forward on a new input shape before it runs at full speed: 1, or 2
        where the second call records the CUDA graph that later calls replay."""
        return 1

    def _time_conv(self, op: str, path: str, run):
        """Run `run()`; record its time when sampled. Synchronous backends time on the host;
        asynchronous ones override this with device events harvested by flush_timings."""
        if self.timing_sample_rate >= 1.0 or self._rng.random() < self.timing_sample_rate:
            t0 = time.perf_counter()
            out = run()
            self._conv_metrics(op, path)[1].observe(time.perf_counter() - t0)
            return out
        return run()

    def _conv_metrics(self, op: str, path: str):
        """(count, seconds) children for one op and path: labels() costs ~3 us a call, and a
        small conv is ~100 us."""
        children = self._metric_children.get((op, path))
        if children is None:
            children = self._metric_children[(op, path)] = (CONV_TOTAL.labels(self.name, op, path),
                                                             CONV_SECONDS.labels(self.name, op, path))
        return children

    @abstractmethod
    def _group_norm(self, x, num_groups, weight, bias, eps, activation): ...

    @abstractmethod
    def _layer_norm(self, x, weight, bias, eps, activation): ...

    @abstractmethod
    def _activation(self, x, activation: str): ...

    @abstractmethod
    def _upsample_nearest(self, x, scale: tuple[int, ...]): ...

    @abstractmethod
    def _pad(self, x, pads: tuple[tuple[int, int], ...], mode: str): ...

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

    # ---- convolutions -------------------------------------------------------------------
    def conv(self, x: Array, w: Array, spec: ConvSpec, bias: Array | None = None, *,
             residual: Array | None = None, activation: str | None = None) -> Array:
        """out = activation(conv(x, w) + bias) + residual, channels-last.

        The residual is added after the activation: the hosted models are pre-activation
        (VAE ResNet blocks, ConvNeXt), where the skip joins after the last conv."""
        if self.before_conv is not None:
            self.before_conv(x, w, spec)
        nd = spec.nd
        op = (CONV_T_OPS if spec.transpose else CONV_OPS).get(nd)
        if op is None:
            raise ValueError(f"no {'transposed ' if spec.transpose else ''}conv for {nd} spatial dims")
        x_shape, w_shape = tuple(x.shape), tuple(w.shape)
        validate_conv(op, x_shape, w_shape, spec,
                      None if bias is None else tuple(bias.shape),
                      None if residual is None else tuple(residual.shape), activation)
        self._check_dtype(x, op)
        self._check_dtype(w, op)
        key = ConvKey(op, x_shape, w_shape, self.dtype_of(x), spec,
                      (bias is not None, residual is not None, activation))
        path = self.paths.choose(key)
        self._conv_metrics(op, path.name)[0].inc()
        return self._time_conv(op, path.name, lambda: path.run(x, w, key, bias, residual, activation))

    def _conv_nd(self, nd, x, w, bias, stride, padding, dilation, groups, residual, activation):
        spec = ConvSpec.make(nd, stride, padding, dilation, groups)
        return self.conv(x, w, spec, bias, residual=residual, activation=activation)

    def conv1d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, dilation=1, groups=1,
               residual=None, activation=None):
        return self._conv_nd(1, x, w, bias, stride, padding, dilation, groups, residual, activation)

    def conv2d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, dilation=1, groups=1,
               residual=None, activation=None):
        return self._conv_nd(2, x, w, bias, stride, padding, dilation, groups, residual, activation)

    def conv3d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, dilation=1, groups=1,
               residual=None, activation=None):
        return self._conv_nd(3, x, w, bias, stride, padding, dilation, groups, residual, activation)

    def _conv_t_nd(self, nd, x, w, bias, stride, padding, output_padding, dilation, groups, residual,
                   activation):
        spec = ConvSpec.make(nd, stride, padding, dilation, groups, transpose=True,
                             output_padding=output_padding)
        return self.conv(x, w, spec, bias, residual=residual, activation=activation)

    def conv_transpose2d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, output_padding=0,
                         dilation=1, groups=1, residual=None, activation=None):
        """Weight layout O,kH,kW,I/groups (PyTorch's I,O/groups,kH,kW converted at load)."""
        return self._conv_t_nd(2, x, w, bias, stride, padding, output_padding, dilation, groups,
                               residual, activation)

    def conv_transpose3d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, output_padding=0,
                         dilation=1, groups=1, residual=None, activation=None):
        return self._conv_t_nd(3, x, w, bias, stride, padding, output_padding, dilation, groups,
                               residual, activation)

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

    def layer_norm(self, x, weight=None, bias=None, eps: float = 1e-5, activation: str | None = None):
        """LayerNorm over the last (channel) axis."""
        c = x.shape[-1]
        for name, p in (("weight", weight), ("bias", bias)):
            if p is not None and tuple(p.shape) != (c,):
                raise ValueError(f"layer_norm: {name} must have shape ({c},), got {tuple(p.shape)}")
        self._check_activation(activation, "layer_norm")
        return self._layer_norm(x, weight, bias, float(eps), activation)

    def rms_norm(self, x, weight=None, eps: float = 1e-6, activation: str | None = None, prefix=None):
        """RMSNorm over the last (channel) axis: x / sqrt(mean(x^2) + eps) * weight, optional
        fused activation. (Wan's WanRMS_norm, F.normalize * sqrt(C) * gamma, is this with
        eps = 1e-24 / C.) prefix: frames to put in front along axis 1, as concat([prefix,
        rms_norm(x)], axis=1) but without copying the norm's output (a causal conv's cache)."""
        c = x.shape[-1]
        if weight is not None and tuple(weight.shape) != (c,):
            raise ValueError(f"rms_norm: weight must have shape ({c},), got {tuple(weight.shape)}")
        self._check_activation(activation, "rms_norm")
        if prefix is None:
            return self._rms_norm(x, weight, float(eps), activation)
        if x.ndim < 3 or prefix.ndim != x.ndim or tuple(prefix.shape[:1]) != tuple(x.shape[:1]) \
                or tuple(prefix.shape[2:]) != tuple(x.shape[2:]):
            raise ValueError(f"rms_norm: prefix must match x {tuple(x.shape)} on every axis but 1, "
                             f"got {tuple(prefix.shape)}")
        if self.dtype_of(prefix) != self.dtype_of(x):
            raise ValueError(f"rms_norm: prefix dtype {self.dtype_of(prefix)} differs from x's {self.dtype_of(x)}")
        return self._rms_norm_after(prefix, x, weight, float(eps), activation)

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

    def upsample_conv2d(self, x, weight, bias=None):
        """Nearest 2x upsample of (N, H, W, C), then a 3x3 conv with padding 1 (weight O,3,3,C):
        diffusers' Upsample2D and Wan's Resample. One op so that each backend computes it its
        fastest way: literally (NumPy: the 3x3 conv on the upsampled input runs on Winograd), or
        as the equivalent stride-2 transposed conv writing its four phases interleaved (MLX,
        CUDA; spec.upsample_conv_as_transpose)."""
        if x.ndim != 4:
            raise ValueError(f"upsample_conv2d: input must be N,H,W,C, got shape {tuple(x.shape)}")
        c = x.shape[-1]
        if weight.ndim != 4 or tuple(weight.shape[1:]) != (3, 3, c):
            raise ValueError(f"upsample_conv2d: weight must be (O, 3, 3, {c}), got {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"upsample_conv2d: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        self._check_dtype(x, "upsample_conv2d")
        self._check_dtype(weight, "upsample_conv2d")
        return self._upsample_conv2d(x, weight, bias)

    def _upsample_conv2d(self, x, weight, bias):
        """The literal form (a backend overrides this where another one is faster)."""
        return self.conv2d(self._upsample_nearest(x, (2, 2)), weight, bias, padding=1)

    def pad(self, x, padding: PaddingArg, mode: str = "zeros"):
        """Pad the spatial axes of (N, *spatial, C). mode: 'zeros' or 'replicate'."""
        if mode not in ("zeros", "replicate"):
            raise ValueError(f"pad: mode must be 'zeros' or 'replicate', got {mode!r}")
        pads = normalize_padding(padding, x.ndim - 2)
        return self._pad(x, pads, mode)

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

    def mean(self, x, axes: int | Sequence[int], keepdims: bool = False):
        axes_t = (axes,) if isinstance(axes, int) else tuple(axes)
        return self._mean(x, axes_t, keepdims)

    # ---- introspection ----------------------------------------------------------------------
    def conv_choices(self) -> list[dict]:
        """The memoised conv key -> path choices (for /v1/kernels)."""
        return self.paths.choices()

    def plan_cache_stats(self) -> dict:
        """Backend-specific cache statistics; the base reports the path memo size."""
        return {"memoised_keys": len(self.paths.choices())}

    def describe(self) -> dict:
        return {"backend": self.name, "dtype": self.dtype, "paths": [p.name for p in self.paths.catalogue]}
