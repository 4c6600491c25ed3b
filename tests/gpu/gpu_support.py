"""Helpers for the GPU tests (a named module: `from conftest import` is ambiguous with two conftests)."""
from __future__ import annotations

import pytest


def cuda_or_skip():
    from convkernels.registry import cuda_status

    ok, why = cuda_status()
    if not ok:
        pytest.skip(f"CUDA backend unavailable: {why}")
