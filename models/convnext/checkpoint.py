"""ConvNeXt checkpoints: timm-named and Hugging Face (`ConvNextModel` /
`ConvNextForImageClassification`) safetensors. Our parameters carry timm's names; `normalize_keys`
maps Hugging Face names onto them once, at load time. A checkpoint is checked in its own naming
first (`expected_in_own_naming`), so errors name the tensors the user actually has; what a
checkpoint says about the architecture (config.json, its head) settles the config
(`checkpoint_config`)."""
from __future__ import annotations

import dataclasses
import re
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np

from ..nn.weights import RenameRules, WeightsError, rename

if TYPE_CHECKING:
    from .model import ConvNeXtConfig

#: (timm name, Hugging Face name) templates, one pair per module: {0} and {1} stand for block
#: indices (in the same order on both sides), {p} for the Hugging Face prefix (`convnext.` in a
#: classification checkpoint, none in a bare ConvNextModel). A template ending in "." names a
#: module's parameters; any other names one parameter.
_NAME_PAIRS = [
    ("stem.0.", "{p}embeddings.patch_embeddings."),
    ("stem.1.", "{p}embeddings.layernorm."),
    ("stages.{0}.downsample.{1}.", "{p}encoder.stages.{0}.downsampling_layer.{1}."),
    ("stages.{0}.blocks.{1}.conv_dw.", "{p}encoder.stages.{0}.layers.{1}.dwconv."),
    ("stages.{0}.blocks.{1}.norm.", "{p}encoder.stages.{0}.layers.{1}.layernorm."),
    ("stages.{0}.blocks.{1}.mlp.fc1.", "{p}encoder.stages.{0}.layers.{1}.pwconv1."),
    ("stages.{0}.blocks.{1}.mlp.fc2.", "{p}encoder.stages.{0}.layers.{1}.pwconv2."),
    ("stages.{0}.blocks.{1}.gamma", "{p}encoder.stages.{0}.layers.{1}.layer_scale_parameter"),
    ("head.norm.", "{p}layernorm."),
    ("head.fc.", "classifier."),  # the classifier sits beside the `convnext.` sub-model
]
_PLACEHOLDER = re.compile(r"\{(\d)\}")


def _pattern(template: str) -> str:
    parts = _PLACEHOLDER.split(template)  # literal, index, literal, ...
    body = "".join(re.escape(p) if i % 2 == 0 else r"(\d+)" for i, p in enumerate(parts))
    return "^" + body + ("" if template.endswith(".") else "$")


def _replacement(template: str) -> str:
    parts = _PLACEHOLDER.split(template)
    return "".join(p if i % 2 == 0 else f"\\g<{int(p) + 1}>" for i, p in enumerate(parts))


def _rules(naming: str, prefix: str, to_timm: bool) -> RenameRules:
    """Rename rules between timm names and the checkpoint's (none for a timm checkpoint)."""
    if naming == "timm":
        return []
    pairs = [(timm, hf.replace("{p}", prefix)) for timm, hf in _NAME_PAIRS]
    return [(_pattern(hf), _replacement(timm)) if to_timm else (_pattern(timm), _replacement(hf))
            for timm, hf in pairs]


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


def checkpoint_config(cfg: ConvNeXtConfig, tensors: Mapping[str, np.ndarray], file_config: Mapping[str, Any] | None,
                      overrides: Mapping[str, Any] | None, source: str) -> ConvNeXtConfig:
    """The config the weights read from `source` need: the preset's, replaced by what the
    checkpoint's config.json says, then by explicit overrides; the head (1k, 22k classes or none)
    and layer scale as the tensors have them."""
    naming, _ = detect_naming(tensors)
    if file_config is not None:
        model_type = file_config.get("model_type")
        if model_type not in (None, "convnext"):
            raise WeightsError(f"ConvNeXt: {source} holds a {model_type!r} model (config.json model_type), "
                               "not 'convnext'")
        cfg = _config_from_hf(cfg, file_config) if naming == "hf" else _config_from_timm(cfg, file_config)
    if overrides:
        cfg = dataclasses.replace(cfg, **overrides)
    # the head is a property of the checkpoint (1k, 22k or none), not of the preset
    head_key = "head.fc.weight" if naming == "timm" else "classifier.weight"
    num_classes = int(tensors[head_key].shape[0]) if head_key in tensors else 0
    gamma_seen = any(k.endswith(("gamma", "layer_scale_parameter")) for k in tensors)
    layer_scale = cfg.layer_scale if (naming == "hf" and file_config is not None) else gamma_seen
    return dataclasses.replace(cfg, num_classes=num_classes, layer_scale=layer_scale)


def expected_in_own_naming(expected: Mapping[str, tuple[int, ...]],
                           tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[int, ...]]:
    """The model's expected shapes (timm names) under the names `tensors` use."""
    rules = _rules(*detect_naming(tensors), to_timm=False)
    return {rename(k, rules): shape for k, shape in expected.items()}


def normalize_keys(tensors: Mapping[str, np.ndarray], config: ConvNeXtConfig) -> dict[str, np.ndarray]:
    """timm names from a Hugging Face checkpoint (a timm one is kept as it is); a name that fits
    no rule is kept, so the state-dict check reports it. The config does not change the names."""
    rules = _rules(*detect_naming(tensors), to_timm=True)
    return {rename(k, rules): v for k, v in tensors.items()}
