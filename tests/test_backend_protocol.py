"""The typed Backend contract (convkernels/protocol.py) and the backends that implement it agree:
every member the protocol names exists on each backend with the same parameters (names, kinds,
defaults), so a model typed against the protocol calls what the backends really take."""
from __future__ import annotations

import importlib.util
import inspect

import pytest

from convkernels import Backend, BackendBase, get_backend


def protocol_members() -> list[str]:
    return sorted(n for n in dir(Backend) if not n.startswith("_") and n not in dir(object))


def params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def backend_classes() -> list[type]:
    classes = [type(get_backend("numpy"))]
    if importlib.util.find_spec("mlx") is not None:
        from convkernels.backends.mlx_backend import MlxBackend
        classes.append(MlxBackend)
    if importlib.util.find_spec("cupy") is not None and importlib.util.find_spec("cudnn") is not None:
        from convkernels.backends.cuda_backend import CudaBackend
        classes.append(CudaBackend)
    return classes


def test_the_protocol_lists_the_op_set_models_use():
    members = protocol_members()
    for op in ("conv2d", "conv3d", "group_norm", "attention", "linear", "upsample_conv2d", "graphed",
               "asarray", "to_host", "describe"):
        assert op in members
    assert "conv_paths" not in members  # implementers' hooks are not part of the contract


@pytest.mark.parametrize("cls", [BackendBase, *backend_classes()], ids=lambda c: c.__name__)
def test_every_backend_takes_what_the_protocol_says(cls):
    for name in protocol_members():
        theirs = getattr(cls, name, None)
        assert theirs is not None, f"{cls.__name__} lacks {name}"
        ours = getattr(Backend, name)
        if isinstance(ours, property):
            assert isinstance(theirs, property), name
        elif callable(ours):
            assert params(theirs) == params(ours), f"{cls.__name__}.{name}"


def test_a_live_backend_is_an_instance_of_the_protocol():
    be = get_backend("numpy")
    assert isinstance(be, Backend)
    assert not isinstance(object(), Backend)


@pytest.mark.parametrize("cls", backend_classes(), ids=lambda c: c.__name__)
def test_before_conv_sees_every_conv_and_its_error_is_the_convs(cls):
    """The documented seam for wrapping convs: every conv op calls it first with (x, w, spec),
    and what it raises is the conv's error (the service's fault injection relies on both)."""
    import numpy as np

    be = get_backend({"NumpyBackend": "numpy", "MlxBackend": "mlx", "CudaBackend": "cuda"}[cls.__name__])
    rng = np.random.default_rng()
    seen = []
    be.before_conv = lambda x, w, spec: seen.append((tuple(x.shape), tuple(w.shape), spec.nd, spec.transpose))
    x2 = be.asarray(rng.standard_normal((1, 7, 5, 3)).astype(np.float32))
    x3 = be.asarray(rng.standard_normal((1, 3, 5, 4, 3)).astype(np.float32))
    be.conv2d(x2, be.asarray(rng.standard_normal((4, 3, 3, 3)).astype(np.float32)), padding=1)
    be.conv3d(x3, be.asarray(rng.standard_normal((2, 3, 3, 3, 3)).astype(np.float32)), padding=1)
    be.conv_transpose2d(x2, be.asarray(rng.standard_normal((5, 4, 4, 3)).astype(np.float32)), stride=2, padding=1)
    assert seen == [((1, 7, 5, 3), (4, 3, 3, 3), 2, False), ((1, 3, 5, 4, 3), (2, 3, 3, 3, 3), 3, False),
                    ((1, 7, 5, 3), (5, 4, 4, 3), 2, True)]

    def refuse(x, w, spec):
        raise MemoryError("refused by the hook")

    be.before_conv = refuse
    with pytest.raises(MemoryError, match="refused by the hook"):
        be.conv2d(x2, be.asarray(rng.standard_normal((4, 3, 3, 3)).astype(np.float32)))
    be.before_conv = None
    assert be.conv2d(x2, be.asarray(rng.standard_normal((4, 1, 1, 3)).astype(np.float32))).shape == (1, 7, 5, 4)
