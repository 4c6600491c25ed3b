"""What a model family module declares, and the options every family's builder takes.

A family is one module under models/ (listed in registry.FAMILIES) whose `FAMILY` is a
`ModelFamily`: the kind of model it builds (models/contract.py), its presets beside the model
they configure, and its builder. Callers reach it through `models.load_model` only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from .contract import Kind


@dataclass(frozen=True)
class ModelOptions:
    """What a caller may set when a model is built, beside its name, preset, backend and weights.

    Each family reads the fields that apply to it (encoders do not tile: they ignore tile_size).
    A family with settings of its own extends this class (AutoencoderKLOptions, WanVAEOptions)
    and accepts either its own class or this one.
    """

    #: output pixels per tile side (the service's CONVSERVE_TILE_SIZE): each decoder family turns
    #: it into its own tile settings; None = the family's default tiles
    tile_size: int | None = None
    #: random init (no weights given): the seed of the stand-in weights
    seed: int = 0
    #: architecture overrides: fields of the family's config (the checkpoint's config.json, then
    #: these, replace the preset's); an unknown field is refused by the family
    config: Mapping[str, Any] = field(default_factory=dict)


Options = TypeVar("Options", bound=ModelOptions)


def family_options(options: ModelOptions | None, cls: type[Options]) -> Options:
    """`options` as the family's own options class `cls`: the plain ModelOptions fields carry
    over; another family's options are refused (their settings would be silently ignored)."""
    if options is None:
        return cls()
    if isinstance(options, cls):
        return options
    if type(options) is ModelOptions:
        return cls(**{f.name: getattr(options, f.name) for f in dataclasses.fields(ModelOptions)})
    raise ValueError(f"{type(options).__name__} are another family's options; this family takes "
                     f"{cls.__name__} or ModelOptions")


#: build(name, preset, backend, weights: local path | None, options) -> a model of the family's kind
Builder = Callable[..., Any]


@dataclass(frozen=True)
class ModelFamily:
    """A family module's declaration, read by models/registry.py."""

    kind: Kind
    #: preset name -> the family's config fields for it (PresetInfo.config)
    presets: Mapping[str, Mapping[str, Any]]
    #: preset name -> one line for listings (PresetInfo.description)
    descriptions: Mapping[str, str]
    build: Builder
    #: the options class its builder takes (ModelOptions, or its own subclass)
    options: type[ModelOptions] = ModelOptions
