"""Names the machine a benchmark ran on (printed with every table)."""
from __future__ import annotations

import os
import platform

try:
    # Load the peer before convkernels: convkernels sets OMP_WAIT_POLICY=PASSIVE for its own
    # OpenMP runtime, and a torch loaded after that would read it too and no longer run as shipped.
    import torch  # noqa: F401
except ImportError:
    pass


def describe_machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import numpy as np
    parts = [f"{platform.system()} {platform.machine()}", cpu, f"{os.cpu_count()} cores",
             f"python {platform.python_version()}", f"numpy {np.__version__}"]
    try:
        import torch
        parts.append(f"torch {torch.__version__} ({torch.get_num_threads()} threads)")
    except ImportError:
        pass
    try:
        import mlx.core as mx
        parts.append(f"mlx {mx.__version__}")
    except ImportError:
        pass
    return ", ".join(parts)
