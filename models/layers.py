"""Model building blocks on the backend interface: Conv2d, GroupNorm, Linear, ResnetBlock2D,
SpatialAttention (the VAE mid-block attention), Upsample2D, Downsample2D.

Each layer names its parameters the way PyTorch / diffusers checkpoints do, so a tree of layers
knows the full expected state dict (name -> PyTorch-layout shape). Loading converts every tensor
once, on the host, to the channels-last layout and the backend dtype; forward passes use only
backend ops on backend arrays.
"""
from __future__ import annotations

from typing import Iterator, Mapping

import numpy as np

from convkernels import Backend

from .weights import conv_weight_to_channels_last


class Layer:
    """A node of the model tree: own parameters (`_shapes`) plus named children."""

    def __init__(self) -> None:
        self.children: dict[str, Layer] = {}
        self.params: dict = {}  # name -> backend array, filled by load()

    def _shapes(self) -> dict[str, tuple[int, ...]]:
        """Own parameters in checkpoint (PyTorch) layout."""
        return {}

    def _convert(self, name: str, host: np.ndarray) -> np.ndarray:
        """Checkpoint layout -> our layout (host side, once at load)."""
        return host

    def add(self, name: str, child: "Layer") -> "Layer":
        self.children[name] = child
        return child

    def walk(self, prefix: str = "") -> Iterator[tuple[str, "Layer"]]:
        yield prefix, self
        for name, child in self.children.items():
            yield from child.walk(f"{prefix}{name}.")

    def expected_shapes(self, prefix: str = "") -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for p, layer in self.walk(prefix):
            for k, shape in layer._shapes().items():
                out[p + k] = shape
        return out

    def load(self, tensors: Mapping[str, np.ndarray], backend: Backend, prefix: str = "") -> None:
        """Take this subtree's tensors (already checked by check_state_dict)."""
        layers = list(self.walk(prefix))
        for p, layer in layers:
            layer.params = {k: backend.asarray(layer._convert(k, np.asarray(tensors[p + k])))
                            for k in layer._shapes()}
        for p, layer in layers:  # after the whole subtree has its parameters
            layer._derive(tensors, backend, p)

    def _derive(self, tensors: Mapping[str, np.ndarray], backend: Backend, prefix: str) -> None:
        """Hook: parameters computed from the checkpoint's (host, once at load)."""


class Conv2d(Layer):
    def __init__(self, cin: int, cout: int, kernel: int, stride: int = 1, padding=0, bias: bool = True):
        super().__init__()
        self.cin, self.cout, self.kernel, self.stride, self.padding = cin, cout, kernel, stride, padding
        self.has_bias = bias

    def _shapes(self):
        shapes = {"weight": (self.cout, self.cin, self.kernel, self.kernel)}
        if self.has_bias:
            shapes["bias"] = (self.cout,)
        return shapes

    def _convert(self, name, host):
        return conv_weight_to_channels_last(host) if name == "weight" else host

    def __call__(self, backend: Backend, x, residual=None, activation=None):
        return backend.conv2d(x, self.params["weight"], self.params.get("bias"), stride=self.stride,
                              padding=self.padding, residual=residual, activation=activation)


class GroupNorm(Layer):
    def __init__(self, groups: int, channels: int, eps: float):
        super().__init__()
        self.groups, self.channels, self.eps = groups, channels, eps

    def _shapes(self):
        return {"weight": (self.channels,), "bias": (self.channels,)}

    def __call__(self, backend: Backend, x, activation=None):
        return backend.group_norm(x, self.groups, self.params["weight"], self.params["bias"], self.eps,
                                  activation=activation)


class Linear(Layer):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.cin, self.cout = cin, cout

    def _shapes(self):
        return {"weight": (self.cout, self.cin), "bias": (self.cout,)}

    def __call__(self, backend: Backend, x, residual=None, activation=None):
        return backend.linear(x, self.params["weight"], self.params["bias"], residual=residual,
                              activation=activation)


