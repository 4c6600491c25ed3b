"""Checkpoint names for the Wan 2.1 VAE: diffusers' AutoencoderKLWan names are ours; the
original Wan release (`Wan2.1_VAE`, also shipped as a single `wan_2.1_vae.safetensors`) uses
the names of Wan's own `WanVAE_` module, which are mapped here, as diffusers'
`convert_wan_vae_to_diffusers` does, but for any decoder depth instead of the 1.3B/14B one.

Original decoder layout: `conv1` (-> conv_in), `middle.{0,1,2}` (resnet, attention, resnet),
`upsamples.{k}` a flat list of per-block resnets followed by that block's resampler,
`head.{0,2}` (norm, conv). Resnets are `residual.{0,2,3,6}` (norm1, conv1, norm2, conv2) plus
`shortcut`. At top level `conv1`/`conv2` are quant_conv/post_quant_conv."""
from __future__ import annotations

import re
from typing import Mapping

import numpy as np

#: a key only the original Wan naming has (diffusers detects the format by the same key)
ORIGINAL_MARKER = "decoder.middle.0.residual.0.gamma"

_RESNET_PARTS = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight",
                 "residual.2.bias": "conv1.bias", "residual.3.gamma": "norm2.gamma",
                 "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
                 "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
_TOP = {"conv1.weight": "quant_conv.weight", "conv1.bias": "quant_conv.bias",
        "conv2.weight": "post_quant_conv.weight", "conv2.bias": "post_quant_conv.bias",
        "decoder.conv1.weight": "decoder.conv_in.weight", "decoder.conv1.bias": "decoder.conv_in.bias",
        "decoder.head.0.gamma": "decoder.norm_out.gamma", "decoder.head.2.weight": "decoder.conv_out.weight",
        "decoder.head.2.bias": "decoder.conv_out.bias"}


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


def original_to_diffusers(tensors: Mapping[str, np.ndarray], num_up_blocks: int,
                          num_res_blocks: int) -> dict[str, np.ndarray]:
    """Rename an original-Wan state dict to diffusers names. Encoder tensors keep their
    names (the decoder ignores them); a name that fits no rule is kept as is, so the state
    dict check reports it as unexpected instead of it vanishing."""
    ups = upsample_index_map(num_up_blocks, num_res_blocks)
    out: dict[str, np.ndarray] = {}
    for key, value in tensors.items():
        out[_rename(key, ups)] = value
    return out


def _rename(key: str, ups: dict[int, str]) -> str:
    if key in _TOP:
        return _TOP[key]
    m = re.fullmatch(r"decoder\.middle\.([02])\.(.+)", key)
    if m and m.group(2) in _RESNET_PARTS:
        return f"decoder.mid_block.resnets.{int(m.group(1)) // 2}.{_RESNET_PARTS[m.group(2)]}"
    m = re.fullmatch(r"decoder\.middle\.1\.(norm\.gamma|to_qkv\.weight|to_qkv\.bias|proj\.weight|proj\.bias)", key)
    if m:
        return f"decoder.mid_block.attentions.0.{m.group(1)}"
    m = re.fullmatch(r"decoder\.upsamples\.(\d+)\.(.+)", key)
    if m and int(m.group(1)) in ups:
        base, part = ups[int(m.group(1))], m.group(2)
        if ".resnets." in base and part in _RESNET_PARTS:
            return f"{base}.{_RESNET_PARTS[part]}"
        if ".upsamplers." in base and re.fullmatch(r"(resample\.1|time_conv)\.(weight|bias)", part):
            return f"{base}.{part}"
    return key


def normalize_keys(tensors: Mapping[str, np.ndarray], num_up_blocks: int,
                   num_res_blocks: int) -> tuple[dict[str, np.ndarray], str]:
    """diffusers names from any supported export, and which naming it was: 'diffusers',
    'original-wan'. A whole-pipeline export's `vae.` prefix is dropped first."""
    tensors = dict(tensors)
    if tensors and all(k.startswith("vae.") for k in tensors):
        tensors = {k[len("vae."):]: v for k, v in tensors.items()}
    if ORIGINAL_MARKER in tensors:
        return original_to_diffusers(tensors, num_up_blocks, num_res_blocks), "original-wan"
    return tensors, "diffusers"
