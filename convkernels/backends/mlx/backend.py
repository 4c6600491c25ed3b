"""The MLX backend: mlx.core arrays, NHWC activations, OHWI weights (MLX's own layouts).

Runs on Metal on Apple silicon and on MLX's CPU device elsewhere (where it is a reference, not a
fast path: MLX's CPU conv measured ~1.5 GF/s on 2 cores). MLX is lazy: ops build a
graph that `to_host`/`synchronize` evaluate.

Conv paths (name, guard, cost rule, runner); the workaround paths exist for MLX releases that
predate the upstream fixes, and their guards/cost rules read the installed version:
- mlx_native: mx.conv_general (transposed convs as flip + input dilation).
- subpixel: a transposed conv with kernel 4, stride 2, padding 1 as four 2x2 phase convs written
  into the interleaved output.
- group_split: grouped conv as one conv per group (MLX has no grouped conv3d).
- depthwise_tail: depthwise conv2d whose output is not a multiple of 8 (MLX PR 3446): our
  tail-aware Metal kernel where MLX < 0.32.0 still gates its own, else pad-to-8-and-slice.
- small_kd_2d: conv3d with kernel depth <= 7 as accumulated per-frame 2D convs (MLX PR 3785).
- tiled_unfold: explicit gemm in tiles under `unfold_limit_bytes` (MLX PR 3084; convkernels/unfold.py).
"""
from __future__ import annotations

import math
import time

import mlx.core as mx
import numpy as np

from ...backend import BackendBase
from ...host import HostReady
from ...paths import ConvPath
from ...spec import ConvKey, is_subpixel_upsample, pad_each_axis, upsample_conv_as_transpose, upsample_shapes
from . import metal
from . import paths as mp

_DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
# numpy-style names of MLX dtypes (getattr: float64 only exists in recent MLX)
_NAMES = {getattr(mx, n): n.rstrip("_") for n in ("float32", "float16", "bfloat16", "float64", "int32", "int64",
                                                  "uint8", "bool_") if hasattr(mx, n)}

# Off Metal (on Metal the device's max_buffer_length is read): MLX's CPU conv has no buffer
# limit, so this only bounds the unfold of our own tiled path.
DEFAULT_UNFOLD_LIMIT = 1 << 31


def _default_unfold_limit(env: mp.MlxEnv) -> int:
    if env.metal:
        try:
            return int(mx.metal.device_info()["max_buffer_length"])
        except Exception:  # older MLX without device_info
            pass
    return DEFAULT_UNFOLD_LIMIT


