"""convserve models: image VAEs, the Wan video VAE and ConvNeXt, written on the backend
interface. Public API (docs/interfaces.md): `load_model`, `PRESETS`, `ModelOptions`."""
from .family import ModelOptions
from .registry import PRESETS, PresetInfo, load_model
from .weights import WeightsError

__all__ = ["PRESETS", "ModelOptions", "PresetInfo", "WeightsError", "load_model"]
