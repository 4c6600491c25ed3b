"""Optional compiled CPU kernels. Built by `pip install` when a C compiler is present; every
user checks `AVAILABLE` and falls back to pure NumPy otherwise."""
import os

from .wait_policy import apply_default_wait_policy

# libgomp reads its wait policy once, when it is loaded (importing _kernels below): set it first
apply_default_wait_policy(os.environ)

try:
    from . import _kernels
    AVAILABLE = True
except ImportError:  # no compiler at install time: NumPy paths only
    _kernels = None
    AVAILABLE = False
