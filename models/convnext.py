"""ConvNeXt image encoder (Liu et al. 2022) on the backend interface, channels-last.

Loads timm-named and Hugging Face (`ConvNextModel` / `ConvNextForImageClassification`)
safetensors checkpoints. Internally every parameter carries its timm name; HF names are
mapped onto those once, at load time, after the checkpoint was checked in its own naming
(so errors name the tensors the user actually has).
"""
from __future__ import annotations

import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from convkernels import Backend

from .weights import WeightsError, check_state_dict, conv_weight_to_channels_last, read_checkpoint

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
RANDOM_SEED = 0


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
            raise ValueError(f"ConvNeXt: depths {self.depths} and dims {self.dims} must have one entry per stage")
        if self.activation not in ("gelu", "gelu_tanh"):
            raise ValueError(f"ConvNeXt: unsupported activation {self.activation!r}")
        if len(self.mean) != self.in_chans or len(self.std) != self.in_chans:
            raise ValueError(f"ConvNeXt: mean/std need {self.in_chans} entries")

    @property
    def min_input_size(self) -> int:
        """Smallest side that leaves at least one pixel in the last stage."""
        return self.patch_size * 2 ** (len(self.depths) - 1)


# ---- parameter names and shapes (PyTorch layouts, timm names) ----------------------------------

def timm_param_shapes(cfg: ConvNeXtConfig) -> dict[str, tuple[int, ...]]:
    d0, p = cfg.dims[0], cfg.patch_size
    shapes: dict[str, tuple[int, ...]] = {
        "stem.0.weight": (d0, cfg.in_chans, p, p), "stem.0.bias": (d0,),
        "stem.1.weight": (d0,), "stem.1.bias": (d0,),
    }
    for i, (depth, dim) in enumerate(zip(cfg.depths, cfg.dims)):
        if i > 0:
            prev = cfg.dims[i - 1]
            shapes.update({f"stages.{i}.downsample.0.weight": (prev,), f"stages.{i}.downsample.0.bias": (prev,),
                           f"stages.{i}.downsample.1.weight": (dim, prev, 2, 2),
                           f"stages.{i}.downsample.1.bias": (dim,)})
        hidden = MLP_RATIO * dim
        for j in range(depth):
            b = f"stages.{i}.blocks.{j}."
            shapes.update({b + "conv_dw.weight": (dim, 1, DW_KERNEL, DW_KERNEL), b + "conv_dw.bias": (dim,),
                           b + "norm.weight": (dim,), b + "norm.bias": (dim,),
                           b + "mlp.fc1.weight": (hidden, dim), b + "mlp.fc1.bias": (hidden,),
                           b + "mlp.fc2.weight": (dim, hidden), b + "mlp.fc2.bias": (dim,)})
            if cfg.layer_scale:
                shapes[b + "gamma"] = (dim,)
    shapes.update({"head.norm.weight": (cfg.dims[-1],), "head.norm.bias": (cfg.dims[-1],)})
    if cfg.num_classes:
        shapes.update({"head.fc.weight": (cfg.num_classes, cfg.dims[-1]), "head.fc.bias": (cfg.num_classes,)})
    return shapes


_HF_RULES = [  # (timm pattern, HF replacement); applied to timm names, first match wins
    (r"^stem\.0\.", "{p}embeddings.patch_embeddings."),
    (r"^stem\.1\.", "{p}embeddings.layernorm."),
    (r"^stages\.(\d+)\.downsample\.(\d)\.", r"{p}encoder.stages.\1.downsampling_layer.\2."),
    (r"^stages\.(\d+)\.blocks\.(\d+)\.conv_dw\.", r"{p}encoder.stages.\1.layers.\2.dwconv."),
    (r"^stages\.(\d+)\.blocks\.(\d+)\.norm\.", r"{p}encoder.stages.\1.layers.\2.layernorm."),
    (r"^stages\.(\d+)\.blocks\.(\d+)\.mlp\.fc1\.", r"{p}encoder.stages.\1.layers.\2.pwconv1."),
    (r"^stages\.(\d+)\.blocks\.(\d+)\.mlp\.fc2\.", r"{p}encoder.stages.\1.layers.\2.pwconv2."),
    (r"^stages\.(\d+)\.blocks\.(\d+)\.gamma$", r"{p}encoder.stages.\1.layers.\2.layer_scale_parameter"),
    (r"^head\.norm\.", "{p}layernorm."),
    (r"^head\.fc\.", "classifier."),  # the classifier sits beside the `convnext.` sub-model
]


