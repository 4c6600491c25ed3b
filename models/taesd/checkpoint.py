"""Checkpoint names for the TAESD family: diffusers' AutoencoderTiny names are ours
(`decoder.layers.{i}...`, `encoder.layers.{i}...`); madebyollin's original files are renamed onto them.

The original `taesd_decoder.safetensors` / `taesd_encoder.safetensors` (and taesdxl_, taef1_) are
bare nn.Sequential state dicts: `{i}.weight`, `{i}.conv.{0,2,4}.weight`. The encoder's indices are
diffusers' EncoderTiny's; the original decoder starts with its tanh clamp as a layer of its own,
so its indices are one more than DecoderTiny's. madebyollin's Hub repositories hold those files
beside the diffusers checkpoint, and a Hub download fetches every .safetensors file: where the
diffusers names are present, the original-named copies of the same weights are dropped.
"""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..nn.weights import RenameRules, rename

if TYPE_CHECKING:
    from .model import AutoencoderTinyConfig

_ORIGINAL = re.compile(r"^\d+\.")
_DIFFUSERS_PREFIXES = ("decoder.layers.", "encoder.layers.")

_ORIGINAL_ENCODER: RenameRules = [(r"^(\d+)\.", r"encoder.layers.\1.")]
_ORIGINAL_DECODER: RenameRules = [(r"^(\d+)\.", lambda m: f"decoder.layers.{int(m[1]) - 1}.")]


def checkpoint_naming(tensors: Mapping[str, np.ndarray]) -> str:
    """'diffusers', 'original-encoder', 'original-decoder' or 'unknown'. The original encoder's
    first layer is a conv at index 0; the original decoder's index 0 is its parameter-free clamp."""
    keys = list(tensors)
    if any(k.startswith(_DIFFUSERS_PREFIXES) for k in keys):
        return "diffusers"
    if keys and all(_ORIGINAL.match(k) for k in keys):
        return "original-encoder" if "0.weight" in tensors else "original-decoder"
    return "unknown"


def normalize_keys(tensors: Mapping[str, np.ndarray], config: AutoencoderTinyConfig) -> dict[str, np.ndarray]:
    """diffusers names from an original single-half file; original-named duplicates dropped
    beside a diffusers checkpoint. Other names are kept, for the state-dict check to report."""
    naming = checkpoint_naming(tensors)
    if naming == "diffusers":
        return {k: v for k, v in tensors.items() if not _ORIGINAL.match(k)}
    table = {"original-encoder": _ORIGINAL_ENCODER, "original-decoder": _ORIGINAL_DECODER}.get(naming)
    if table is None:
        return dict(tensors)
    return {rename(k, table): v for k, v in tensors.items()}
