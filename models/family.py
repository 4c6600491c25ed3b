"""What a model family declares, the options every family takes, and the one way a model is built.

A family is one package under models/ (listed in registry.FAMILIES) whose `FAMILY` is a
`ModelFamily`: the kind of model it builds (models/contract.py), its presets beside the model
they configure, and how its model is made from a preset's config (a diffusers config class and
model class, or a `load` function of its own). `ModelFamily.build` is the one build path: it
refuses an unknown preset and another family's options with a ModelConfigError before the
family's code runs. Callers reach it through `models.load_model` only.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, TypeVar

from .contract import Kind
from .nn.weights import ModelConfigError, diffusers_config


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
    raise ModelConfigError(f"{type(options).__name__} are another family's options; this family takes "
                           f"{cls.__name__} or ModelOptions")


#: load(name, preset, backend, weights: local path | None, options) -> a model of the family's kind,
#: for a family whose checkpoints are not diffusers-shaped; called with a known preset and the
#: family's own options class
Loader = Callable[..., Any]


@dataclass(frozen=True)
class ModelFamily:
    """A family package's declaration, read by models/registry.py.

    A diffusers-shaped family names its checkpoint class, config class and model class: build()
    reads the config (preset, then the checkpoint's config.json, then options.config) with
    models/nn/weights.py's diffusers_config and calls model(name, preset, backend, config, tensors,
    weights_source=, options=). Any other family gives `load` instead."""

    kind: Kind
    #: what messages call the family ("image VAE", "Wan 2.2 VAE")
    title: str
    #: preset name -> the family's config fields for it (PresetInfo.config)
    presets: Mapping[str, Mapping[str, Any]]
    #: preset name -> one line for listings (PresetInfo.description)
    descriptions: Mapping[str, str]
    #: the options class the family takes (ModelOptions, or its own subclass)
    options: type[ModelOptions] = ModelOptions
    #: diffusers-shaped families: the `_class_name` their config.json names, their config class
    #: (a DiffusersConfig) and model class
    checkpoint_class: str | None = None
    config: type | None = None
    model: Callable[..., Any] | None = None
    #: any other family: how its model is made (Loader)
    load: Loader | None = None
    #: a decoder family whose forward runs on row shards (models/nn/row_shard.py) names its
    #: row-split decode here (the service keeps its measured shard rules by this name); None:
    #: the family offers none (an encoder)
    row_sharding: str | None = None

    def __post_init__(self) -> None:
        if (self.load is None) == (self.checkpoint_class is None or self.config is None or self.model is None):
            raise TypeError(f"{self.title}: a family gives either load or checkpoint_class, config and model")

    def build(self, name: str, preset: str, backend, weights: str | None = None,
              options: ModelOptions | None = None):
        """The model `preset` under the serving name `name` on `backend`, from local `weights` (a
        diffusers folder or .safetensors; None = seeded random init) and `options` (ModelOptions or
        the family's own class). An unknown preset, another family's options or a config the family
        refuses raise ModelConfigError; a checkpoint that does not fit raises WeightsError."""
        if preset not in self.presets:
            raise ModelConfigError(f"unknown {self.title} preset {preset!r}; known: {sorted(self.presets)}")
        options = family_options(options, self.options)
        if self.load is not None:
            return self.load(name, preset, backend, weights, options)
        cfg, tensors = diffusers_config(weights, self.checkpoint_class, self.config, self.presets[preset],
                                        options.config)
        return self.model(name, preset, backend, cfg, tensors, weights_source=weights, options=options)
