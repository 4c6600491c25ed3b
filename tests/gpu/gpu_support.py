"""Helpers for the GPU tests (a named module: `from conftest import` is ambiguous with two conftests)."""
from __future__ import annotations

import pytest


def cuda_or_skip():
    from convkernels.registry import cuda_status

    ok, why = cuda_status()
    if not ok:
        pytest.skip(f"CUDA backend unavailable: {why}")


def cuda_backend(dtype: str):
    from convkernels import get_backend
    return get_backend("cuda", dtype=dtype)


def report_parity(line: str) -> None:
    """Errors of passing runs too: appended to $OUT/model_parity.txt when $OUT names an output folder."""
    import os

    print(line)
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        with open(os.path.join(out, "model_parity.txt"), "a") as f:
            f.write(line + "\n")
