"""convserve models: image VAEs, the Wan video VAE and ConvNeXt, written on the backend
interface. Public API (docs/interfaces.md): `load_model`, `PRESETS`, `ModelOptions`.

models/nn/ holds what the families share (the module base, layers, weights, tiling); each family is
a package (models/<family>/) declared in models/registry.py's FAMILIES.

The public names load on first use: a service front end imports `models.contract` alone (the
model kinds and their views) and must not pay for the registry, the weights code and the hub."""
from __future__ import annotations

import importlib

_PUBLIC = {"ModelOptions": ".family", "ModelConfigError": ".nn.weights", "WeightsError": ".nn.weights",
           "PRESETS": ".registry", "PresetInfo": ".registry", "load_model": ".registry"}

__all__ = sorted(_PUBLIC)


def __getattr__(name: str):
    if name not in _PUBLIC:
        raise AttributeError(f"module 'models' has no attribute {name!r}")
    return getattr(importlib.import_module(_PUBLIC[name], __name__), name)
