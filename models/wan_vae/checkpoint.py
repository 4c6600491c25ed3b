"""Checkpoint names for the Wan 2.1 VAE: diffusers' AutoencoderKLWan names are ours; the
original Wan release (`Wan2.1_VAE`, also shipped as a single `wan_2.1_vae.safetensors`) uses
the names of Wan's own `WanVAE_` module, which are mapped here, as diffusers'
`convert_wan_vae_to_diffusers` does, but for any depth instead of the 1.3B/14B one.

Original decoder layout: `conv1` (-> conv_in), `middle.{0,1,2}` (resnet, attention, resnet),
`upsamples.{k}` a flat list of per-block resnets followed by that block's resampler,
`head.{0,2}` (norm, conv). Resnets are `residual.{0,2,3,6}` (norm1, conv1, norm2, conv2) plus
`shortcut`. At top level `conv1`/`conv2` are quant_conv/post_quant_conv. The encoder is laid out
the same way, its flat `downsamples.{k}` list kept by diffusers as `down_blocks.{k}` (per block
its resnets, then its downsampler)."""
from __future__ import annotations

import re
from typing import TYPE_CHECKING, Mapping

import numpy as np

from ..nn.weights import RenameRules, rename

if TYPE_CHECKING:
    from .model import WanVAEConfig

#: a key only the original Wan naming has (diffusers detects the format by the same key)
ORIGINAL_MARKER = "decoder.middle.0.residual.0.gamma"

# the parts of one original module, relative to it: (pattern, diffusers replacement)
_RESNET: RenameRules = [(r"residual\.0\.gamma$", "norm1.gamma"), (r"residual\.2\.(weight|bias)$", r"conv1.\1"),
                        (r"residual\.3\.gamma$", "norm2.gamma"), (r"residual\.6\.(weight|bias)$", r"conv2.\1"),
                        (r"shortcut\.(weight|bias)$", r"conv_shortcut.\1")]
_ATTENTION: RenameRules = [(r"(norm\.gamma|(to_qkv|proj)\.(weight|bias))$", r"\1")]
_RESAMPLE: RenameRules = [(r"((resample\.1|time_conv)\.(weight|bias))$", r"\1")]
_TOP: RenameRules = [(r"^conv1\.(weight|bias)$", r"quant_conv.\1"), (r"^conv2\.(weight|bias)$", r"post_quant_conv.\1"),
                     (r"^decoder\.conv1\.(weight|bias)$", r"decoder.conv_in.\1"),
                     (r"^decoder\.head\.0\.gamma$", "decoder.norm_out.gamma"),
                     (r"^decoder\.head\.2\.(weight|bias)$", r"decoder.conv_out.\1")]


def upsample_index_map(num_up_blocks: int, num_res_blocks: int) -> dict[int, str]:
    """Original flat `decoder.upsamples.{k}` index -> diffusers module path."""
    out, k = {}, 0
    for i in range(num_up_blocks):
        for r in range(num_res_blocks + 1):
            out[k] = f"decoder.up_blocks.{i}.resnets.{r}"
            k += 1
        if i != num_up_blocks - 1:
            out[k] = f"decoder.up_blocks.{i}.upsamplers.0"
            k += 1
    return out


def downsample_kinds(num_blocks: int, num_res_blocks: int) -> list[bool]:
    """Per flat encoder `downsamples.{k}` / `down_blocks.{k}` index: True for a resnet, False for a resampler."""
    kinds: list[bool] = []
    for i in range(num_blocks):
        kinds += [True] * num_res_blocks + ([False] if i != num_blocks - 1 else [])
    return kinds


def _within(original: str, diffusers: str, parts: RenameRules) -> RenameRules:
    """`parts` anchored under the original module path, renamed to the diffusers one."""
    return [(f"^{re.escape(original)}\\.{pattern}", f"{diffusers}.{replacement}") for pattern, replacement in parts]


def original_rules(num_up_blocks: int, num_res_blocks: int) -> RenameRules:
    """Every original-Wan name -> its diffusers name (the encoder's too; the decoder ignores
    those); a name that fits no rule is kept as is, so the state dict check reports it as
    unexpected instead of it vanishing."""
    rules = [*_TOP, *_within("decoder.middle.0", "decoder.mid_block.resnets.0", _RESNET),
             *_within("decoder.middle.1", "decoder.mid_block.attentions.0", _ATTENTION),
             *_within("decoder.middle.2", "decoder.mid_block.resnets.1", _RESNET)]
    for k, base in upsample_index_map(num_up_blocks, num_res_blocks).items():
        rules += _within(f"decoder.upsamples.{k}", base, _RESNET if ".resnets." in base else _RESAMPLE)
    rules += [(r"^encoder\.conv1\.(weight|bias)$", r"encoder.conv_in.\1"),
              (r"^encoder\.head\.0\.gamma$", "encoder.norm_out.gamma"),
              (r"^encoder\.head\.2\.(weight|bias)$", r"encoder.conv_out.\1"),
              *_within("encoder.middle.0", "encoder.mid_block.resnets.0", _RESNET),
              *_within("encoder.middle.1", "encoder.mid_block.attentions.0", _ATTENTION),
              *_within("encoder.middle.2", "encoder.mid_block.resnets.1", _RESNET)]
    for k, resnet in enumerate(downsample_kinds(num_up_blocks, num_res_blocks)):
        rules += _within(f"encoder.downsamples.{k}", f"encoder.down_blocks.{k}", _RESNET if resnet else _RESAMPLE)
    return rules


def _without_pipeline_prefix(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A whole-pipeline export's `vae.` prefix dropped."""
    if tensors and all(k.startswith("vae.") for k in tensors):
        return {k[len("vae."):]: v for k, v in tensors.items()}
    return dict(tensors)


def checkpoint_naming(tensors: Mapping[str, np.ndarray]) -> str:
    """Which naming a checkpoint uses: 'diffusers' or 'original-wan'."""
    return "original-wan" if ORIGINAL_MARKER in _without_pipeline_prefix(tensors) else "diffusers"


def normalize_keys(tensors: Mapping[str, np.ndarray], config: WanVAEConfig) -> dict[str, np.ndarray]:
    """diffusers names from any supported export (checkpoint_naming); a whole-pipeline export's
    `vae.` prefix is dropped first. The config's depth maps the original flat upsample list."""
    tensors = _without_pipeline_prefix(tensors)
    if checkpoint_naming(tensors) == "original-wan":
        rules = original_rules(len(config.dim_mult), config.num_res_blocks)
        return {rename(k, rules): v for k, v in tensors.items()}
    return tensors
