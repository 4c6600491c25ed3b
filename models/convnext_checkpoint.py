"""ConvNeXt checkpoints: timm-named and Hugging Face (`ConvNextModel` /
`ConvNextForImageClassification`) safetensors. Internally every parameter carries its timm name;
HF names are mapped onto those once, at load time, after the checkpoint was checked in its own
naming (so errors name the tensors the user actually has)."""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import numpy as np

from .weights import RenameRules, WeightsError, check_state_dict, read_checkpoint, rename

if TYPE_CHECKING:
    from .convnext import ConvNeXtConfig

_HF_RULES = [  # (timm pattern, HF replacement; {p}: the HF prefix) for weights.rename, timm -> HF
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


def load_checkpoint(weights: str | os.PathLike, cfg: ConvNeXtConfig, overrides: Mapping[str, Any] | None,
                    shapes: Callable[[ConvNeXtConfig], Mapping[str, tuple[int, ...]]]
                    ) -> tuple[Checkpoint, ConvNeXtConfig]:
    """Read, detect naming, settle the config (preset < checkpoint config.json < explicit
    overrides), check every tensor against `shapes(config)` (one WeightsError listing all
    problems, in the checkpoint's own names), and rename to timm names."""
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

    expected = shapes(cfg)
    rules: RenameRules = [(p, r.replace("{p}", prefix)) for p, r in _HF_RULES] if naming == "hf" else []
    theirs = {rename(k, rules): k for k in expected}
    check_state_dict({ck: expected[tk] for ck, tk in theirs.items()}, tensors,
                     f"ConvNeXt ({naming} naming) from {weights}")
    renamed = {tk: tensors[ck] for ck, tk in theirs.items()}
    return Checkpoint(renamed, naming, config, str(weights)), cfg