def timm_to_hf_name(name: str, prefix: str = "") -> str:
    for pattern, repl in _HF_RULES:
        if re.match(pattern, name):
            return re.sub(pattern, repl.replace("{p}", prefix), name)
    raise KeyError(name)


# ---- checkpoint format detection ---------------------------------------------------------------

@dataclass
class Checkpoint:
    """A checkpoint's tensors renamed to timm names, plus what it told us about itself."""
    tensors: dict[str, np.ndarray]
    naming: str                      # "timm" or "hf"
    config: dict | None = None
    source: str = ""


def detect_naming(keys) -> tuple[str, str]:
    """('timm', '') or ('hf', prefix) from the tensor names."""
    keys = set(keys)
    for prefix in ("convnext.", ""):
        if f"{prefix}embeddings.patch_embeddings.weight" in keys:
            return "hf", prefix
    if any(k.startswith(("stem.", "stages.")) for k in keys):
        return "timm", ""
    sample = ", ".join(sorted(keys)[:6])
    raise WeightsError("ConvNeXt: cannot tell the checkpoint format: expected timm names (stem.0.weight, "
                       "stages.N.blocks.M...) or Hugging Face ConvNext names "
                       f"([convnext.]embeddings.patch_embeddings.weight, ...); found {sample or 'no tensors'}")


def _config_from_hf(cfg: ConvNeXtConfig, hf: Mapping[str, Any]) -> ConvNeXtConfig:
    """The architecture a Hugging Face config.json describes (it wins over the preset: it
    describes these weights exactly)."""
    upd: dict[str, Any] = {}
    if "depths" in hf:
        upd["depths"] = tuple(int(d) for d in hf["depths"])
    if "hidden_sizes" in hf:
        upd["dims"] = tuple(int(d) for d in hf["hidden_sizes"])
    if "num_channels" in hf:
        upd["in_chans"] = int(hf["num_channels"])
    if "patch_size" in hf:
        upd["patch_size"] = int(hf["patch_size"])
    if "layer_norm_eps" in hf:
        upd["head_norm_eps"] = float(hf["layer_norm_eps"])
    if "layer_scale_init_value" in hf:
        upd["layer_scale"] = float(hf["layer_scale_init_value"]) > 0
    if "hidden_act" in hf:
        act = {"gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh"}.get(hf["hidden_act"])
        if act is None:
            raise WeightsError(f"ConvNeXt: unsupported hidden_act {hf['hidden_act']!r} in config.json")
        upd["activation"] = act
    if "image_size" in hf:
        upd["input_size"] = int(hf["image_size"])
    return dataclasses.replace(cfg, **upd)


def _config_from_timm(cfg: ConvNeXtConfig, tc: Mapping[str, Any]) -> ConvNeXtConfig:
    """timm hub config.json: preprocessing lives in pretrained_cfg; the architecture is the preset's."""
    pc = tc.get("pretrained_cfg") or {}
    upd: dict[str, Any] = {}
    if "mean" in pc and "std" in pc:
        upd.update(mean=tuple(float(v) for v in pc["mean"]), std=tuple(float(v) for v in pc["std"]))
    if "input_size" in pc:
        upd["input_size"] = int(pc["input_size"][-1])
    return dataclasses.replace(cfg, **upd)


def labels_from_config(config: Mapping[str, Any] | None, num_classes: int) -> list[str] | None:
    if not config or not num_classes:
        return None
    if "id2label" in config and len(config["id2label"]) == num_classes:
        id2label = {int(k): str(v) for k, v in config["id2label"].items()}
        return [id2label[i] for i in range(num_classes)]
    names = config.get("label_names")  # timm hub configs
    if isinstance(names, list) and len(names) == num_classes:
        return [str(v) for v in names]
    return None


