"""Backend registry: get_backend('numpy' | 'mlx' | 'cuda' | 'auto')."""
from __future__ import annotations

import importlib.util
import logging
import platform

from .protocol import Backend

log = logging.getLogger("convkernels")

NAMES = ("auto", "numpy", "mlx", "cuda")


def cuda_status() -> tuple[bool, str]:
    """(usable, reason): a CUDA GPU visible to CuPy and the cuDNN frontend importable."""
    if importlib.util.find_spec("cupy") is None:
        return False, "cupy is not installed"
    if importlib.util.find_spec("cudnn") is None:
        return False, "nvidia-cudnn-frontend (import cudnn) is not installed"
    try:
        import cupy
        n = cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # driver missing, no device, ...
        return False, f"no usable CUDA device ({exc.__class__.__name__}: {exc})"
    if n < 1:
        return False, "no CUDA device"
    return True, f"{n} CUDA device(s)"


def visible_cuda_devices() -> int:
    """GPUs the CUDA driver shows this process (honouring CUDA_VISIBLE_DEVICES), asked of the
    driver directly: no CUDA runtime, no context, no GPU memory taken (the service's supervisor
    counts devices before it starts a model worker on each, and holds none itself)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("cuda") or "libcuda.so.1"
    try:
        cuda = ctypes.CDLL(name)
    except OSError:
        return 0
    count = ctypes.c_int(0)
    if cuda.cuInit(0) != 0 or cuda.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return 0
    return count.value


def metal_status() -> tuple[bool, str]:
    if importlib.util.find_spec("mlx") is None:
        return False, "mlx is not installed"
    try:
        import mlx.core as mx
        ok = bool(mx.metal.is_available())
    except Exception as exc:
        return False, f"mlx present but Metal check failed ({exc})"
    return (ok, "Metal available" if ok else f"mlx present, no Metal on {platform.system()}")


def get_backend(name: str = "auto", cuda_options: dict | None = None, numpy_options: dict | None = None,
                **options) -> Backend:
    """Create a backend by name; 'auto' picks cuda, then mlx on Metal, then numpy, and logs why.
    `options` go to whichever backend is chosen (dtype, unfold_limit_bytes, ...);
    `cuda_options` / `numpy_options` are constructor options for that backend only (e.g.
    cuda_graphs, plan_cache_dir), ignored where another backend is chosen. Backends read no
    environment variables: the service passes its settings here (Settings.backend_options)."""
    if name not in NAMES:
        raise ValueError(f"unknown backend {name!r}; choose one of {NAMES}")
    if name == "auto":
        ok, why = cuda_status()
        if ok:
            log.info("backend auto -> cuda: %s", why)
            name = "cuda"
        else:
            ok_m, why_m = metal_status()
            if ok_m:
                log.info("backend auto -> mlx: %s (cuda: %s)", why_m, why)
                name = "mlx"
            else:
                log.info("backend auto -> numpy (cuda: %s; mlx: %s)", why, why_m)
                name = "numpy"
    if name == "numpy":
        if options.get("dtype") == "bfloat16":  # its GEMM-shaped products in bfloat16 (backends/numpy/bf16.py)
            from .backends.numpy.bf16 import NumpyBf16Backend
            return NumpyBf16Backend(**options, **(numpy_options or {}))
        from .backends.numpy.backend import NumpyBackend
        return NumpyBackend(**options, **(numpy_options or {}))
    if name == "mlx":
        if importlib.util.find_spec("mlx") is None:
            raise RuntimeError("backend 'mlx' needs the mlx extra: pip install 'convserve[mlx]'")
        from .backends.mlx.backend import MlxBackend
        return MlxBackend(**options)
    ok, why = cuda_status()
    if not ok:
        raise RuntimeError(f"backend 'cuda' is not usable here: {why}")
    from .backends.cuda.backend import CudaBackend
    from .backends.cuda.options import CudaOptions
    return CudaBackend(CudaOptions(**options, **(cuda_options or {})))
