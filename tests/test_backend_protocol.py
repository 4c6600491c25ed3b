"""The typed Backend contract (convkernels/protocol.py) and the backends that implement it agree:
every member the protocol names exists on each backend (the optional capabilities through
BackendBase's defaults), methods with the same parameters (names, kinds, defaults), so a model
typed against the protocol calls what the backends really take and never needs a getattr probe."""
from __future__ import annotations

import importlib.util
import inspect
import types

import pytest

from convkernels import Backend, BackendBase, get_backend


def protocol_members() -> list[str]:
    """Methods, properties and annotated attributes (name, dtype, ..., attention_chunk)."""
    names = {n for n in dir(Backend) if not n.startswith("_") and n not in dir(object)}
    return sorted(names | set(Backend.__annotations__))


def protocol_callables() -> list[str]:
    return [n for n in protocol_members() if n not in Backend.__annotations__]


def params(fn) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in inspect.signature(fn).parameters.values()]


def class_gaps(cls) -> list[str]:
    """What `cls` lacks or takes differently from the protocol's methods and properties."""
    gaps = []
    for name in protocol_callables():
        theirs, ours = getattr(cls, name, None), getattr(Backend, name)
        if theirs is None:
            gaps.append(f"lacks {name}")
        elif isinstance(ours, property):
            if not isinstance(theirs, property):
                gaps.append(f"{name} is not a property")
        elif params(theirs) != params(ours):
            gaps.append(f"{name} takes {params(theirs)}, the protocol says {params(ours)}")
    return gaps


def instance_gaps(be) -> list[str]:
    """The members a live backend lacks (attributes set by its constructor included)."""
    return [f"lacks {n}" for n in protocol_members() if not hasattr(be, n)]


def backend_names() -> list[str]:
    names = ["numpy"]
    if importlib.util.find_spec("mlx") is not None:
        names.append("mlx")
    if importlib.util.find_spec("cupy") is not None and importlib.util.find_spec("cudnn") is not None:
        from convkernels.registry import cuda_status
        if cuda_status()[0]:
            names.append("cuda")
    return names


def backend_classes() -> list[type]:
    classes = [type(get_backend("numpy"))]
    if importlib.util.find_spec("mlx") is not None:
        from convkernels.backends.mlx.backend import MlxBackend
        classes.append(MlxBackend)
    if importlib.util.find_spec("cupy") is not None and importlib.util.find_spec("cudnn") is not None:
        from convkernels.backends.cuda.backend import CudaBackend
        classes.append(CudaBackend)
    return classes


def test_the_protocol_lists_what_models_use():
    members = protocol_members()
    for op in ("conv2d", "conv3d", "group_norm", "attention", "linear", "upsample_conv2d", "graphed",
               "asarray", "to_host", "describe", "work_memory_budget",
               # the optional capabilities models use, with BackendBase defaults
               "runs_ahead", "unfold_limit_bytes", "attention_chunk", "attention_score_bytes",
               "depthwise_conv_layer_norm"):
        assert op in members
    assert "conv_paths" not in members and "_run" not in members  # implementers' hooks are not the contract


@pytest.mark.parametrize("cls", [BackendBase, *backend_classes()], ids=lambda c: c.__name__)
def test_every_backend_takes_what_the_protocol_says(cls):
    assert class_gaps(cls) == []


@pytest.mark.parametrize("name", backend_names())
def test_every_live_backend_has_every_member(name):
    be = get_backend(name)
    assert instance_gaps(be) == []
    assert isinstance(be, Backend)


def test_a_missing_or_different_member_fails_the_checks():
    """The checks themselves: a class without one protocol method, one whose conv2d takes other
    parameters, and a live backend without one optional capability are each caught."""
    methods = {n: getattr(BackendBase, n) for n in protocol_callables()}
    lacking = type("Lacking", (), {n: m for n, m in methods.items() if n != "depthwise_conv_layer_norm"})
    assert class_gaps(lacking) == ["lacks depthwise_conv_layer_norm"]

    def conv2d(self, x, w, bias=None, *, stride=1, padding=0):
        raise NotImplementedError

    different = type("Different", (), {**methods, "conv2d": conv2d})
    assert [g.split(" takes")[0] for g in class_gaps(different)] == ["conv2d"]
    be = get_backend("numpy")
    partial = types.SimpleNamespace(**{n: getattr(be, n) for n in protocol_members() if n != "attention_chunk"})
    assert instance_gaps(partial) == ["lacks attention_chunk"]
    assert not isinstance(partial, Backend)


def test_optional_capabilities_default_to_not_offered():
    """BackendBase answers every optional member with "not offered": no unfold bound, no
    attention chunk, no running ahead; no fused op and no recording (the numpy backend offers
    neither, so it shows the inherited defaults)."""
    assert (BackendBase.runs_ahead, BackendBase.unfold_limit_bytes, BackendBase.attention_chunk,
            BackendBase.attention_score_bytes) == (False, None, None, None)
    be = get_backend("numpy")
    assert be.depthwise_conv_layer_norm(None, None, None, None, None, 1e-6) is None
    step = be.graphed(lambda x: x + 1)
    assert step(1) == 2 and step.records(1) is False
    assert be.calls_to_warm == 1


def test_a_live_backend_is_an_instance_of_the_protocol():
    be = get_backend("numpy")
    assert isinstance(be, Backend)
    assert not isinstance(object(), Backend)


@pytest.mark.parametrize("name", backend_names())
def test_before_conv_sees_every_conv_and_its_error_is_the_convs(name):
    """The documented seam for wrapping convs: every conv op calls it first with (x, w, spec),
    and what it raises is the conv's error (the service's fault injection relies on both)."""
    import numpy as np

    be = get_backend(name)
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
