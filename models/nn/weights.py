"""Checkpoint reading: safetensors only (never pickle), with one clear error summarising every
missing, unexpected or mis-shaped tensor and saying what the checkpoint looks like."""
from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np


class WeightsError(ValueError):
    """A checkpoint does not fit the model; the message counts every problem and names the first few."""


class ModelConfigError(ValueError):
    """A model cannot be built as asked: an unknown preset, another family's options, an unknown
    config field or a config the family does not support. The message names the preset or field
    and the choices."""


_ST_DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": "bf16",
              "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U8": np.uint8,
              "BOOL": np.bool_}


def read_safetensors(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """All tensors of a .safetensors file; floating tensors come back as float32 (bf16/fp16
    upcast) or float64. The file is parsed here (the format is a JSON header + raw bytes) so
    bf16, which numpy lacks, loads too, and a lying header gives a clear error."""
    path = Path(path)
    if path.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"):
        raise WeightsError(f"{path}: pickle checkpoints are refused; convert to .safetensors")
    if not path.is_file():
        raise WeightsError(f"{path}: no such weights file")
    data = np.memmap(path, dtype=np.uint8, mode="r") if path.stat().st_size else np.zeros(0, np.uint8)
    if data.size < 8:
        raise WeightsError(f"{path}: not a safetensors file (too short)")
    header_len = int(np.frombuffer(data[:8].tobytes(), "<u8")[0])
    if header_len > data.size - 8 or header_len > 100 * 1024 * 1024:
        raise WeightsError(f"{path}: not a safetensors file (header length {header_len} exceeds the file)")
    try:
        header = json.loads(data[8:8 + header_len].tobytes())
    except ValueError as exc:
        raise WeightsError(f"{path}: not a safetensors file (bad header: {exc})") from exc
    base = 8 + header_len
    out: dict[str, np.ndarray] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            begin, end = (int(v) for v in info["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WeightsError(f"{path}: tensor {name}: bad header entry {info!r}") from exc
        itemsize = 2 if dtype == "bf16" else np.dtype(dtype).itemsize
        count = int(np.prod(shape, dtype=np.int64)) if shape else 1
        if not (0 <= begin <= end <= data.size - base) or end - begin != count * itemsize:
            raise WeightsError(f"{path}: tensor {name}: offsets {begin}..{end} do not fit shape {shape} "
                               f"of {info['dtype']} in a file of {data.size} bytes (truncated or corrupt)")
        raw = data[base + begin:base + end]
        if dtype == "bf16":
            arr = (np.frombuffer(raw.tobytes(), "<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            arr = np.frombuffer(raw.tobytes(), np.dtype(dtype).newbyteorder("<")).astype(dtype)
            if arr.dtype == np.float16:
                arr = arr.astype(np.float32)
        out[name] = arr.reshape(shape)
    return out


def read_checkpoint(path: str | os.PathLike) -> tuple[dict[str, np.ndarray], dict | None]:
    """A diffusers/HF model folder (config.json + *.safetensors) or a single .safetensors file.
    Returns (tensors, config or None)."""
    path = Path(path)
    if path.is_dir():
        cfg_file = path / "config.json"
        config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else None
        files = sorted(path.glob("*.safetensors"))
        if not files:
            pickles = [p.name for p in path.iterdir() if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]
            hint = f" (found pickle files {pickles}: convert them to safetensors)" if pickles else ""
            raise WeightsError(f"{path}: no .safetensors file{hint}")
        tensors: dict[str, np.ndarray] = {}
        for f in files:
            tensors.update(read_safetensors(f))
        return tensors, config
    return read_safetensors(path), None


class DiffusersConfig:
    """from_dict / as_dict of a frozen dataclass of config.json fields (lists there, tuples here);
    from_dict keeps only the fields and runs the subclass's validate()."""

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        cfg = cls(**{k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names})
        cfg.validate()
        return cfg

    def as_dict(self) -> dict:
        return {k: (list(v) if isinstance(v, tuple) else v) for k, v in dataclasses.asdict(self).items()}


def diffusers_config(weights: str | os.PathLike | None, class_name: str, cfg_cls, preset_cfg: Mapping,
                     overrides: Mapping[str, Any]):
    """-> (config, tensors or None) for a diffusers model class: the preset's config, replaced by
    the checkpoint's config.json (which must name `class_name`), then by `overrides` (config
    fields; anything else is refused)."""
    fields = {f.name for f in dataclasses.fields(cfg_cls)}
    unknown = sorted(k for k in overrides if k not in fields)
    if unknown:
        raise ModelConfigError(f"unknown {class_name} overrides {unknown}; config fields: {sorted(fields)}")
    cfg_dict, tensors = dict(preset_cfg), None
    if weights is not None:
        tensors, file_cfg = read_checkpoint(weights)
        if file_cfg is not None:
            cls = file_cfg.get("_class_name")
            if cls not in (None, class_name):
                raise WeightsError(f"{weights}: config.json is for {cls}, not {class_name}")
            cfg_dict.update({k: v for k, v in file_cfg.items() if k in fields})
    cfg_dict.update(overrides)
    return cfg_cls.from_dict(cfg_dict), tensors


#: names shown per kind of problem; the counts are always complete
SHOWN = 4


def _first(names: list[str], n: int = SHOWN) -> str:
    more = f", ... and {len(names) - n} more" if len(names) > n else ""
    return ", ".join(names[:n]) + more


def checkpoint_family(keys) -> str | None:
    """What a state dict's names say it is (a model's expected names or a checkpoint's):
    'convnext', 'vae' (diffusers naming), 'ldm-vae' (original Stable Diffusion naming), 'flux2-vae'
    (a VAE with FLUX.2's BatchNorm latent statistics, `bn.*`), 'wan22-vae' (the Wan 2.2 VAE's residual
    up blocks, `decoder.up_blocks.*.upsampler.*`), 'sd-pipeline' (a whole original SD
    checkpoint), 'taesd' (diffusers AutoencoderTiny), or None when nothing fits."""
    keys = list(keys)
    has = lambda *prefixes: any(k.startswith(prefixes) for k in keys)  # noqa: E731
    if has("model.diffusion_model.", "first_stage_model.", "cond_stage_model."):
        return "sd-pipeline"
    if has("convnext.", "embeddings.", "stem.", "stages.", "encoder.stages.") or \
            any(".dwconv." in k or ".pwconv1." in k for k in keys):
        return "convnext"
    if has("decoder.layers.", "encoder.layers."):  # diffusers AutoencoderTiny's flat layer lists
        return "taesd"
    if has("encoder.", "decoder.", "quant_conv.", "post_quant_conv."):
        if has("bn.running_mean", "bn.running_var"):
            return "flux2-vae"
        if has("decoder.up.", "decoder.mid.", "encoder.down."):
            return "ldm-vae"
        if any(k.startswith("decoder.up_blocks.") and ".upsampler." in k for k in keys):
            return "wan22-vae"  # AutoencoderKLWan is_residual: Wan 2.1's blocks say `upsamplers.0`
        return "vae"
    return None


_FAMILY_TEXT = {"convnext": "a ConvNeXt checkpoint", "vae": "a VAE checkpoint (diffusers naming)",
                "taesd": "a TAESD tiny VAE checkpoint (diffusers AutoencoderTiny)",
                "ldm-vae": "a VAE in the original Stable Diffusion (ldm) naming, not diffusers'",
                "flux2-vae": "a FLUX.2 VAE checkpoint (its BatchNorm latent statistics, bn.*)",
                "wan22-vae": "a Wan 2.2 VAE checkpoint (AutoencoderKLWan is_residual: decoder.up_blocks.*.upsampler.*)",
                "sd-pipeline": "a whole original Stable Diffusion checkpoint (UNet, text encoder and VAE)"}
_FAMILY_FIX = {"convnext": "serve it with a ConvNeXt preset (tiny-convnext, convnext-tiny, convnext-base)",
               "taesd": "serve it with a TAESD preset (taesd, taesdxl, taef1, tiny-taesd)",
               "vae": "serve it with a VAE preset of its kind (sd-vae, sdxl-vae, flux-vae, flux2-vae, wan2.1-vae, wan2.2-vae, ...)",
               "flux2-vae": "serve it with a FLUX.2 VAE preset (flux2-vae, tiny-flux2-vae)",
               "wan22-vae": "serve it with a Wan 2.2 VAE preset (wan2.2-vae, tiny-wan2.2-vae)",
               "ldm-vae": "use the diffusers-format VAE (the `vae` folder of a diffusers repository) or convert it",
               "sd-pipeline": "serve the diffusers repository's `vae` folder (org/name/vae) instead"}


def _hint(expected: Mapping[str, tuple[int, ...]], given: Mapping[str, np.ndarray],
          missing: list[str], unexpected: list[str], misshaped: list[str]) -> str:
    """What the checkpoint looks like and the likely fix, from its names and shapes."""
    want, have = checkpoint_family(expected), checkpoint_family(given)
    if have is not None and have != want:
        looks = f"this looks like {_FAMILY_TEXT[have]}"
        if want is not None and (want == "convnext") != (have == "convnext"):
            return f"{looks}, but the model is a {'ConvNeXt' if want == 'convnext' else 'VAE'}: {_FAMILY_FIX[have]}"
        return f"{looks}: {_FAMILY_FIX[have]}"
    if misshaped and not missing and not unexpected:
        return ("every tensor is there but some have other shapes: the checkpoint is a model of another size; a "
                "bare .safetensors file carries no config, so serve the diffusers/HF folder with its config.json "
                "(or pass the preset whose size matches)")
    if misshaped and len(misshaped) >= len(missing) + len(unexpected):
        return ("most differences are shapes: the checkpoint is probably a model of another size or variant; serve "
                "the diffusers/HF folder with its config.json")
    if missing and unexpected:
        return "the names differ: the checkpoint is another architecture or naming than this preset's"
    if missing:
        return "the checkpoint is incomplete (or a part of another model, e.g. an encoder only)"
    return "the checkpoint holds more than this model uses"


def check_state_dict(expected: Mapping[str, tuple[int, ...]], given: Mapping[str, np.ndarray],
                     what: str, ignore_unexpected: tuple[str, ...] = ()) -> None:
    """Raise one WeightsError summarising every missing, unexpected and mis-shaped tensor: the
    counts, the first few names of each, what the checkpoint looks like and the likely fix, in
    about a kilobyte (a listing of every name ran to 16 KB and hid the point)."""
    missing = sorted(k for k in expected if k not in given)
    unexpected = sorted(k for k in given if k not in expected and not k.startswith(ignore_unexpected))
    misshaped = sorted(k for k in expected if k in given and tuple(given[k].shape) != tuple(expected[k]))
    bad_values = sorted(k for k in expected if k in given and given[k].dtype.kind == "f"
                        and not np.isfinite(given[k]).all())
    if missing or unexpected or misshaped or bad_values:
        parts = []
        if missing:
            parts.append(f"missing ({len(missing)}): {_first(missing)}")
        if unexpected:
            parts.append(f"unexpected ({len(unexpected)}): {_first(unexpected)}")
        if misshaped:
            shown = [f"{k}: checkpoint {tuple(given[k].shape)} vs model {tuple(expected[k])}"
                     for k in misshaped[:SHOWN - 1]]
            more = f"; ... and {len(misshaped) - len(shown)} more" if len(misshaped) > len(shown) else ""
            parts.append(f"mis-shaped ({len(misshaped)}): {'; '.join(shown)}{more}")
        if bad_values:
            parts.append(f"non-finite values ({len(bad_values)}) in: {_first(bad_values)}")
        hint = _hint(expected, given, missing, unexpected, misshaped) if (missing or unexpected or misshaped) \
            else "the checkpoint holds NaN or Inf: it is corrupt or was saved from a diverged run"
        raise WeightsError(f"{what}: checkpoint does not fit the model ({len(given)} tensors in the checkpoint, "
                           f"{len(expected)} in the model) — " + " | ".join(parts) + f". Hint: {hint}")


#: (pattern, replacement) as re.sub takes them; patterns anchor themselves (^, $)
RenameRules = Sequence[tuple[str, "str | Callable[[re.Match], str]"]]


def rename(key: str, *tables: RenameRules) -> str:
    """`key` rewritten by the first rule of each table that matches it, table after table; a
    key no rule fits is kept, so the state-dict check reports it instead of it vanishing."""
    for rules in tables:
        for pattern, replacement in rules:
            new, hits = re.subn(pattern, replacement, key, count=1)
            if hits:
                key = new
                break
    return key


def conv_weight_to_channels_last(w: np.ndarray) -> np.ndarray:
    """PyTorch conv weight O,I/g,*k -> ours O,*k,I/g."""
    return np.ascontiguousarray(np.moveaxis(w, 1, -1))


def fold_output_affine(tensors: Mapping[str, np.ndarray], conv: str, scale: float, shift: float) -> dict[str, np.ndarray]:
    """The checkpoint with `scale * conv(x) + shift` folded into the final conv named `conv`, so a
    decoder writes image space ([0, 1] after a clip) directly: the host then clips in place
    instead of two more passes over every output pixel (1.2 ms of a 7 ms SD-VAE 512 decode on
    the H100). Exact in any float format: scale is a power of two. Tiled decodes blend tiles with
    weights that sum to one, which commutes with the affine map."""
    out = dict(tensors)
    if f"{conv}.weight" not in out or f"{conv}.bias" not in out:
        return out  # a checkpoint that does not fit: check_state_dict names what is missing
    out[f"{conv}.weight"] = np.asarray(tensors[f"{conv}.weight"], np.float32) * np.float32(scale)
    out[f"{conv}.bias"] = np.asarray(tensors[f"{conv}.bias"], np.float32) * np.float32(scale) + np.float32(shift)
    return out
