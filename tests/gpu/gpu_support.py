"""Helpers for the GPU tests (a named module: `from conftest import` is ambiguous with two conftests)."""
from __future__ import annotations

import pytest


def cuda_or_skip():
    from convkernels.registry import cuda_status

    ok, why = cuda_status()
    if not ok:
        pytest.skip(f"CUDA backend unavailable: {why}")


def cuda_backend(dtype: str, **options):
    from convkernels import get_backend
    return get_backend("cuda", dtype=dtype, **options)


def report_parity(line: str, file: str = "model_parity.txt") -> None:
    """Errors (and other figures) of passing runs too: appended to $OUT/`file` when $OUT names an output folder."""
    import os

    print(line)
    out = os.environ.get("OUT")
    if out and os.path.isdir(out):
        with open(os.path.join(out, file), "a") as f:
            f.write(line + "\n")


class OnDevice:
    """The diffusers module's decode run on the GPU in `dtype`, its output back in float32 on the CPU;
    every other attribute (config, BatchNorm statistics) is the float32 CPU module's, so the
    reference helpers of the CPU tests run unchanged around it."""

    def __init__(self, vae, dtype):
        import copy

        import torch

        torch.backends.cudnn.allow_tf32 = False  # a float32 reference is float32
        torch.backends.cuda.matmul.allow_tf32 = False
        self._vae, self._dtype = vae, dtype
        self._dev = copy.deepcopy(vae).to("cuda", dtype).eval()

    def __getattr__(self, name):
        return getattr(self._vae, name)

    def decode(self, z, *args, **kwargs):
        import torch

        with torch.no_grad():
            out = self._dev.decode(z.to("cuda", self._dtype), *args, **kwargs)
        if isinstance(out, tuple):
            return tuple(o.float().cpu() for o in out)
        out.sample = out.sample.float().cpu()
        return out
