"""convkernels: the convolution kernel layer (op API, path choice, plan cache, kernel metrics).

`Backend` is the typed contract (protocol.py) models and the service are written against;
`BackendBase` (backend.py) is the class the numpy, mlx and cuda backends extend to implement it."""
from .backend import BackendBase
from .host import pixels_to_uint8
from .metrics import REGISTRY
from .paths import ConvPath, PathChooser
from .protocol import Backend, Graphed
from .registry import get_backend
from .spec import ConvKey, ConvSpec
from .tensor_ops import ShuffledResidual

__all__ = ["Backend", "BackendBase", "ConvKey", "ConvPath", "ConvSpec", "Graphed", "PathChooser", "REGISTRY",
           "ShuffledResidual", "get_backend", "pixels_to_uint8"]
