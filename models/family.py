"""What a model family module declares.

A family is one module under models/ (listed in registry.FAMILIES) whose `FAMILY` is a
`ModelFamily`: the kind of model it builds (models/contract.py), its presets beside the model
they configure, and its builder. Callers reach it through `models.load_model` only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping

from .contract import Kind

#: build(name, preset, backend, weights: local path | None, **overrides) -> a model of the family's kind
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
