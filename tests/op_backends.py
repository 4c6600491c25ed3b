"""What the op suite (test_ops_conv.py, test_ops.py) runs on: every backend in each dtype it computes
in here, as conftest.py's `target` fixture (`half_target`: the half dtypes), skipped with the reason where the backend cannot run (mlx not
installed; no usable CUDA GPU, CuPy or cuDNN frontend, as tests/gpu skips). Tolerances (relative L2
against torch in float64, fed the exact values the device holds): float32 < 1e-5 (TF32 off),
float16/bfloat16 < 1e-2. Also the conv operands and references the op suite and the backends'
path tests share, and the conv counters."""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass

import numpy as np
import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from torch_reference import from_t, ref_activation, ref_conv, ref_conv_transpose, to_t

from convkernels import REGISTRY, ConvSpec, get_backend


@dataclass(frozen=True)
class Target:
    """One backend computing in one dtype."""

    name: str
    dtype: str

    @property
    def tol(self) -> float:
        return 1e-5 if self.dtype == "float32" else 1e-2

    def __str__(self) -> str:
        return f"{self.name}-{self.dtype}"


TARGETS = [Target("numpy", "float32"), Target("mlx", "float32"),
           Target("cuda", "float16"), Target("cuda", "bfloat16"), Target("cuda", "float32")]
#: the half-precision storage of the backends that have it
HALF_TARGETS = [Target("mlx", "float16"), Target("mlx", "bfloat16"),
                Target("cuda", "float16"), Target("cuda", "bfloat16")]


def unavailable(name: str) -> str | None:
    """Why backend `name` cannot run here, or None."""
    if name == "mlx" and importlib.util.find_spec("mlx") is None:
        return "mlx is not installed"
    if name == "cuda":
        from convkernels.registry import cuda_status
        ok, why = cuda_status()
        return None if ok else f"CUDA backend unavailable: {why}"
    return None


def target_params(targets: list[Target]) -> list:
    return [pytest.param(t, id=str(t), marks=[pytest.mark.gpu] if t.name == "cuda" else []) for t in targets]


def available(request) -> Target:
    """The fixture's target, or a skip saying why its backend cannot run here (conftest.py's
    `target` and `half_target` fixtures)."""
    why = unavailable(request.param.name)
    if why is not None:
        pytest.skip(why)
    return request.param


_CUDA_BACKENDS: dict = {}


def backend(t: Target, fresh: bool = False, **options):
    """A backend computing in t.dtype. numpy and mlx: a new one every call (they cost nothing to
    make, and path memos start empty); cuda: one per dtype and options unless `fresh`, as each
    costs cuDNN and cuBLAS handles, plans and compiled kernels."""
    if t.name != "cuda" or fresh:
        return get_backend(t.name, dtype=t.dtype, **options)
    key = (t.dtype, tuple(sorted(options.items())))
    if key not in _CUDA_BACKENDS:
        _CUDA_BACKENDS[key] = get_backend("cuda", dtype=t.dtype, **options)
    return _CUDA_BACKENDS[key]


def put(be, a):
    """(device array, float64 host copy of exactly what the device holds)."""
    d = be.asarray(np.asarray(a, dtype=np.float32))
    return d, np.asarray(be.to_host(d), dtype=np.float64)


def scrape() -> dict:
    out = {}
    for fam in text_string_to_metric_families(generate_latest(REGISTRY).decode()):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def conv_counts(before: dict, after: dict, backend_name: str, op: str) -> dict[str, float]:
    """convkernels_conv_total by path between two scrapes, for one backend and op (nonzero only)."""
    counts = {}
    for (name, labels), v in after.items():
        lab = dict(labels)
        if name == "convkernels_conv_total" and lab.get("backend") == backend_name and lab.get("op") == op:
            d = v - before.get((name, labels), 0.0)
            if d:
                counts[lab["path"]] = d
    return counts


#: (bias, residual, activation)
EPILOGUES = {"plain": (False, False, None), "bias_silu_residual": (True, True, "silu"),
             "bias_gelu": (True, False, "gelu"), "residual_relu": (False, True, "relu")}


def conv_operands(be, rng, case, epilogue, transpose=False):
    """Device operands and their float64 host copies; weights scaled by 1/sqrt(fan-in), so
    half-precision outputs stay in range."""
    if transpose:
        nd, n, sp, cin, cout, k, stride, pad, opad, dil, g = case
        spec = ConvSpec.make(nd, stride, pad, dil, g, transpose=True, output_padding=opad)
    else:
        nd, n, sp, cin, cout, k, stride, pad, dil, g = case
        spec = ConvSpec.make(nd, stride, pad, dil, g)
    x, xh = put(be, rng.standard_normal((n, *sp, cin)))
    w, wh = put(be, rng.standard_normal((cout, *k, cin // g)) / np.sqrt(cin // g * np.prod(k)))
    has_b, has_r, act = EPILOGUES[epilogue]
    b, bh = put(be, rng.standard_normal(cout)) if has_b else (None, None)
    out_shape = (n, *spec.output_spatial(sp, k), cout)
    r, rh = put(be, rng.standard_normal(out_shape)) if has_r else (None, None)
    return spec, (x, w, b, r, act), (xh, wh, bh, rh)


def ref_forward(case, hosts, act):
    _, _, _, _, _, _, stride, pad, dil, g = case
    xh, wh, bh, rh = hosts
    return ref_conv(xh, wh, bh, stride, pad, dil, g, rh, act)


def ref_transposed(case, hosts, act):
    _, _, _, _, _, _, stride, pad, opad, dil, g = case
    xh, wh, bh, rh = hosts
    ref = ref_conv_transpose(xh, wh, bh, stride, pad, opad, dil, g)
    ref = from_t(ref_activation(to_t(ref), act))
    return ref if rh is None else ref + rh
