"""convserve models: image VAEs, the Wan video VAE and ConvNeXt, written on the backend
interface. Public API (docs/interfaces.md): `load_model`, `PRESETS`, `ModelOptions`.

models/nn/ holds what the families share (the module base, layers, weights, tiling); each family is
a package (models/<family>/) declared in models/registry.py's FAMILIES."""
from .family import ModelOptions
from .nn.weights import ModelConfigError, WeightsError
from .registry import PRESETS, PresetInfo, load_model

__all__ = ["PRESETS", "ModelConfigError", "ModelOptions", "PresetInfo", "WeightsError", "load_model"]
