"""ConvNeXt image encoder (Liu et al. 2022) on the backend interface, channels-last: the ConvNeXt
family's presets, config, layers, model and `load` (its `FAMILY` is in the package's __init__.py).
Its parameters carry timm's names; checkpoint.py reads timm- and Hugging Face-named checkpoints onto them.
"""
from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from convkernels import Backend

from ..contract import IMAGE_ENCODER, card_fields
from ..family import ModelOptions
from ..nn.layers import Conv2d, LayerNorm, Linear
from ..nn.module import Module, random_state_dict
from ..nn.weights import ModelConfigError, check_state_dict, conv_weight_to_channels_last, read_checkpoint
from .checkpoint import checkpoint_config, detect_naming, expected_in_own_naming, labels_from_config, normalize_keys

log = logging.getLogger("convserve.models")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)

PRESETS: dict[str, dict] = {
    "convnext-tiny": {"depths": (3, 3, 9, 3), "dims": (96, 192, 384, 768), "num_classes": 1000, "input_size": 224},
    "convnext-base": {"depths": (3, 3, 27, 3), "dims": (128, 256, 512, 1024), "num_classes": 1000,
                      "input_size": 224},
    # small enough to encode a 64x64 image in a few ms on 2 CPU cores (tests, demos)
    "tiny-convnext": {"depths": (1, 1, 2, 1), "dims": (16, 32, 48, 64), "num_classes": 10, "input_size": 64},
}

DESCRIPTIONS = {
    "convnext-tiny": "ConvNeXt-T (28M params) image encoder, ImageNet-1k head unless the checkpoint says otherwise",
    "convnext-base": "ConvNeXt-B (89M params) image encoder, ImageNet-1k head unless the checkpoint says otherwise",
    "tiny-convnext": "tiny ConvNeXt (4 stages, 16-64 channels) for tests and CPU demos",
}

DW_KERNEL = 7
MLP_RATIO = 4


@dataclass(frozen=True)
class ConvNeXtConfig:
    depths: tuple[int, ...]
    dims: tuple[int, ...]
    num_classes: int = 0
    in_chans: int = 3
    patch_size: int = 4
    layer_scale: bool = True
    norm_eps: float = 1e-6       # stem, downsample and block norms (fixed in both codebases)
    head_norm_eps: float = 1e-6  # timm: 1e-6; HF: config.layer_norm_eps (1e-12 by default)
    activation: str = "gelu"
    input_size: int = 224
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD

    def __post_init__(self):
        if len(self.depths) != len(self.dims) or not self.depths:
            raise ModelConfigError(f"ConvNeXt: depths {self.depths} and dims {self.dims} must have one entry per stage")
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ModelConfigError(f"ConvNeXt: unsupported activation {self.activation!r}")
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ModelConfigError(f"ConvNeXt: mean/std need {self.in_chans} entries")

    @property
    def min_input_size(self) -> int:
        """Smallest side that leaves at least one pixel in the last stage."""
        return self.patch_size * 2 ** (len(self.depths) - 1)


#: random init as published: truncated-normal(0.02) weights, zero biases, unit norms, layer scale 1e-6
INIT_RULES = ((r"gamma$", "layer_scale"), (r"bias$", "zeros"), (r"(norm|stem\.1|downsample\.0)\.weight$", "ones"),
              ("", "trunc_normal"))


# ---- layers (timm's module tree: its parameter names are ours) ---------------------------------

def folds_input_norm(dtype: str) -> bool:
    """Whether the stem takes (x - mean) / std into its conv. Not in bfloat16: raw pixels carry
    the mean, so the folded conv adds and cancels terms ~20x its unfolded bias, each rounded to
    8 bits. PyTorch's own bf16 ConvNeXt with the fold had 1.27x (embedding) and 1.35x (logits)
    its unfolded error, up to 1.6x, over 8 random-weight seeds (2026-11-25); ours was 1.5-1.7x
    PyTorch's on the H100. There the host normalises in float32 first, as PyTorch users do."""
    return dtype != "bfloat16"


