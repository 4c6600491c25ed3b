"""convkernels: the convolution kernel layer (op API, path choice, plan cache, kernel metrics)."""
from .backend import Backend
from .metrics import REGISTRY
from .paths import ConvPath, PathChooser
from .registry import get_backend
from .spec import ConvKey, ConvSpec

__all__ = ["Backend", "ConvKey", "ConvPath", "ConvSpec", "PathChooser", "REGISTRY", "get_backend"]