class MlxBackend(BackendBase):
    name = "mlx"
    supported_dtypes = ("float32", "float16", "bfloat16")

    def __init__(self, dtype: str = "float32", unfold_limit_bytes: int | None = None,
                 timing_sample_rate: float = 0.05, autotune: bool | None = None,
                 env: mp.MlxEnv | None = None, attention_chunk: int = 4096):
        """timing_sample_rate: MLX is lazy, so a timed conv must be evaluated on its own (a
        synchronisation); only that sample of convs pays it.
        autotune: time the valid paths of each new conv key (default: on Metal only).
        env: the MLX version / Metal facts the guards read (default: the installed ones).
        attention_chunk: query rows per attention block, so the score matrix stays bounded."""
        self.env = env or mp.MlxEnv.detect()
        # a limit set by the caller (the service passes CONVSERVE_UNFOLD_LIMIT_BYTES) is a memory
        # bound to honour; the default one only stands for Metal's maxBufferLength
        self.unfold_limit_explicit = bool(unfold_limit_bytes)
        self.unfold_limit_bytes = int(unfold_limit_bytes or _default_unfold_limit(self.env))
        self.autotune = self.env.metal if autotune is None else bool(autotune)
        self.attention_chunk = max(1, int(attention_chunk))
        super().__init__(dtype, timing_sample_rate)

    # ---- arrays ---------------------------------------------------------------------------
    def _mx(self, x):
        if isinstance(x, mx.array):
            return x
        return self.asarray(np.asarray(x), dtype=self._host_dtype_name(np.asarray(x)))

    def _host_dtype_name(self, host: np.ndarray) -> str:
        name = str(host.dtype)
        return name if name in _DTYPES else self.dtype

    def asarray(self, host, dtype=None):
        host = np.asarray(host)
        if host.dtype.kind != "f" and str(host.dtype) != "bfloat16" and host.dtype != np.uint8:
            raise ValueError(f"mlx backend: expected a floating or uint8 array, got dtype {host.dtype}")
        target = dtype or self.dtype
        if target not in _DTYPES:
            raise ValueError(f"mlx backend computes in {tuple(_DTYPES)}, not {target!r}")
        if host.dtype not in (np.float32, np.float16, np.uint8):  # float64, ml_dtypes.bfloat16, ...
            host = host.astype(np.float32)
        # uint8 pixels cross as bytes and widen on the device (0..255 is exact in every dtype)
        return mx.array(np.ascontiguousarray(host)).astype(_DTYPES[target])

    def to_host_async(self, x, clip=None, *, uint8=False):
        """uint8=True: pixels_to_uint8 on the device, each step an op of its own (float32 multiply,
        then add: no fused multiply-add), so a quarter of the bytes leave it."""
        if not uint8 or not isinstance(x, mx.array):
            return super().to_host_async(x, clip, uint8=uint8)
        y = x.astype(mx.float32)
        y = mx.clip(mx.where(mx.isnan(y), mx.array(0.0, mx.float32), y), 0.0, 1.0)  # NaN -> 0
        y = mx.add(mx.multiply(y, mx.array(255.0, mx.float32)), mx.array(0.5, mx.float32))
        return HostReady(np.array(y.astype(mx.uint8)))

    def to_host(self, x):
        if not isinstance(x, mx.array):
            return np.asarray(x)
        if x.dtype in (mx.bfloat16, mx.float16):  # NumPy has no bfloat16; its float16 cast is slow
            x = x.astype(mx.float32)
        return np.array(x)

    def _astype(self, x, dtype: str):
        return x.astype(_DTYPES[dtype])

    def dtype_of(self, x) -> str:
        if isinstance(x, mx.array):
            return _NAMES.get(x.dtype, str(x.dtype).rsplit(".", 1)[-1])
        return str(np.asarray(x).dtype)

    def synchronize(self) -> None:
        sync = getattr(mx, "synchronize", None)  # MLX < 0.19 has none; eval is synchronous there
        if sync is not None:
            sync()

    def _run(self, path, key, x, w, bias, residual, activation):
        self._conv_metrics(key.op, path.name)[0].inc()
        if not self._sampled():
            return path.run(x, w, key, bias, residual, activation)
        # MLX is lazy: a timed conv is evaluated on its own, its operands' pending graph first,
        # so the sample is this conv only
        pending = [a for a in (x, w, bias, residual) if isinstance(a, mx.array)]
        if pending:
            mx.eval(*pending)
        t0 = time.perf_counter()
        out = path.run(x, w, key, bias, residual, activation)
        mx.eval(out)
        self._conv_metrics(key.op, path.name)[1].observe(time.perf_counter() - t0)
        return out

    # ---- conv paths -----------------------------------------------------------------------
    def conv_paths(self) -> list[ConvPath]:
        env = self.env

        def native_ok(k: ConvKey) -> bool:
            return k.spec.groups == 1 or k.spec.nd < 3

        def split_cost(k: ConvKey) -> float:
            # only worth it where native cannot run (grouped 3D)
            return k.macs() * (1.0 if k.spec.nd == 3 else 4.0)

        def tail_ok(k: ConvKey) -> bool:
            return mp.depthwise_fast_shape(k) and mp.has_tail(k)

        def tail_cost(k: ConvKey) -> float:
            # the gated MLX sends tails to the generic gemm, 2-5x slower (PR 3446); ungated
            # MLX and the CPU device gain nothing from padding, which only adds work
            return k.macs() * (0.3 if env.depthwise_gate else 1.2)

        def small_kd_cost(k: ConvKey) -> float:
            # PR 3785: 2.4-3.4x faster than the generic 3D implicit gemm on Metal before the fix.
            # MLX CPU: see SMALL_KD_CPU_FACTOR; fixed Metal MLX decomposes by itself
            return k.macs() * (0.4 if env.slow_conv3d else SMALL_KD_CPU_FACTOR if not env.metal else 1.1)

        def unfold_too_big(k: ConvKey) -> bool:
            return mp.native_unfold_bytes(k, _DTYPES.get(k.dtype, mx.float32).size) > self.unfold_limit_bytes

        def tiled_cost(k: ConvKey) -> float:
            # before PR 3084 MLX's own unfold fails above maxBufferLength: tiling is the only way;
            # a caller's explicit limit is honoured on any version
            return k.macs() * (0.5 if env.untiled_unfold or self.unfold_limit_explicit else 2.0)

        return [
            ConvPath("mlx_native", native_ok, lambda k: float(k.macs()), self._run_native),
            # native runs a transposed conv on its zero-stuffed input: 4x the multiplies here
            ConvPath("subpixel", is_subpixel_upsample, lambda k: 0.5 * k.macs(), self._run_subpixel),
            ConvPath("group_split", lambda k: k.spec.groups > 1, split_cost, self._run_group_split),
            ConvPath("depthwise_tail", tail_ok, tail_cost, self._run_depthwise_tail),
            ConvPath("small_kd_2d", mp.small_kd_ok, small_kd_cost, self._run_small_kd),
            ConvPath("tiled_unfold", unfold_too_big, tiled_cost, self._run_tiled_unfold),
        ]

    def measure_paths(self):
        if not self.autotune:
            return None
        return self._measure

    def _measure(self, key: ConvKey, valid: list[ConvPath]) -> ConvPath:
        """Time each valid path on random operands of the key (best of 2 after a warm-up);
        a path that fails (e.g. a buffer over Metal's limit) is skipped."""
        dt = _DTYPES.get(key.dtype, mx.float32)
        x = mx.random.normal(key.x_shape).astype(dt)
        w = mx.random.normal(key.w_shape).astype(dt)
        mx.eval(x, w)
        best, best_t = None, math.inf
        for path in valid:
            try:
                mx.eval(path.run(x, w, key, None, None, None))
                t = math.inf
                for _ in range(2):
                    t0 = time.perf_counter()
                    mx.eval(path.run(x, w, key, None, None, None))
                    t = min(t, time.perf_counter() - t0)
            except Exception:
                continue
            if t < best_t:
                best, best_t = path, t
        return best or min(valid, key=lambda p: p.cost(key))

    def _operands(self, x, w):
        x = self._mx(x)
        w = self._mx(w)
        if w.dtype != x.dtype:
            w = w.astype(x.dtype)
        return x, w

    def _epilogue(self, out, bias, residual, activation):
        if bias is not None:
            out = out + self._mx(bias).astype(out.dtype)
        if activation is not None:
            out = self._act(out, activation)
        if residual is not None:
            out = out + self._mx(residual).astype(out.dtype)
        return out

    def _run_native(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        return self._epilogue(mp.native_conv(x, w, key), bias, residual, activation)

    def _run_subpixel(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        return self._epilogue(mp.subpixel_conv(x, w, key), bias, residual, activation)

    def _upsample_conv2d(self, x, weight, bias, residual=None):
        # as the equivalent k4 s2 transposed conv, which path choice sends to `subpixel` (or, on
        # Metal with autotune, to whatever measures faster): on MLX's CPU device 2.4x faster than
        # nearest + 3x3 (1x32x32x128: 279 vs 702 ms), and on Metal what the SD-VAE model ran
        # before this op existed (its four phase convs), minus the concatenations
        w4 = upsample_conv_as_transpose(mx, self._mx(weight))
        return self.conv_transpose2d(x, w4, bias, stride=2, padding=1, residual=residual)

    def _run_group_split(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        return self._epilogue(mp.group_split_conv(x, w, key), bias, residual, activation)

    def _run_depthwise_tail(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        if self.env.depthwise_gate and mx.metal.is_available():
            s = key.spec
            b = None if bias is None else self._mx(bias)
            out = metal.depthwise_metal(x, w, b, key.out_shape[1:3], s.padding[0][0], s.padding[1][0],
                                            s.stride)
            return self._epilogue(out, None, residual, activation)
        return self._epilogue(mp.pad_to_multiple_conv(x, w, key), bias, residual, activation)

    def _run_small_kd(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        return self._epilogue(mp.small_kd_conv(x, w, key), bias, residual, activation)

    def _run_tiled_unfold(self, x, w, key, bias, residual, activation):
        x, w = self._operands(x, w)
        return self._epilogue(mp.tiled_unfold_conv(x, w, key, self.unfold_limit_bytes), bias, residual,
                              activation)

    # ---- other ops ------------------------------------------------------------------------
    @staticmethod
    def _act(x, activation):
        if activation == "silu":
            return x * mx.sigmoid(x)
        if activation == "gelu":
            return 0.5 * x * (1.0 + mx.erf(x * (1.0 / math.sqrt(2.0))))
        if activation == "gelu_tanh":
            c = math.sqrt(2.0 / math.pi)
            return 0.5 * x * (1.0 + mx.tanh(c * (x + 0.044715 * x * x * x)))
        if activation == "relu":
            return mx.maximum(x, 0)
        raise ValueError(f"unknown activation {activation!r}")

    def _activation(self, x, activation):
        return self._act(self._mx(x), activation)

    def _affine(self, out, weight, bias):
        if weight is not None:
            out = out * self._mx(weight).astype(mx.float32)
        if bias is not None:
            out = out + self._mx(bias).astype(mx.float32)
        return out

    def _group_norm(self, x, num_groups, weight, bias, eps, activation):
        # statistics in float32 whatever the storage dtype (half sums over 64x64x32 overflow precision)
        x = self._mx(x)
        dt = x.dtype
        xf = x.astype(mx.float32)
        n, c = x.shape[0], x.shape[-1]
        xr = xf.reshape(n, -1, num_groups, c // num_groups)
        mean = mx.mean(xr, axis=(1, 3), keepdims=True)
        centered = xr - mean
        var = mx.mean(centered * centered, axis=(1, 3), keepdims=True)
        out = (centered * mx.rsqrt(var + eps)).reshape(x.shape)
        out = self._affine(out, weight, bias)
        if activation is not None:
            out = self._act(out, activation)
        return out.astype(dt)

    def _layer_norm(self, x, weight, bias, eps, activation):
        x = self._mx(x)
        dt = x.dtype
        xf = x.astype(mx.float32)
        mean = mx.mean(xf, axis=-1, keepdims=True)
        centered = xf - mean
        var = mx.mean(centered * centered, axis=-1, keepdims=True)
        out = self._affine(centered * mx.rsqrt(var + eps), weight, bias)
        if activation is not None:
            out = self._act(out, activation)
        return out.astype(dt)

    def _upsample_nearest(self, x, scale):
        x = self._mx(x)
        expanded, target, final = upsample_shapes(tuple(x.shape), scale)
        return mx.broadcast_to(x.reshape(expanded), target).reshape(final)

    def _pad(self, x, pads, modes):
        return pad_each_axis(self._mx(x), pads, modes, _mx_pad)

    def _matmul(self, a, b):
        a, b = self._mx(a), self._mx(b)
        return mx.matmul(a, b.astype(a.dtype))

    def _softmax(self, x, axis):
        return mx.softmax(self._mx(x), axis=axis, precise=True)

    def _attention(self, q, k, v, scale):
        q, k, v = self._mx(q), self._mx(k), self._mx(v)
        lead, lq = q.shape[:-2], q.shape[-2]
        # mx.fast.sdpa takes (B, heads, L, D): fold every leading axis into B, one head
        q4, k4, v4 = (t.reshape(-1, 1, *t.shape[-2:]) for t in (q, k, v))
        v4 = v4.astype(q.dtype)
        step = self.attention_chunk
        # query rows in blocks: the VAE mid-block's head dim (512) has no fused Metal kernel, so
        # the scores are materialised; blocks keep them at step x Lk (whole, a 128x128 latent
        # would need 16k x 16k floats, 1 GiB)
        outs = [mx.fast.scaled_dot_product_attention(q4[:, :, s:s + step], k4, v4, scale=scale)
                for s in range(0, lq, step)]
        out = outs[0] if len(outs) == 1 else mx.concatenate(outs, axis=2)
        return out.reshape(*lead, lq, v.shape[-1])

    def _concat(self, xs, axis):
        return mx.concatenate([self._mx(x) for x in xs], axis=axis)

    def _mean(self, x, axes, keepdims):
        return mx.mean(self._mx(x), axis=list(axes), keepdims=keepdims)

    def reshape(self, x, shape):
        return self._mx(x).reshape(tuple(shape))

    def transpose(self, x, axes):
        return self._mx(x).transpose(tuple(axes))

    def describe(self) -> dict:
        return {**super().describe(), "device": str(mx.default_device()), "mlx_version": mx.__version__,
                "metal": self.env.metal, "unfold_limit_bytes": self.unfold_limit_bytes,
                "autotune": self.autotune}


# Cost factor of small_kd_2d vs mlx_native on MLX's CPU device. benchmarks/mlx/mlx_paths.py on MLX
# 0.32.4 CPU (2 shared, loaded Xeon cores), three runs: 5x15x26 512->512 at 1.95x / 0.70x / 1.38x,
# the 256-channel shapes at 1.00-1.33x. Not a consistent win, so MLX's own dispatch keeps these
# convs (autotune=True measures per key instead).
SMALL_KD_CPU_FACTOR = 1.1


def _mx_pad(x, width, mode: str):
    """mx.pad, with NumPy's 'reflect' (which mx.pad lacks) as a gather of each padded axis's lines."""
    if mode != "reflect":
        return mx.pad(x, [tuple(w) for w in width], mode=mode)
    for axis, (lo, hi) in enumerate(width):
        if lo or hi:
            n = x.shape[axis]
            lines = np.concatenate([np.arange(lo, 0, -1), np.arange(n), np.arange(n - 2, n - 2 - hi, -1)])
            x = mx.take(x, mx.array(lines.astype(np.int32)), axis=axis)
    return x