class Stem(Module):
    """4x4 stride-4 patchify conv + LayerNorm. Input normalisation (x - mean) / std is folded
    into the conv (folds_input_norm): the conv is unpadded, so the fold is exact and saves a pass
    over the input. 8-bit pixels (0..255, widened on the device) take a second copy of the folded
    weights with the 1/255 folded in too: (x / 255 - mean) / std = x * (1 / (255 std)) - mean / std."""

    def __init__(self, cfg: ConvNeXtConfig, fold_input: bool = True):
        super().__init__()
        self.conv = self.add("0", Conv2d(cfg.in_chans, cfg.dims[0], cfg.patch_size, stride=cfg.patch_size))
        self.norm = self.add("1", LayerNorm(cfg.dims[0], cfg.norm_eps))
        self.mean, self.std = cfg.mean, cfg.std
        self.fold_input = fold_input
        self.weight_uint8 = None  # the conv's weight for 0..255 input (fold_input only)

    def derive(self, tensors, prefix):
        if not self.fold_input:
            return
        w = tensors[prefix + "0.weight"].astype(np.float64)  # O, I, p, p
        mean = np.asarray(self.mean, np.float64)
        std = np.asarray(self.std, np.float64)
        w_folded = w / std[None, :, None, None]
        b_folded = tensors[prefix + "0.bias"].astype(np.float64) - np.einsum("oihw,i->o", w_folded, mean)
        self.conv.weight = self.backend.asarray(conv_weight_to_channels_last(w_folded.astype(np.float32)))
        self.conv.bias = self.backend.asarray(b_folded.astype(np.float32))
        self.weight_uint8 = self.backend.asarray(conv_weight_to_channels_last((w_folded / 255.0).astype(np.float32)))

    def __call__(self, x, uint8: bool = False):
        """uint8: x holds 8-bit pixel values 0..255 (in the compute dtype), not [0, 1]."""
        if not uint8:
            return self.norm(self.conv(x))
        c = self.conv
        return self.norm(self.backend.conv2d(x, self.weight_uint8, c.bias, stride=c.stride, padding=c.padding,
                                             groups=c.groups))


class Downsample(Module):
    """LayerNorm + 2x2 stride-2 conv between stages."""

    def __init__(self, cin: int, cout: int, eps: float):
        super().__init__()
        self.norm = self.add("0", LayerNorm(cin, eps))
        self.conv = self.add("1", Conv2d(cin, cout, 2, stride=2))

    def __call__(self, x):
        return self.conv(self.norm(x))


