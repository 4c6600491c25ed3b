"""BackendBase: the class the numpy, mlx and cuda backends extend to implement the Backend
contract (protocol.py). One backend object per device.

Public methods validate their arguments (clear ValueErrors) and dispatch to underscored hooks;
arrays are the backend's native arrays (numpy.ndarray, mlx.core.array, cupy.ndarray),
channels-last. What a new backend implements:

- `name`, `supported_dtypes`, and its constructor, which sets what `__init__` needs first
  (the paths below may read the backend's own settings) and then calls `super().__init__`.
- `conv_paths()`: its conv algorithms as ConvPaths (name, guard, cost rule, runner);
  `measure_paths()` optionally returns an autotuner (default None: cost rules decide).
- `_run(path, key, x, w, bias, residual, activation)`: run the chosen path on the validated
  operands and count it in the metrics (`_count_and_time` does both on a synchronous device).
- arrays: `asarray`, `to_host`, `dtype_of`.
- the op primitives (abstract in tensor_ops.TensorOps, whose public ops call them): `_group_norm`,
  `_layer_norm`, `_activation`, `_upsample_nearest`, `_pad`, `_matmul`, `_attention`, `_softmax`,
  `_concat`, `_mean`.
- `path_memo_events = False` if its own plan cache counts the plan cache events (cuda).

What it may override, with the default in brackets: `_conv_operands` [check the dtypes],
`to_host_async` [copy at once], `synchronize` and `flush_timings` [no-ops], `_rms_norm` [through
layer_norm], `_rms_norm_after` [norm, then concat], `_linear` [matmul + epilogue],
`_upsample_conv2d` [nearest 2x, then the 3x3 conv]; and the optional capabilities of the
contract: `runs_ahead` [False], `unfold_limit_bytes` [None], `attention_chunk` [None],
`attention_score_bytes` [None], `reads_shuffled_residual` [False], `depthwise_conv_layer_norm`
[None: not fused], `mlp` [None: two linears], `depthwise_ln_mlp` [None: the two ops before, a block at a time], `graphed` [the forward, run eagerly, recording nothing], `calls_to_warm` [1], `host_batch` [None:
stack a batch anywhere], `pin_host_region` and `gather_rows` [None: not offered].
"""
from __future__ import annotations

import logging
import random
import time
from abc import abstractmethod
from typing import Any, Callable

import numpy as np

from .host import HostReady, pixels_to_uint8
from .metrics import CONV_SECONDS, CONV_TOTAL
from .paths import ConvPath, PathChooser
from .protocol import ConvHook
from .spec import ConvKey, ConvSpec, PaddingArg, validate_conv
from .tensor_ops import ShuffledResidual, TensorOps

log = logging.getLogger("convkernels")

Array = Any

CONV_OPS = {1: "conv1d", 2: "conv2d", 3: "conv3d"}
CONV_T_OPS = {2: "conv_transpose2d", 3: "conv_transpose3d"}