def load_checkpoint(weights: str | os.PathLike, cfg: ConvNeXtConfig,
                    overrides: Mapping[str, Any] | None = None) -> tuple[Checkpoint, ConvNeXtConfig]:
    """Read, detect naming, settle the config (preset < checkpoint config.json < explicit
    overrides), check every tensor (one WeightsError listing all problems, in the checkpoint's
    own names), and rename to timm names."""
    tensors, config = read_checkpoint(weights)
    naming, prefix = detect_naming(tensors)
    if config is not None:
        model_type = config.get("model_type")
        if model_type not in (None, "convnext"):
            raise WeightsError(f"ConvNeXt: {weights} holds a {model_type!r} model (config.json model_type), "
                               "not 'convnext'")
        cfg = _config_from_hf(cfg, config) if naming == "hf" else _config_from_timm(cfg, config)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    # the head is a property of the checkpoint (1k, 22k or none), not of the preset
    head_key = "head.fc.weight" if naming == "timm" else "classifier.weight"
    num_classes = int(tensors[head_key].shape[0]) if head_key in tensors else 0
    gamma_seen = any(k.endswith(("gamma", "layer_scale_parameter")) for k in tensors)
    layer_scale = cfg.layer_scale if (naming == "hf" and config is not None) else gamma_seen
    cfg = dataclasses.replace(cfg, num_classes=num_classes, layer_scale=layer_scale)

    expected = timm_param_shapes(cfg)
    rename = {k: k for k in expected} if naming == "timm" else {timm_to_hf_name(k, prefix): k for k in expected}
    check_state_dict({ck: expected[tk] for ck, tk in rename.items()}, tensors,
                     f"ConvNeXt ({naming} naming) from {weights}")
    renamed = {tk: tensors[ck] for ck, tk in rename.items()}
    return Checkpoint(renamed, naming, config, str(weights)), cfg