class ConvNeXtBlock(Module):
    """dw 7x7 conv -> LayerNorm -> Linear 4x + GELU -> Linear (layer scale folded in) + shortcut."""

    def __init__(self, dim: int, cfg: ConvNeXtConfig):
        super().__init__()
        self.dim, self.layer_scale, self.activation = dim, cfg.layer_scale, cfg.activation
        self.conv_dw = self.add("conv_dw", Conv2d(dim, dim, DW_KERNEL, padding=DW_KERNEL // 2, groups=dim))
        self.norm = self.add("norm", LayerNorm(dim, cfg.norm_eps))
        self.fc1 = self.add("mlp.fc1", Linear(dim, MLP_RATIO * dim))
        self.fc2 = self.add("mlp.fc2", Linear(MLP_RATIO * dim, dim))
        self.gamma = None

    def param_shapes(self):
        return {"gamma": (self.dim,)} if self.layer_scale else {}

    def derive(self, tensors, prefix):
        if self.layer_scale:
            # gamma * (h @ W2.T + b2) == h @ (gamma[:, None] * W2).T + gamma * b2: one scale less per call
            gamma = tensors[prefix + "gamma"]
            w2 = tensors[prefix + "mlp.fc2.weight"].astype(np.float32)
            b2 = tensors[prefix + "mlp.fc2.bias"].astype(np.float32)
            self.fc2.weight = self.backend.asarray(w2 * gamma[:, None])
            self.fc2.bias = self.backend.asarray(b2 * gamma)

    def body(self) -> tuple:
        """the block's parameters as a backend's depthwise_ln_mlp takes them"""
        dw, norm, fc1, fc2 = self.conv_dw, self.norm, self.fc1, self.fc2
        return dw.weight, dw.bias, norm.weight, norm.bias, fc1.weight, fc1.bias, fc2.weight, fc2.bias

    def __call__(self, x):
        return run_blocks([self], x)

    def run_alone(self, x):
        """the block as its ops, where the backend does not run it as one op"""
        dw, norm, backend = self.conv_dw, self.norm, self.backend
        # a backend may compute conv + norm in one pass (CUDA: dw_ln, where switched on)
        h = backend.depthwise_conv_layer_norm(x, dw.weight, dw.bias, norm.weight, norm.bias, norm.eps)
        if h is None:
            h = norm(dw(x))
        # a backend may run both products in one op (NumPy: in blocks of rows whose hidden
        # activations stay in cache)
        out = backend.mlp(h, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.activation, x)
        if out is not None:
            return out
        h = self.fc1(h, activation=self.activation)
        return self.fc2(h, residual=x)


def run_blocks(blocks: list[ConvNeXtBlock], x):
    """A stage's blocks (one shape, one config) in order. A backend may run them all in one op
    (NumPy: one compiled call a stage; the Python between per-block calls cost ~5 % of a batch-1
    encode on a 2-core CPU), else each block runs as its ops."""
    if not blocks:
        return x
    first = blocks[0]
    out = first.backend.depthwise_ln_mlp(x, [b.body() for b in blocks], first.norm.eps, first.activation)
    if out is not None:
        return out
    for block in blocks:
        x = block.run_alone(x)
    return x


class ConvNeXtNet(Module):
    """stem, stages of [downsample,] blocks, head: pooled LayerNorm embedding and optional classifier."""

    def __init__(self, cfg: ConvNeXtConfig, fold_input: bool = True):
        super().__init__()
        self.stem = self.add("stem", Stem(cfg, fold_input))
        #: per stage: its downsample (None in the first) and its blocks
        self.stages: list[tuple[Module | None, list[ConvNeXtBlock]]] = []
        for i, (depth, dim) in enumerate(zip(cfg.depths, cfg.dims)):
            down = self.add(f"stages.{i}.downsample", Downsample(cfg.dims[i - 1], dim, cfg.norm_eps)) if i else None
            blocks = [self.add(f"stages.{i}.blocks.{j}", ConvNeXtBlock(dim, cfg)) for j in range(depth)]
            self.stages.append((down, blocks))
        self.head_norm = self.add("head.norm", LayerNorm(cfg.dims[-1], cfg.head_norm_eps))
        self.head_fc = self.add("head.fc", Linear(cfg.dims[-1], cfg.num_classes)) if cfg.num_classes else None

    def features(self, x, uint8: bool = False):
        x = self.stem(x, uint8)
        for down, blocks in self.stages:
            if down is not None:
                x = down(x)
            x = run_blocks(blocks, x)
        return x

    def __call__(self, x, uint8: bool = False):
        """-> (pooled embedding, logits or None); uint8: x holds 0..255 (a folded stem only)"""
        pooled = self.head_norm(self.backend.mean(self.features(x, uint8), (1, 2)))
        return pooled, None if self.head_fc is None else self.head_fc(pooled)


def expected_shapes(cfg: ConvNeXtConfig) -> dict[str, tuple[int, ...]]:
    return ConvNeXtNet(cfg).expected_shapes()


# ---- the model ---------------------------------------------------------------------------------

class ConvNeXtEncoder:
    """`kind == "image-encoder"` per docs/interfaces.md."""

    kind = IMAGE_ENCODER
    #: Hub weights only; load_model sets it (models/contract.py)
    weights_provenance: dict | None = None

    def __init__(self, name: str, preset: str, backend: Backend, cfg: ConvNeXtConfig, sd: Mapping[str, np.ndarray],
                 weights_source: str | None, labels: list[str] | None = None, naming: str | None = None):
        self.name, self.preset, self.backend, self.config = name, preset, backend, cfg
        self.weights_source, self.naming, self.labels = weights_source, naming, labels
        self.input_size, self.embed_dim, self.num_classes = cfg.input_size, cfg.dims[-1], cfg.num_classes
        self.mean, self.std = tuple(cfg.mean), tuple(cfg.std)
        self.tree = ConvNeXtNet(cfg, fold_input=folds_input_norm(backend.dtype))
        self.tree.load(sd, backend)  # a checkpoint was checked in its own naming (see build)
        # device pixels -> (pooled, logits); a backend may record and replay it (CUDA graphs)
        self._encode_device = backend.graphed(self._forward)
        # the same for 8-bit pixels (0..255 on the device), through the stem's uint8 weights
        self._encode_device_uint8 = backend.graphed(self._forward_uint8)

    def _check_pixels(self, pixels) -> np.ndarray:
        x = np.asarray(pixels)
        c = self.config.in_chans
        if x.ndim != 4 or x.shape[-1] != c:
            raise ValueError(f"{self.name}: expected pixels N,H,W,{c} (channels-last, values in [0, 1]), "
                             f"got shape {x.shape}")
        if x.dtype.kind != "f" and x.dtype != np.uint8:  # other integers: which scale would be a guess
            raise ValueError(f"{self.name}: pixels must be floating point in [0, 1] or uint8 0..255, "
                             f"got dtype {x.dtype}")
        m = self.config.min_input_size
        if x.shape[1] < m or x.shape[2] < m:
            raise ValueError(f"{self.name}: image {x.shape[1]}x{x.shape[2]} is smaller than the "
                             f"{m}x{m} minimum ({len(self.config.depths)} stages after a stride-"
                             f"{self.config.patch_size} stem)")
        return x if x.dtype == np.uint8 else x.astype(np.float32, copy=False)

    def _host_input(self, pixels) -> np.ndarray:
        """Checked pixels, normalised here in float32 where the stem does not fold it (uint8
        pixels are then scaled by 1/255 here too); uint8 pixels stay uint8 where it does."""
        x = self._check_pixels(pixels)
        if self.tree.stem.fold_input:
            return x
        if x.dtype == np.uint8:
            x = x.astype(np.float32) / np.float32(255.0)
        return (x - np.float32(self.mean)) / np.float32(self.std)

    def _forward(self, x):
        return self.tree(x)

    def _forward_uint8(self, x):
        return self.tree(x, uint8=True)

    def encode(self, pixels_nhwc01: np.ndarray) -> dict:
        """pixels N,H,W,3: floating in [0, 1], or uint8 0..255, which cross to the device as bytes
        and are widened there; the 1/255 is folded into the stem with mean/std (a bfloat16 backend,
        whose stem folds nothing, normalises them on the host in float32 as it does floats)."""
        bk = self.backend
        x = self._host_input(pixels_nhwc01)
        forward = self._encode_device_uint8 if x.dtype == np.uint8 else self._encode_device
        pooled, logits = forward(bk.asarray(x))
        bk.synchronize()
        bk.flush_timings()
        return {"embedding": bk.to_host(pooled).astype(np.float32, copy=False),
                "logits": None if logits is None else bk.to_host(logits).astype(np.float32, copy=False)}

    def encode_started(self, pixels_nhwc01: np.ndarray) -> "StartedEncode":
        """encode's work queued on the device, its results on their way to the host: `.result()`
        gives what encode returns (the same values). The caller may queue the next batch before
        it waits (the service's batcher does, where the backend runs ahead). The outputs are
        copied out of the forward's buffers before the next forward is queued, so a replayed
        graph can reuse them at once."""
        bk = self.backend
        if isinstance(pixels_nhwc01, np.ndarray):
            x = self._host_input(pixels_nhwc01)
            forward = self._encode_device_uint8 if x.dtype == np.uint8 else self._encode_device
            x = bk.asarray(x)
        else:  # a device array: uint8 pixels gathered there by the service (takes_device_pixels)
            forward, x = self._encode_device_uint8, bk.astype(pixels_nhwc01, bk.dtype)
        pooled, logits = forward(x)
        return StartedEncode(bk, bk.to_host_async(pooled), None if logits is None else bk.to_host_async(logits))

    @property
    def takes_device_pixels(self) -> bool:
        """encode_started also takes uint8 N,H,W,C pixels already on the device (checked by their
        sender: the service's front ends): where the stem folds the normalisation into its weights."""
        return bool(self.tree.stem.fold_input)

    def card(self) -> dict:
        cfg = self.config
        return card_fields(
            self, "ConvNeXt", weights=self.weights_source or "random init", checkpoint_naming=self.naming,
            limits={"min_input_size": cfg.min_input_size, "input_channels": cfg.in_chans,
                    "input_size": cfg.input_size, "any_input_size": True},
            config={"depths": list(cfg.depths), "dims": list(cfg.dims), "patch_size": cfg.patch_size,
                    "embed_dim": self.embed_dim, "num_classes": cfg.num_classes,
                    "has_labels": self.labels is not None, "layer_scale": cfg.layer_scale,
                    "activation": cfg.activation, "head_norm_eps": cfg.head_norm_eps,
                    "mean": list(cfg.mean), "std": list(cfg.std)})


class StartedEncode:
    """ConvNeXtEncoder.encode_started's handle: the embeddings (and logits) on their way to the host."""

    def __init__(self, backend, pooled, logits):
        self.backend, self.pooled, self.logits = backend, pooled, logits

    def result(self) -> dict:
        embedding = self.pooled.result()
        logits = None if self.logits is None else self.logits.result()
        self.backend.flush_timings()  # the events are complete now: this does not wait on the device
        return {"embedding": np.asarray(embedding, np.float32),
                "logits": None if logits is None else np.asarray(logits, np.float32)}


def _clean_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(ConvNeXtConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ModelConfigError(f"ConvNeXt: unknown overrides {bad}; known: {sorted(known)}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}


def preset_config(preset: str, overrides: Mapping[str, Any] | None = None) -> ConvNeXtConfig:
    if preset not in PRESETS:
        raise ModelConfigError(f"unknown ConvNeXt preset {preset!r}; known: {sorted(PRESETS)}")
    p = PRESETS[preset]
    base = {"depths": tuple(p["depths"]), "dims": tuple(p["dims"]), "num_classes": p.get("num_classes", 0),
            "input_size": p.get("input_size", 224)}
    base.update(_clean_overrides(overrides or {}))
    return ConvNeXtConfig(**base)


def load(name: str, preset: str, backend: Backend, weights: str | os.PathLike | None,
         options: ModelOptions) -> ConvNeXtEncoder:
    """The family's Loader (models/family.py; FAMILY.build calls it with a known preset): a
    ConvNeXt encoder from a preset, with weights from an HF folder (config.json +
    model.safetensors), a single timm- or HF-named .safetensors, or None (seeded random init).
    A checkpoint's config.json decides the architecture unless `options.config` says otherwise;
    the checkpoint's head decides num_classes. An encoder does not tile: tile_size is ignored."""
    overrides = options.config
    cfg = preset_config(preset, overrides)
    if weights is None:
        sd = random_state_dict(expected_shapes(cfg), options.seed, INIT_RULES)
        return ConvNeXtEncoder(name, preset, backend, cfg, sd, None, None)
    tensors, file_config = read_checkpoint(weights)
    naming, _ = detect_naming(tensors)
    cfg = checkpoint_config(cfg, tensors, file_config, _clean_overrides(overrides), str(weights))
    # checked in the checkpoint's own naming: the error names the tensors the user has
    check_state_dict(expected_in_own_naming(expected_shapes(cfg), tensors), tensors,
                     f"ConvNeXt ({naming} naming) from {weights}")
    p = PRESETS[preset]
    if (cfg.depths, cfg.dims) != (tuple(p["depths"]), tuple(p["dims"])) and not overrides:
        log.warning("%s: checkpoint %s describes depths %s dims %s, not preset %s's; using the checkpoint's",
                    name, weights, cfg.depths, cfg.dims, preset)
    labels = labels_from_config(file_config, cfg.num_classes)
    return ConvNeXtEncoder(name, preset, backend, cfg, normalize_keys(tensors, cfg), str(Path(weights)), labels,
                           naming)
