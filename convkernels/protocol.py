"""The typed contract models are written against and the service drives: one backend per device.

Every member a model or the service may use is listed here, and nothing else: models and the
service name only this Protocol (docs/interfaces.md, "Backend"), never a backend class, and
never probe a backend with getattr. `convkernels.BackendBase` (backend.py), the class the numpy,
mlx and cuda backends extend, implements all of it; the optional capabilities at the end have
defaults there that say "not offered" (None, False, or the unfused route), so a backend that
does not offer one inherits the default. Arrays are the backend's native arrays, channels-last:
activations N,*spatial,C, conv weights O,*k,I/groups.
"""
from __future__ import annotations

from typing import Any, Callable, Protocol, Sequence, runtime_checkable

import numpy as np

from .spec import ConvSpec, PaddingArg

Array = Any
#: a callable run as hook(x, w, spec) ahead of every conv (Backend.before_conv); it may raise
ConvHook = Callable[[Array, Array, ConvSpec], None]


class Graphed(Protocol):
    """What `Backend.graphed(fn)` returns: called as fn is. `records(*xs)` says whether a call
    with inputs like xs may still be captured and replayed (CUDA graphs); False where such
    inputs run eagerly for good, and always False on a backend that records nothing, so a
    caller with an eager route of its own (Wan's in-place cache) takes that route."""

    def __call__(self, *xs: Array) -> Any: ...

    def records(self, *xs: Array) -> bool: ...