def random_state_dict(cfg: ConvNeXtConfig, seed: int = RANDOM_SEED) -> dict[str, np.ndarray]:
    """Seeded init as published: truncated-normal(0.02) weights, zero biases, unit norms,
    layer scale 1e-6."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in timm_param_shapes(cfg).items():
        if name.endswith("gamma"):
            out[name] = np.full(shape, 1e-6, np.float32)
        elif name.endswith("bias"):
            out[name] = np.zeros(shape, np.float32)
        elif len(shape) == 1:
            out[name] = np.ones(shape, np.float32)
        else:
            out[name] = np.clip(rng.standard_normal(shape, dtype=np.float32), -2, 2) * np.float32(0.02)
    return out


# ---- layers ------------------------------------------------------------------------------------

class Stem:
    """4x4 stride-4 patchify conv + LayerNorm. Input normalisation (x - mean) / std is folded
    into the conv: the conv is unpadded, so the fold is exact and saves a pass over the input."""

    def __init__(self, backend: Backend, sd, cfg: ConvNeXtConfig):
        w = sd["stem.0.weight"].astype(np.float64)  # O, I, p, p
        mean = np.asarray(cfg.mean, np.float64)
        std = np.asarray(cfg.std, np.float64)
        w_folded = w / std[None, :, None, None]
        b_folded = sd["stem.0.bias"].astype(np.float64) - np.einsum("oihw,i->o", w_folded, mean)
        self.backend = backend
        self.w = backend.asarray(conv_weight_to_channels_last(w_folded.astype(np.float32)))
        self.b = backend.asarray(b_folded.astype(np.float32))
        self.norm_w = backend.asarray(sd["stem.1.weight"])
        self.norm_b = backend.asarray(sd["stem.1.bias"])
        self.stride = cfg.patch_size
        self.eps = cfg.norm_eps

    def __call__(self, x):
        bk = self.backend
        x = bk.conv2d(x, self.w, self.b, stride=self.stride)
        return bk.layer_norm(x, self.norm_w, self.norm_b, self.eps)


class Downsample:
    """LayerNorm + 2x2 stride-2 conv between stages."""

    def __init__(self, backend: Backend, sd, prefix: str, eps: float):
        self.backend = backend
        self.norm_w = backend.asarray(sd[prefix + "0.weight"])
        self.norm_b = backend.asarray(sd[prefix + "0.bias"])
        self.w = backend.asarray(conv_weight_to_channels_last(sd[prefix + "1.weight"]))
        self.b = backend.asarray(sd[prefix + "1.bias"])
        self.eps = eps

    def __call__(self, x):
        bk = self.backend
        x = bk.layer_norm(x, self.norm_w, self.norm_b, self.eps)
        return bk.conv2d(x, self.w, self.b, stride=2)


class ConvNeXtBlock:
    """dw 7x7 conv -> LayerNorm -> Linear 4x + GELU -> Linear (layer scale folded in) + shortcut."""

    def __init__(self, backend: Backend, sd, prefix: str, cfg: ConvNeXtConfig):
        self.backend = backend
        self.dw_w = backend.asarray(conv_weight_to_channels_last(sd[prefix + "conv_dw.weight"]))
        self.dw_b = backend.asarray(sd[prefix + "conv_dw.bias"])
        self.norm_w = backend.asarray(sd[prefix + "norm.weight"])
        self.norm_b = backend.asarray(sd[prefix + "norm.bias"])
        self.fc1_w = backend.asarray(sd[prefix + "mlp.fc1.weight"])
        self.fc1_b = backend.asarray(sd[prefix + "mlp.fc1.bias"])
        w2 = sd[prefix + "mlp.fc2.weight"].astype(np.float32)
        b2 = sd[prefix + "mlp.fc2.bias"].astype(np.float32)
        gamma = sd.get(prefix + "gamma")
        if gamma is not None:
            # gamma * (h @ W2.T + b2) == h @ (gamma[:, None] * W2).T + gamma * b2: one scale less per call
            w2, b2 = w2 * gamma[:, None], b2 * gamma
        self.fc2_w = backend.asarray(w2)
        self.fc2_b = backend.asarray(b2)
        self.eps = cfg.norm_eps
        self.activation = cfg.activation
        self.channels = int(self.dw_w.shape[0])

    def __call__(self, x):
        bk = self.backend
        # a backend may compute conv + norm in one pass (CUDA: dw_ln, where switched on)
        fused = getattr(bk, "depthwise_conv_layer_norm", None)
        h = None if fused is None else fused(x, self.dw_w, self.dw_b, self.norm_w, self.norm_b, self.eps)
        if h is None:
            h = bk.conv2d(x, self.dw_w, self.dw_b, padding=DW_KERNEL // 2, groups=self.channels)
            h = bk.layer_norm(h, self.norm_w, self.norm_b, self.eps)
        h = bk.linear(h, self.fc1_w, self.fc1_b, activation=self.activation)
        return bk.linear(h, self.fc2_w, self.fc2_b, residual=x)


# ---- the model ---------------------------------------------------------------------------------

class ConvNeXtEncoder:
    """`kind == "image-encoder"` per docs/interfaces.md."""

    kind = "image-encoder"

    def __init__(self, name: str, preset: str, backend: Backend, cfg: ConvNeXtConfig, sd: Mapping[str, np.ndarray],
                 weights_source: str | None, labels: list[str] | None = None, naming: str | None = None):
        self.name = name
        self.preset = preset
        self.backend = backend
        self.config = cfg
        self.weights_source = weights_source
        self.naming = naming
        self.input_size = cfg.input_size
        self.mean = tuple(cfg.mean)
        self.std = tuple(cfg.std)
        self.embed_dim = cfg.dims[-1]
        self.num_classes = cfg.num_classes
        self.labels = labels
        self.stem = Stem(backend, sd, cfg)
        self.stages: list[list] = []
        for i, depth in enumerate(cfg.depths):
            layers: list = [Downsample(backend, sd, f"stages.{i}.downsample.", cfg.norm_eps)] if i > 0 else []
            layers += [ConvNeXtBlock(backend, sd, f"stages.{i}.blocks.{j}.", cfg) for j in range(depth)]
            self.stages.append(layers)
        self.head_norm_w = backend.asarray(sd["head.norm.weight"])
        self.head_norm_b = backend.asarray(sd["head.norm.bias"])
        self.head_eps = cfg.head_norm_eps
        if cfg.num_classes:
            self.fc_w = backend.asarray(sd["head.fc.weight"])
            self.fc_b = backend.asarray(sd["head.fc.bias"])
        else:
            self.fc_w = self.fc_b = None
        # device pixels -> (pooled, logits); a backend may record and replay it (CUDA graphs)
        self._encode_device = backend.graphed(self._forward)

    def _check_pixels(self, pixels) -> np.ndarray:
        x = np.asarray(pixels)
        c = self.config.in_chans
        if x.ndim != 4 or x.shape[-1] != c:
            raise ValueError(f"{self.name}: expected pixels N,H,W,{c} (channels-last, values in [0, 1]), "
                             f"got shape {x.shape}")
        if x.dtype.kind != "f":  # uint8 0..255 would pass silently as 255x too bright
            raise ValueError(f"{self.name}: pixels must be floating point in [0, 1], got dtype {x.dtype}"
                             + (" (divide 8-bit images by 255)" if x.dtype.kind in "iu" else ""))
        m = self.config.min_input_size
        if x.shape[1] < m or x.shape[2] < m:
            raise ValueError(f"{self.name}: image {x.shape[1]}x{x.shape[2]} is smaller than the "
                             f"{m}x{m} minimum ({len(self.config.depths)} stages after a stride-"
                             f"{self.config.patch_size} stem)")
        return x.astype(np.float32, copy=False)

    def features(self, x):
        """Last-stage feature map (N, h, w, embed_dim) on the backend."""
        x = self.stem(x)
        for stage in self.stages:
            for layer in stage:
                x = layer(x)
        return x

    def _forward(self, x):
        bk = self.backend
        feats = self.features(x)
        pooled = bk.layer_norm(bk.mean(feats, (1, 2)), self.head_norm_w, self.head_norm_b, self.head_eps)
        logits = bk.linear(pooled, self.fc_w, self.fc_b) if self.fc_w is not None else None
        return pooled, logits

    def encode(self, pixels_nhwc01: np.ndarray) -> dict:
        bk = self.backend
        pooled, logits = self._encode_device(bk.asarray(self._check_pixels(pixels_nhwc01)))
        bk.synchronize()
        bk.flush_timings()
        return {"embedding": bk.to_host(pooled).astype(np.float32, copy=False),
                "logits": None if logits is None else bk.to_host(logits).astype(np.float32, copy=False)}

    def card(self) -> dict:
        cfg = self.config
        return {
            "name": self.name,
            "kind": self.kind,
            "architecture": "ConvNeXt",
            "preset": self.preset,
            "weights": self.weights_source or "random init",
            "checkpoint_naming": self.naming,
            "backend": self.backend.name,
            "dtype": self.backend.dtype,
            "limits": {"min_input_size": cfg.min_input_size, "input_channels": cfg.in_chans,
                       "input_size": cfg.input_size, "any_input_size": True},
            "config": {"depths": list(cfg.depths), "dims": list(cfg.dims), "patch_size": cfg.patch_size,
                       "embed_dim": self.embed_dim, "num_classes": cfg.num_classes,
                       "has_labels": self.labels is not None, "layer_scale": cfg.layer_scale,
                       "activation": cfg.activation, "head_norm_eps": cfg.head_norm_eps,
                       "mean": list(cfg.mean), "std": list(cfg.std)},
        }


def _clean_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    known = {f.name for f in dataclasses.fields(ConvNeXtConfig)}
    bad = sorted(set(overrides) - known)
    if bad:
        raise ValueError(f"ConvNeXt: unknown overrides {bad}; known: {sorted(known)}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in overrides.items()}


def preset_config(preset: str, **overrides) -> ConvNeXtConfig:
    if preset not in PRESETS:
        raise ValueError(f"unknown ConvNeXt preset {preset!r}; known: {sorted(PRESETS)}")
    p = PRESETS[preset]
    base = {"depths": tuple(p["depths"]), "dims": tuple(p["dims"]), "num_classes": p.get("num_classes", 0),
            "input_size": p.get("input_size", 224)}
    base.update(_clean_overrides(overrides))
    return ConvNeXtConfig(**base)


def build(name: str, preset: str, backend: Backend, weights: str | os.PathLike | None = None,
          **overrides) -> ConvNeXtEncoder:
    """A ConvNeXt encoder from a preset, with weights from an HF folder (config.json +
    model.safetensors), a single timm- or HF-named .safetensors, or None (seeded random init).
    A checkpoint's config.json decides the architecture unless `overrides` say otherwise; the
    checkpoint's head decides num_classes."""
    cfg = preset_config(preset, **overrides)
    if weights is None:
        return ConvNeXtEncoder(name, preset, backend, cfg, random_state_dict(cfg), None, None)
    ckpt, cfg = load_checkpoint(weights, cfg, _clean_overrides(overrides))
    p = PRESETS[preset]
    if (cfg.depths, cfg.dims) != (tuple(p["depths"]), tuple(p["dims"])) and not overrides:
        log.warning("%s: checkpoint %s describes depths %s dims %s, not preset %s's; using the checkpoint's",
                    name, weights, cfg.depths, cfg.dims, preset)
    labels = labels_from_config(ckpt.config, cfg.num_classes)
    return ConvNeXtEncoder(name, preset, backend, cfg, ckpt.tensors, str(Path(weights)), labels, ckpt.naming)
