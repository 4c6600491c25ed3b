"""A virtual environment made from nothing, for tests that install the project the way a user
or an image build does. It never borrows this interpreter's packages (`--system-site-packages`
would make the result depend on whatever the machine's base Python happens to hold): pip
resolves the project's declared dependencies itself, from the package index or pip's cache."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

INSTALL_TIMEOUT_S = 900


def make_venv(path: Path) -> Path:
    """A new venv at `path` with pip and nothing else; returns its bin directory."""
    subprocess.run([sys.executable, "-m", "venv", str(path)], check=True, timeout=300)
    return path / "bin"


def venv_env(bin_dir: Path, base: dict | None = None) -> dict:
    """The environment of a shell that activated the venv (and no CONVSERVE_* settings)."""
    env = {k: v for k, v in (base if base is not None else os.environ).items()
           if not k.startswith("CONVSERVE_") and k not in ("PYTHONPATH", "PYTHONHOME")}
    env["VIRTUAL_ENV"] = str(bin_dir.parent)
    env["PATH"] = f"{bin_dir}{os.pathsep}{env.get('PATH', '')}"
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def pip_install(bin_dir: Path, *args: str, cwd: Path | None = None) -> None:
    """`pip install args...` inside the venv; fails the caller with pip's own output."""
    run = subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "--quiet", *args], cwd=cwd,
                         env=venv_env(bin_dir), capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    if run.returncode != 0:
        raise AssertionError(f"pip install {' '.join(args)} failed:\n{run.stdout[-3000:]}{run.stderr[-3000:]}")
