"""The one module base of every model: a tree of named parameters.

Parameters are named and shaped as in the PyTorch checkpoint, so a tree knows its whole
expected state dict and one `check_state_dict` call can name every problem of a bad checkpoint
before anything is converted. Loading converts each tensor once, on the host (channels-last,
folds), and hands it to the backend in its dtype; forward passes then use backend ops only.
"""
from __future__ import annotations

import re
from typing import Callable, Iterator, Mapping, Sequence

import numpy as np

from convkernels import Backend

from .weights import check_state_dict


class Module:
    """Own parameters (`param_shapes`, stored as attributes of the same name by `load`) plus
    named children; a child's name may be dotted ("to_out.0") to follow the checkpoint's
    nesting without empty container nodes."""

    #: the backend the parameters live on, set by load(); every layer runs its ops on it, so a
    #: forward call carries only activations (and, in the Wan decoder, the feature cache)
    backend: Backend
    #: False: this subtree's weight transforms (prepare) wait for its first call. An autoencoder's
    #: encoder: many deployments only decode, and Winograd's panels take 4x a 3x3 conv's weights
    #: (SD-VAE's encoder: about 0.5 GB that a decode-only server would hold for nothing)
    prepared_at_load: bool = True

    def __init__(self) -> None:
        self.children: dict[str, Module] = {}

    def param_shapes(self) -> dict[str, tuple[int, ...]]:
        """Own parameters: checkpoint name (relative) -> PyTorch shape."""
        return {}

    def convert(self, name: str, host: np.ndarray) -> np.ndarray:
        """Checkpoint layout -> ours, on the host, once at load."""
        return host

    def derive(self, tensors: Mapping[str, np.ndarray], prefix: str) -> None:
        """Hook: parameters computed from several checkpoint tensors (folds), run once the
        whole subtree has its parameters."""

    def add(self, name: str, child: "Module") -> "Module":
        self.children[name] = child
        return child

    def walk(self, prefix: str = "") -> Iterator[tuple[str, "Module"]]:
        yield prefix, self
        for name, child in self.children.items():
            yield from child.walk(f"{prefix}{name}.")

    def expected_shapes(self, prefix: str = "") -> dict[str, tuple[int, ...]]:
        return {p + k: shape for p, module in self.walk(prefix) for k, shape in module.param_shapes().items()}

    def load(self, tensors: Mapping[str, np.ndarray], backend: Backend, prefix: str = "") -> None:
        """Take this subtree's tensors, which must already fit (see load_checked)."""
        tree = list(self.walk(prefix))
        for p, module in tree:
            module.backend = backend
            for k in module.param_shapes():
                setattr(module, k, backend.asarray(module.convert(k, np.asarray(tensors[p + k]))))
        for p, module in tree:
            module.derive(tensors, p)
        self.prepare_tree()

    def prepare_tree(self) -> None:
        """prepare() for this module and every child, but not below one whose `prepared_at_load` is False."""
        if self.prepared_at_load:
            self.prepare()
            for child in self.children.values():
                child.prepare_tree()

    def prepare(self) -> None:
        """Hook, once the weights are final: hand the backend the weights it transforms before their
        first use (BackendBase.prepare_conv / prepare_linear), so that the first request does not
        pay the transform (an SD-VAE 256 decode's first call on two CPU cores, 2026-11-29: ~1.5 s of
        3.7, the steady call 1.6)."""

    def load_checked(self, tensors: Mapping[str, np.ndarray], backend: Backend, what: str,
                     ignore_unexpected: tuple[str, ...] = ()) -> None:
        """Strict load: one WeightsError naming every missing, unexpected or mis-shaped tensor."""
        check_state_dict(self.expected_shapes(), tensors, what, ignore_unexpected)
        self.load(tensors, backend)


# ---- seeded random init ------------------------------------------------------------------------
def _uniform(rng: np.random.Generator, shape, fan_in: int) -> np.ndarray:
    bound = 1.0 / np.sqrt(max(1, fan_in))  # PyTorch's default conv/linear init scale
    return rng.uniform(-bound, bound, size=shape).astype(np.float32)


def _trunc_normal(rng: np.random.Generator, shape, fan_in: int) -> np.ndarray:
    return np.clip(rng.standard_normal(shape, dtype=np.float32), -2, 2) * np.float32(0.02)


INIT_KINDS: dict[str, Callable[[np.random.Generator, tuple, int], np.ndarray]] = {
    "uniform": _uniform,
    "trunc_normal": _trunc_normal,
    "ones": lambda rng, shape, fan_in: np.ones(shape, np.float32),
    "zeros": lambda rng, shape, fan_in: np.zeros(shape, np.float32),
    "layer_scale": lambda rng, shape, fan_in: np.full(shape, 1e-6, np.float32),
}

#: (name pattern, INIT_KINDS key): the first pattern found in a parameter's name decides its init
InitRules = Sequence[tuple[str, str]]


def random_state_dict(shapes: Mapping[str, tuple[int, ...]], seed: int, rules: InitRules) -> dict[str, np.ndarray]:
    """Seeded stand-in weights in checkpoint layout, drawn in sorted name order. Each family's
    rules keep its published init's character so activations stay in a sane range through
    deep stacks. A bias's fan-in is its layer's weight's."""
    rng = np.random.default_rng(seed)
    out: dict[str, np.ndarray] = {}
    for name in sorted(shapes):
        kind = next(k for pattern, k in rules if re.search(pattern, name))
        weight = re.sub(r"bias$", "weight", name)
        wshape = shapes.get(weight, shapes[name])
        fan_in = int(np.prod(wshape[1:])) if len(wshape) > 1 else int(wshape[0])
        out[name] = INIT_KINDS[kind](rng, shapes[name], fan_in)
    return out
