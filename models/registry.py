"""One place that knows every preset: `load_model` and `PRESETS` of docs/interfaces.md.

Each model family is a package under models/ named in FAMILIES whose `FAMILY` (models/family.py)
declares its kind, its presets (beside the model they configure) and how its model is made;
`ModelFamily.build` is the one build path. Families are imported on first use and a family whose
package is missing (or fails to import) is left out with a warning, so one broken family never
takes the others down.
"""
from __future__ import annotations

import importlib
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Iterator

from convkernels import Backend

from .family import ModelFamily, ModelOptions
from .hub import resolve_weights
from .nn.weights import ModelConfigError

log = logging.getLogger("convserve.models")

#: the family packages under models/, each with its FAMILY declaration (the one list of families)
FAMILIES: tuple[str, ...] = (
    "autoencoder_kl",  # diffusers AutoencoderKL image VAEs (SD, SDXL, FLUX.1)
    "flux2_vae",       # diffusers AutoencoderKLFlux2 image VAE (FLUX.2)
    "wan_vae",         # Wan 2.1 video VAE
    "wan22_vae",       # Wan 2.2 video VAE (TI2V-5B: AutoencoderKLWan is_residual, 48 channels, 16x)
    "qwen_image_vae",  # diffusers AutoencoderKLQwenImage (the Qwen-Image VAE: Wan 2.1's decoder on one frame)
    "convnext",        # ConvNeXt vision encoder
    "taesd",           # diffusers AutoencoderTiny tiny preview VAEs (TAESD, TAESDXL, TAEF1)
    "hunyuanimage_vae",  # diffusers AutoencoderKLHunyuanImage (the HunyuanImage 2.1 VAE, 64 channels, 32x)
    "dc_ae",           # diffusers AutoencoderDC (SANA's deep-compression autoencoder, 32 channels, 32x)
    "ltx2_vae",        # diffusers AutoencoderKLLTX2Video (the LTX-2 video VAE, 128 channels, 32x, 8x time)
    "hunyuanvideo15_vae",  # diffusers AutoencoderKLHunyuanVideo15 (the HunyuanVideo 1.5 VAE, 32 channels, 16x, 4x time)
    "qwen_image21_vae",  # diffusers AutoencoderKLQwenImage21 (the Qwen-Image 2.1 VAE: Wan 2.2's on one frame, 64 ch)
)

TINY_PREFIX = "tiny-"


@dataclass(frozen=True)
class PresetInfo:
    name: str
    kind: str
    family: str  # the models/ package that builds it
    config: dict = field(default_factory=dict)
    description: str = ""

    @property
    def tiny(self) -> bool:
        return self.name.startswith(TINY_PREFIX)


class _Presets(Mapping):
    """Read-only name -> PresetInfo, filled from the family modules on first access."""

    def __init__(self) -> None:
        self._items: dict[str, PresetInfo] | None = None
        self.unavailable: dict[str, str] = {}  # family -> why it is missing

    def _load(self) -> dict[str, PresetInfo]:
        if self._items is not None:
            return self._items
        items: dict[str, PresetInfo] = {}
        for module in FAMILIES:
            family = family_of(module, self.unavailable)
            if family is None:
                continue
            for name, cfg in family.presets.items():
                if name in items:
                    log.warning("preset %r of %s shadows the one of %s", name, module, items[name].family)
                items[name] = PresetInfo(name, family.kind, module, dict(cfg), family.descriptions.get(name, ""))
        self._items = items
        return items

    def __getitem__(self, key: str) -> PresetInfo:
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())

    def __repr__(self) -> str:
        return f"PRESETS({sorted(self._load())})"


def family_of(module: str, unavailable: dict[str, str]) -> ModelFamily | None:
    """The FAMILY of the package models/<module>/, or None (its reason in `unavailable`) when it is missing
    or broken."""
    try:
        family = importlib.import_module(f"{__package__}.{module}").FAMILY
    except ModuleNotFoundError as exc:
        if exc.name != f"{__package__}.{module}":
            unavailable[module] = f"{exc.__class__.__name__}: {exc}"
            log.warning("model family %s is unavailable: %s", module, exc)
        else:
            unavailable[module] = "not installed"
        return None
    except Exception as exc:  # a broken family must not take the others down
        unavailable[module] = f"{exc.__class__.__name__}: {exc}"
        log.warning("model family %s failed to import: %s", module, exc)
        return None
    return family


PRESETS = _Presets()


def load_model(name: str, preset: str, backend: Backend, weights: str | None = None,
               options: ModelOptions | None = None):
    """Build the model `preset` under the serving name `name` on `backend`; `weights` is a
    diffusers/HF model folder, a .safetensors file or a Hub reference `org/name[/subfolder][@revision]`
    (models/hub.py; the model then has `weights_provenance`), None = seeded random init.
    options: ModelOptions (tile_size, seed, config overrides) or the family's own subclass
    (PresetInfo.family's FAMILY.options); None = the family's defaults. An unknown preset, another
    family's options or a config the family refuses raise ModelConfigError (a ValueError); weights
    that do not fit raise WeightsError."""
    if preset not in PRESETS:
        missing = "; ".join(f"{f}: {why}" for f, why in PRESETS.unavailable.items())
        raise ModelConfigError(f"unknown preset {preset!r}; known: {sorted(PRESETS)}"
                               + (f" (families unavailable: {missing})" if missing else ""))
    info = PRESETS[preset]
    build = family_of(info.family, {}).build
    local, hub = resolve_weights(weights)
    model = build(name, preset, backend, local, options)
    model.weights_provenance = None if hub is None else hub.provenance
    if hub is not None:  # the card names the pinned Hub source, not a path inside the cache
        model.weights_source = hub.source
    return model