class ResnetBlock2D(Layer):
    """diffusers ResnetBlock2D without time embedding: norm-SiLU-conv twice, skip added in the
    second conv's epilogue (through a 1x1 conv_shortcut when the channel count changes)."""

    def __init__(self, cin: int, cout: int, groups: int, eps: float):
        super().__init__()
        self.norm1 = self.add("norm1", GroupNorm(groups, cin, eps))
        self.conv1 = self.add("conv1", Conv2d(cin, cout, 3, padding=1))
        self.norm2 = self.add("norm2", GroupNorm(groups, cout, eps))
        self.conv2 = self.add("conv2", Conv2d(cout, cout, 3, padding=1))
        self.conv_shortcut = self.add("conv_shortcut", Conv2d(cin, cout, 1)) if cin != cout else None

    def __call__(self, backend: Backend, x):
        h = self.norm1(backend, x, activation="silu")
        h = self.conv1(backend, h)
        h = self.norm2(backend, h, activation="silu")
        skip = self.conv_shortcut(backend, x) if self.conv_shortcut is not None else x
        return self.conv2(backend, h, residual=skip)


class SpatialAttention(Layer):
    """The VAE mid-block attention: GroupNorm, single-head self-attention over the H*W tokens,
    output projection with the input added back (diffusers Attention with
    residual_connection=True, rescale_output_factor=1, heads=1)."""

    def __init__(self, channels: int, groups: int, eps: float):
        super().__init__()
        self.channels = channels
        self.group_norm = self.add("group_norm", GroupNorm(groups, channels, eps))
        self.to_q = self.add("to_q", Linear(channels, channels))
        self.to_k = self.add("to_k", Linear(channels, channels))
        self.to_v = self.add("to_v", Linear(channels, channels))
        self.to_out = self.add("to_out", Layer())
        self.proj = self.to_out.add("0", Linear(channels, channels))

    def __call__(self, backend: Backend, x):
        n, h, w, c = x.shape
        tokens = backend.reshape(self.group_norm(backend, x), (n, h * w, c))
        q = self.to_q(backend, tokens)
        k = self.to_k(backend, tokens)
        v = self.to_v(backend, tokens)
        attended = backend.attention(q, k, v)
        out = self.proj(backend, attended, residual=backend.reshape(x, (n, h * w, c)))
        return backend.reshape(out, (n, h, w, c))


class Upsample2D(Layer):
    """diffusers Upsample2D (use_conv=True): nearest 2x upsample then a 3x3 conv, padding 1.

    mode "subpixel" (default) hands both steps to the backend as one op (upsample_conv2d), which
    computes them its fastest way (CUDA: a stride-2 transposed conv writing the four output
    phases interleaved, 16 instead of 36 multiply-adds per low-res pixel and channel pair);
    mode "nearest" runs them as two ops."""

    def __init__(self, channels: int, mode: str = "subpixel"):
        super().__init__()
        if mode not in ("subpixel", "nearest"):
            raise ValueError(f"Upsample2D mode must be 'subpixel' or 'nearest', got {mode!r}")
        self.mode = mode
        self.conv = self.add("conv", Conv2d(channels, channels, 3, padding=1))

    def __call__(self, backend: Backend, x):
        if self.mode == "nearest":
            return self.conv(backend, backend.upsample_nearest(x, 2))
        return backend.upsample_conv2d(x, self.conv.params["weight"], self.conv.params["bias"])


class Downsample2D(Layer):
    """3x3 stride-2 conv with diffusers' asymmetric (0, 1, 0, 1) zero padding (padding=0 case)."""

    def __init__(self, channels: int):
        super().__init__()
        self.conv = self.add("conv", Conv2d(channels, channels, 3, stride=2, padding=((0, 1), (0, 1))))

    def __call__(self, backend: Backend, x):
        return self.conv(backend, x)


def random_state_dict(shapes: Mapping[str, tuple[int, ...]], seed: int) -> dict[str, np.ndarray]:
    """Seeded stand-in weights in checkpoint layout: PyTorch's default init scale
    (U(-1/sqrt(fan_in), 1/sqrt(fan_in))) for conv/linear, identity for norms, so activations stay
    in a sane range through deep stacks."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        shape = shapes[name]
        module = name.rsplit(".", 1)[0].rsplit(".", 1)[-1]
        is_norm = "norm" in module
        if is_norm and len(shape) == 1:
            out[name] = (np.ones if name.endswith("weight") else np.zeros)(shape, np.float32)
            continue
        weight_name = name[:-len("bias")] + "weight" if name.endswith("bias") else name
        wshape = shapes.get(weight_name, shape)
        fan_in = int(np.prod(wshape[1:])) if len(wshape) > 1 else int(wshape[0])
        bound = 1.0 / np.sqrt(max(1, fan_in))
        out[name] = rng.uniform(-bound, bound, size=shape).astype(np.float32)
    return out
