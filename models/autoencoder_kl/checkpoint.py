"""Checkpoint names for the image VAE: diffusers' AutoencoderKL names are ours; other exports
are renamed onto them here, by rule tables (weights.rename).

Original LDM / CompVis names (the single-file SD VAEs, also inside a whole SD checkpoint under
`first_stage_model.`): `{encoder,decoder}.down.{i}.block.{j}`, `.downsample`, `up.{i}...` (the
decoder's up.{i} runs from the highest resolution, so diffusers' up_blocks reverse it),
`mid.block_{1,2}`, `mid.attn_1.{norm,q,k,v,proj_out}`, `norm_out`, resnet `nin_shortcut`.
Legacy diffusers attention names: `query`, `key`, `value`, `proj_attn`."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..nn.weights import RenameRules, rename

if TYPE_CHECKING:
    from .config import AutoencoderKLConfig

_CHECKPOINT_PREFIXES = ("vae.", "first_stage_model.")
_LDM_RE = re.compile(r"^(encoder|decoder)\.(down|up|mid|norm_out)")

_LDM_SHORTCUT: RenameRules = [(r"^(.+\.resnets\.-?\d+\.)nin_shortcut\.", r"\1conv_shortcut.")]

_LEGACY_ATTENTION: RenameRules = [
    (rf"^(.*\.attentions\.\d+)\.{old}\.(weight|bias)$", rf"\1.{new}.\2")
    for old, new in (("query", "to_q"), ("key", "to_k"), ("value", "to_v"), ("proj_attn", "to_out.0"))]

_ATTENTION_PROJECTION = re.compile(r"\.attentions\.\d+\.(to_q|to_k|to_v|to_out\.0)\.weight$")


def _ldm_rules(n_blocks: int) -> RenameRules:
    def up(m: re.Match) -> str:
        return f"{m[1]}.up_blocks.{n_blocks - 1 - int(m[2])}."

    return [
        (r"^([^.]+)\.down\.(\d+)\.block\.(\d+)\.", r"\1.down_blocks.\2.resnets.\3."),
        (r"^([^.]+)\.down\.(\d+)\.downsample\.", r"\1.down_blocks.\2.downsamplers.0."),
        (r"^([^.]+)\.up\.(\d+)\.block\.(\d+)\.", lambda m: f"{up(m)}resnets.{m[3]}."),
        (r"^([^.]+)\.up\.(\d+)\.upsample\.", lambda m: f"{up(m)}upsamplers.0."),
        (r"^([^.]+)\.mid\.block_(\d)\.", lambda m: f"{m[1]}.mid_block.resnets.{int(m[2]) - 1}."),
        (r"^([^.]+)\.mid\.attn_1\.norm\.(weight|bias)$", r"\1.mid_block.attentions.0.group_norm.\2"),
        (r"^([^.]+)\.mid\.attn_1\.([qkv])\.(weight|bias)$", r"\1.mid_block.attentions.0.to_\2.\3"),
        (r"^([^.]+)\.mid\.attn_1\.proj_out\.(weight|bias)$", r"\1.mid_block.attentions.0.to_out.0.\2"),
        (r"^([^.]+)\.norm_out\.", r"\1.conv_norm_out."),
    ]


def normalize_keys(tensors: Mapping[str, np.ndarray], config: AutoencoderKLConfig) -> dict[str, np.ndarray]:
    """diffusers names from other exports: original LDM/CompVis names (a whole SD checkpoint's
    other parts are dropped), legacy diffusers attention names, 1x1-conv attention projections
    (C, C, 1, 1) and a whole-pipeline `vae.` prefix. The config's block count orders LDM's up blocks."""
    n_blocks = len(config.block_out_channels)
    keys = list(tensors)
    strip = next((p for p in _CHECKPOINT_PREFIXES if any(k.startswith(p) for k in keys)), "")
    if strip == "vae." and not all(k.startswith(strip) for k in keys):
        strip = ""  # only a wholesale prefix; a stray "vae." key is reported as unexpected
    is_ldm = any(_LDM_RE.match(k[len(strip):]) for k in keys if k.startswith(strip))
    tables = (_ldm_rules(n_blocks), _LDM_SHORTCUT, _LEGACY_ATTENTION) if is_ldm else (_LEGACY_ATTENTION,)
    out: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        if not key.startswith(strip):
            continue
        key = rename(key[len(strip):], *tables)
        if _ATTENTION_PROJECTION.search(key) and value.ndim in (3, 4) and all(d == 1 for d in value.shape[2:]):
            value = value.reshape(value.shape[:2])
        out[key] = value
    return out