class EagerForward:
    """`graphed(fn)` on a backend that records nothing: fn itself, run eagerly every call."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, *xs):
        return self.fn(*xs)

    def records(self, *xs) -> bool:
        return False


class BackendBase(TensorOps):
    """Base of the numpy, mlx and cuda backends (see the module docstring for what to implement)."""

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
    #: whether the path memo counts its hits and misses as plan cache events; False where the
    #: backend's own plan cache emits them (cuda), so there is one event stream per backend
    path_memo_events: bool = True

    # ---- optional capabilities of the contract: defaults that say "not offered" ---------------
    #: ops return before the device has run them, and to_host_async overlaps its copy with the
    #: next work: a model may queue one more piece before it waits (Wan's frame groups)
    runs_ahead: bool = False
    #: bytes one conv's unfold (im2col) buffer may take, for backends that build one under a bound
    unfold_limit_bytes: int | None = None
    #: query rows per attention block, for backends that chunk attention by rows
    attention_chunk: int | None = None
    #: bytes one block of attention scores may take, for backends that bound them by size
    attention_score_bytes: int | None = None
    #: _upsample_conv2d takes a ShuffledResidual as it is (else upsample_conv2d makes it first)
    reads_shuffled_residual: bool = False

    def host_batch(self, shape, dtype) -> np.ndarray | None:
        """Where a caller stacking a batch of host inputs should put it, for asarray to upload it
        cheapest; None (the default): anywhere, ordinary host memory is as good."""
        return None

    def pin_host_region(self, address: int, nbytes: int):
        """Host memory that callers will gather batches from (gather_rows), pinned where it lies;
        a handle whose release() unpins it, or None (the default: not offered)."""
        return None

    def gather_rows(self, parts: list[np.ndarray], regions: list, addresses: list[int] | None = None) -> Any:
        """The host parts joined along axis 0 as a device array, each read where it lies in its
        pinned region (pin_host_region); None (the default, or a part outside its region): the
        caller stacks them and uploads the stack. addresses: each part's first byte where the
        caller knows it (0: not known), so it need not be read from the array."""
        return None

    def jpeg_decoder(self):
        """A decoder of JPEG files on the device's own engines (the CUDA backend's codecs/jpeg.py:
        new_rows, decode_into, set_row, ready, join, to_host, own_stream); None (the default): not
        offered. It may raise where the device or its library cannot decode."""
        return None

    def depthwise_conv_layer_norm(self, x, w, bias, norm_w, norm_b, eps: float):
        """LayerNorm(depthwise 'same' conv2d(x, w) + bias) as one fused op, or None where the
        backend does not fuse it (the caller runs conv2d, then layer_norm). Not fused here."""
        return None

    def mlp(self, x, w1, b1, w2, b2, activation, residual):
        """Two linears as one op, or None where the backend has no better way (the caller runs
        the two linears). None here."""
        return None

    def depthwise_ln_mlp(self, x, blocks, eps: float, activation):
        """ConvNeXt's block bodies one after another in one op, or None (the caller runs each
        block's depthwise_conv_layer_norm and MLP). None here."""
        return None

    def rms_norm_affine(self, x, weight, bias, residual, eps: float):
        """rms_norm(x, weight, eps) + bias + residual in one op, or None (the caller runs the
        norm and the adds). None here."""
        return None

    def gated(self, x, activation: str):
        """A gated linear unit's halves in one op, or None (the caller slices, activates and
        multiplies). None here."""
        return None

    def relu_linear_attention_sums(self, qkv, head_dim: int, scale: float):
        """ReLU linear attention's key-value sums in one op, or None (the caller computes them
        from slices: models/nn/linear_attention.py). None here."""
        return None

    def relu_linear_attention_apply(self, qkv, sums, head_dim: int, eps: float):
        """ReLU linear attention's queries against the sums in one op, or None. None here."""
        return None

    def graphed(self, fn):
        """fn(*xs) -> array or tuple of arrays, a model's forward on device arrays that depends on
        nothing but its inputs and the (fixed) weights; state carried between calls (a causal
        cache) goes in and out as arrays. A backend that can record a whole forward once and
        replay it (CUDA graphs) returns a replaying wrapper whose `records(*xs)` is False once
        inputs like these run eagerly for good; here fn runs eagerly and records is False."""
        return EagerForward(fn)

    @property
    def calls_to_warm(self) -> int:
        """Calls of a graphed forward on a new input shape before it runs at full speed: 1, or 2
        where the second call records the CUDA graph that later calls replay."""
        return 1

    def __init__(self, dtype: str = "float32", timing_sample_rate: float = 1.0):
        if dtype not in self.supported_dtypes:
            raise ValueError(f"backend {self.name} computes in {self.supported_dtypes}, not {dtype!r}")
        self.dtype = dtype
        self.timing_sample_rate = float(timing_sample_rate)
        self._rng = random.Random(0)
        self._metric_children: dict = {}
        self.paths = PathChooser(self.name, self.conv_paths(), self.measure_paths(),
                                 cache_metrics=self.path_memo_events)

    # ---- to implement -------------------------------------------------------------------
    @abstractmethod
    def conv_paths(self) -> list[ConvPath]:
        """The path catalogue: each path's run(x, w, key, bias, residual, activation) -> out."""

    def measure_paths(self):
        """Optional autotune: a callable (key, valid_paths) -> path, or None for cost rules."""
        return None

    @abstractmethod
    def _run(self, path: ConvPath, key: ConvKey, x, w, bias, residual, activation) -> Array:
        """Run `path` (the choice for `key`) on operands `conv` validated, count the conv in
        convkernels_conv_total under the path that ran, and time a sample of convs."""

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

    def synchronize(self) -> None:
        """Wait for queued device work (no-op on synchronous backends)."""

    def flush_timings(self) -> None:
        """Harvest sampled conv timings into the metrics (after a batch completes)."""

    def _sampled(self) -> bool:
        """Whether this conv's time is measured (timing_sample_rate of them)."""
        return self.timing_sample_rate >= 1.0 or self._rng.random() < self.timing_sample_rate

    def _count_and_time(self, path: ConvPath, key: ConvKey, x, w, bias, residual, activation):
        """`_run` for a synchronous device: count the conv, run it, and time it on the host
        when sampled (the result is ready when run returns)."""
        return self._counted(key.op, path.name, path.run, x, w, key, bias, residual, activation)

    def _counted(self, op: str, path: str, fn, *args, calls: int = 1):
        """fn(*args) counted as `calls` `op`s on `path` and, when sampled, timed on the host (a
        synchronous device: the result is ready when fn returns), each call observed as its share
        of the time. A fused op that stands for convs goes through here too, so every counted path
        has timings."""
        count, seconds = self._conv_metrics(op, path)
        count.inc(calls)
        if not self._sampled():
            return fn(*args)
        t0 = time.perf_counter()
        out = fn(*args)
        share = (time.perf_counter() - t0) / calls
        for _ in range(calls):
            seconds.observe(share)
        return out

    def _conv_metrics(self, op: str, path: str):
        """(count, seconds) children for one op and path: labels() costs ~3 us a call, and a
        small conv is ~100 us."""
        children = self._metric_children.get((op, path))
        if children is None:
            children = self._metric_children[(op, path)] = (CONV_TOTAL.labels(self.name, op, path),
                                                             CONV_SECONDS.labels(self.name, op, path))
        return children

    # ---- convolutions -------------------------------------------------------------------
    def conv(self, x: Array, w: Array, spec: ConvSpec, bias: Array | None = None, *,
             residual: Array | None = None, activation: str | None = None) -> Array:
        """out = activation(conv(x, w) + bias) + residual, channels-last.

        The residual is added after the activation: the hosted models are pre-activation
        (VAE ResNet blocks, ConvNeXt), where the skip joins after the last conv. Every backend
        runs this preamble (the before_conv hook, validation, the conv key, the memoised path
        choice) and then its own `_run`."""
        if self.before_conv is not None:
            self.before_conv(x, w, spec)
        nd = spec.nd
        op = (CONV_T_OPS if spec.transpose else CONV_OPS).get(nd)
        if op is None:
            raise ValueError(f"no {'transposed ' if spec.transpose else ''}conv for {nd} spatial dims")
        validate_conv(op, tuple(x.shape), tuple(w.shape), spec,
                      None if bias is None else tuple(bias.shape),
                      None if residual is None else tuple(residual.shape), activation)
        x, w, bias, residual = self._conv_operands(op, x, w, bias, residual)
        key = ConvKey(op, tuple(x.shape), tuple(w.shape), self.dtype_of(x), spec,
                      (bias is not None, residual is not None, activation))
        return self._run(self.paths.choose(key), key, x, w, bias, residual, activation)

    def prepare_conv(self, w: Array, *, stride=1, padding: PaddingArg = 0, dilation=1, groups=1,
                     size: int | tuple[int, ...] = 64) -> None:
        """At load: run now the weight transform of the path a call on an input of spatial `size`
        (an int: that on every axis) would take (paths.py's `prepare`), so that the first request
        does not pay it. An estimate: nothing is memoised or timed, and a call that takes another
        path transforms then."""
        nd = len(w.shape) - 2
        if nd not in CONV_OPS or not any(p.prepare for p in self.paths.catalogue):
            return
        spec = ConvSpec.make(nd, stride, padding, dilation, groups)
        x_shape = (1, *((size,) * nd if isinstance(size, int) else size), w.shape[-1] * groups)
        key = ConvKey(CONV_OPS[nd], x_shape, tuple(w.shape), self.dtype_of(w), spec, (False, False, None))
        path = self.paths.estimate(key)
        if path is not None and path.prepare is not None:
            path.prepare(w, key)

    def prepare_linear(self, weight: Array) -> None:
        """At load: a linear's weight transform, where the backend has one (packing); none here."""

    def _conv_operands(self, op: str, x, w, bias, residual) -> tuple:
        """The operands a path runs on, after validation: here x and w as given, refused unless
        their dtypes are floating (a backend that stores one compute dtype casts here instead)."""
        self._check_dtype(x, op)
        self._check_dtype(w, op)
        return x, w, bias, residual

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

    def upsample_conv2d(self, x, weight, bias=None, *, residual=None):
        """Nearest 2x upsample of (N, H, W, C), then a 3x3 conv with padding 1 (weight O,3,3,C):
        diffusers' Upsample2D and Wan's Resample. One op so that each backend computes it its
        fastest way: literally (NumPy: the 3x3 conv on the upsampled input runs on Winograd), or
        as the equivalent stride-2 transposed conv writing its four phases interleaved (MLX,
        CUDA; spec.upsample_conv_as_transpose). residual (N, 2H, 2W, O), if given, is added to
        the result in the conv's epilogue; it may be a ShuffledResidual (Wan 2.2's DupUp3D shortcut),
        which a backend with reads_shuffled_residual reads in place and the others make first."""
        if x.ndim != 4:
            raise ValueError(f"upsample_conv2d: input must be N,H,W,C, got shape {tuple(x.shape)}")
        c = x.shape[-1]
        if weight.ndim != 4 or tuple(weight.shape[1:]) != (3, 3, c):
            raise ValueError(f"upsample_conv2d: weight must be (O, 3, 3, {c}), got {tuple(weight.shape)}")
        if bias is not None and tuple(bias.shape) != (weight.shape[0],):
            raise ValueError(f"upsample_conv2d: bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
        want = (x.shape[0], 2 * x.shape[1], 2 * x.shape[2], weight.shape[0])
        shuffled = isinstance(residual, ShuffledResidual)
        got = None if residual is None else tuple(residual.frames_shape if shuffled else residual.shape)
        if residual is not None and got != want:
            raise ValueError(f"upsample_conv2d: residual must have shape {want}, got {got}")
        self._check_dtype(x, "upsample_conv2d")
        self._check_dtype(weight, "upsample_conv2d")
        if shuffled and not self.reads_shuffled_residual:
            residual = self.shuffled_frames(residual)
        return self._upsample_conv2d(x, weight, bias, residual)

    def _upsample_conv2d(self, x, weight, bias, residual=None):
        """The literal form (a backend overrides this where another one is faster)."""
        return self.conv2d(self._upsample_nearest(x, (2, 2)), weight, bias, padding=1, residual=residual)

    # ---- introspection ----------------------------------------------------------------------
    def conv_choices(self) -> list[dict]:
        """The memoised conv key -> path choices (for /v1/kernels)."""
        return self.paths.choices()

    def plan_cache_stats(self) -> dict:
        """Backend-specific cache statistics; the base reports the path memo size."""
        return {"memoised_keys": len(self.paths.choices())}

    def describe(self) -> dict:
        return {"backend": self.name, "dtype": self.dtype, "paths": [p.name for p in self.paths.catalogue]}