@runtime_checkable
class Backend(Protocol):
    #: stable name used in metric labels and settings
    name: str
    #: the dtype arrays are computed in unless asked otherwise (numpy names)
    dtype: str
    #: None, or a hook run ahead of every conv: the one seam for wrapping convs (the service's
    #: fault injection sets it; nothing replaces backend methods)
    before_conv: ConvHook | None
    #: bytes of working memory one model call may take; models tile (or chunk) beyond it
    work_memory_budget: int

    # ---- arrays and device ------------------------------------------------------------------
    def asarray(self, host: np.ndarray, dtype: str | None = None) -> Array: ...

    def to_host_async(self, x: Array, clip: tuple[float, float] | None = None, *, uint8: bool = False) -> Any: ...

    def to_host(self, x: Array) -> np.ndarray: ...

    def host_batch(self, shape: tuple, dtype: Any) -> np.ndarray | None:
        """A host buffer to stack a batch in that asarray uploads cheapest (CUDA: pinned), or None:
        stack it anywhere."""
        ...

    def dtype_of(self, x: Array) -> str: ...

    def synchronize(self) -> None: ...

    def flush_timings(self) -> None: ...

    def graphed(self, fn: Callable) -> Graphed: ...

    @property
    def calls_to_warm(self) -> int: ...

    # ---- convolutions ------------------------------------------------------------------------
    def conv(self, x: Array, w: Array, spec: ConvSpec, bias: Array | None = None, *,
             residual: Array | None = None, activation: str | None = None) -> Array: ...

    def conv1d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, dilation=1, groups=1,
               residual=None, activation=None) -> Array: ...

    def conv2d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, dilation=1, groups=1,
               residual=None, activation=None) -> Array: ...

    def conv3d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, dilation=1, groups=1,
               residual=None, activation=None) -> Array: ...

    def conv_transpose2d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, output_padding=0,
                         dilation=1, groups=1, residual=None, activation=None) -> Array: ...

    def conv_transpose3d(self, x, w, bias=None, *, stride=1, padding: PaddingArg = 0, output_padding=0,
                         dilation=1, groups=1, residual=None, activation=None) -> Array: ...

    # ---- normalisation, activations, resampling -----------------------------------------------
    def group_norm(self, x, num_groups: int, weight=None, bias=None, eps: float = 1e-5,
                   activation: str | None = None) -> Array: ...

    def group_norm_sums(self, x, num_groups: int) -> Any: ...

    def group_norm_apply(self, x, sums, count: float, num_groups: int, weight=None, bias=None,
                         eps: float = 1e-5, activation: str | None = None) -> Array: ...

    def layer_norm(self, x, weight=None, bias=None, eps: float = 1e-5, activation: str | None = None) -> Array: ...

    def rms_norm(self, x, weight=None, eps: float = 1e-6, activation: str | None = None,
                 prefix=None, rows=None) -> Array: ...

    def silu(self, x) -> Array: ...

    def gelu(self, x, approximate: bool = False) -> Array: ...

    def relu(self, x) -> Array: ...

    def upsample_nearest(self, x, scale: int | Sequence[int]) -> Array: ...

    def upsample_conv2d(self, x, weight, bias=None, *, residual=None) -> Array: ...

    def pixel_shuffle(self, x, factors: Sequence[int], repeats: int = 1, start: int = 0) -> Array: ...

    def pad(self, x, padding: PaddingArg, mode: str | Sequence[str] = "zeros") -> Array: ...

    # ---- dense ops and shape ------------------------------------------------------------------
    def matmul(self, a, b) -> Array: ...

    def linear(self, x, weight, bias=None, *, residual=None, activation: str | None = None) -> Array: ...

    def attention(self, q, k, v, scale: float | None = None) -> Array: ...

    def softmax(self, x, axis: int = -1) -> Array: ...

    def concat(self, xs: Sequence[Array], axis: int = -1) -> Array: ...

    def slice(self, x, axis: int, start: int, stop: int, step: int = 1) -> Array: ...

    def reshape(self, x, shape) -> Array: ...

    def transpose(self, x, axes) -> Array: ...

    def add(self, a, b) -> Array: ...

    def mul(self, a, b) -> Array: ...

    def divide(self, a, b) -> Array: ...

    def astype(self, x, dtype: str) -> Array: ...

    def mean(self, x, axes: int | Sequence[int], keepdims: bool = False) -> Array: ...

    # ---- introspection (the service's /v1/kernels and model cards) ----------------------------
    def conv_choices(self) -> list[dict]: ...

    def plan_cache_stats(self) -> dict: ...

    def describe(self) -> dict: ...

    # ---- optional capabilities (BackendBase's defaults say "not offered") -----------------------
    #: ops return before the device has run them and to_host_async overlaps its copy with the
    #: next work, so a model may queue one more piece before it waits (Wan's frame groups).
    #: Default False.
    runs_ahead: bool
    #: bytes one conv's unfold (im2col) buffer may take; models count it in their memory
    #: estimates. Default None: the backend builds no such buffer under a bound.
    unfold_limit_bytes: int | None
    #: query rows per attention block (the score matrix is chunk x keys); models count it in
    #: their memory estimates. Default None: the backend bounds its scores another way, or not.
    attention_chunk: int | None
    #: bytes one block of attention scores may take, for a backend that bounds them by size
    #: instead of by rows (cuda); models count it in their memory estimates. Default None.
    attention_score_bytes: int | None

    def depthwise_conv_layer_norm(self, x, w, bias, norm_w, norm_b, eps: float) -> Array | None:
        """layer_norm(conv2d(x, w, bias, padding=k // 2, groups=C), norm_w, norm_b, eps) in
        one fused op (ConvNeXt's block), or None where the backend does not fuse this case: the
        caller then runs the two ops. Default: always None."""
        ...

    def mlp(self, x, w1, b1, w2, b2, activation: str | None, residual) -> Array | None:
        """linear(linear(x, w1, b1, activation=activation), w2, b2, residual=residual) in one op
        (a transformer or ConvNeXt MLP), or None where the backend has no better way for this
        case: the caller then runs the two linears. Default: always None."""
        ...

    def depthwise_ln_mlp(self, x, blocks, eps: float, activation: str | None) -> Array | None:
        """ConvNeXt's block bodies one after another in one op: for each (w, bias, norm_w, norm_b, w1,
        b1, w2, b2) in blocks, x = x + mlp(depthwise_conv_layer_norm(x, w, bias, norm_w, norm_b, eps),
        w1, b1, w2, b2, activation); or None where the backend has no better way for these blocks:
        the caller then runs each block's depthwise_conv_layer_norm and MLP. Default: always None."""
        ...

    def rms_norm_affine(self, x, weight, bias, residual, eps: float) -> Array | None:
        """rms_norm(x, weight, eps) + bias (per channel) + residual (x's shape), either may be
        None, in one op; or None where the backend has no better way (the caller runs the norm
        and the adds). Default: always None."""
        ...

    def gated(self, x, activation: str) -> Array | None:
        """x (..., 2C) -> (..., C): x[..., :C] * activation(x[..., C:]), a gated linear unit's two
        halves in one pass; or None where the backend has no better way (the caller slices,
        activates and multiplies). Default: always None."""
        ...

    def relu_linear_attention_sums(self, qkv, head_dim: int, scale: float) -> Array | None:
        """qkv (N, H, W, G * 3 * head_dim), channels-last groups of [q | k | v], or a list of such
        arrays whose channels are read as concatenated (never made) -> float32 (N, G, d, d + 1):
        scale * sum over tokens of relu(k)^T [v | 1], per group; or None where the backend has no
        better way (the caller concatenates and computes them from slices,
        models/nn/linear_attention.py). Default: always None."""
        ...

    def relu_linear_attention_apply(self, qkv, sums, head_dim: int, eps: float) -> Array | None:
        """(N, H, W, G * d) in qkv's dtype (qkv an array or a list, as relu_linear_attention_sums):
        per group, relu(q) @ sums[:, :d] divided by relu(q) @ sums[:, d] + eps; or None (as
        relu_linear_attention_sums). Default: always None."""
        ...
