"""The NumPy backend's measured path choices, kept on disk (CONVSERVE_PLAN_CACHE_DIR).

Timing every valid path of a large conv costs seconds per new shape (~10 s for a first SD-VAE 256
decode on two cores); a restarted server would pay it again. The choices are kept in one small
JSON file per machine fingerprint (CPU model and count, NumPy and its BLAS, whether the compiled
kernels are there, convserve's version): a choice measured on other hardware or another build is
never reused. An unreadable, corrupt or foreign file is ignored (and replaced at the next save),
never fatal; writes are atomic, so a reader never sees half a file.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import tempfile
from pathlib import Path

log = logging.getLogger("convkernels.numpy.paths")

FORMAT = 1


def machine_fingerprint() -> dict:
    import numpy as np

    from ... import _cpu

    cpu = platform.processor() or ""
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    try:
        from threadpoolctl import threadpool_info
        blas = sorted(f"{i.get('internal_api')} {i.get('version')}" for i in threadpool_info()
                      if i.get("user_api") == "blas")
    except Exception:  # threadpoolctl missing or unable to inspect: the numpy version still binds
        blas = []
    try:
        from importlib.metadata import version
        ours = version("convserve")
    except Exception:
        ours = "unknown"
    return {"format": FORMAT, "machine": platform.machine(), "cpu": cpu, "cpus": os.cpu_count(),
            "numpy": np.__version__, "blas": blas, "compiled_kernels": bool(_cpu.AVAILABLE), "convserve": ours}


class PathStore:
    """{work key -> path name} for one machine fingerprint, in `directory`."""

    def __init__(self, directory: str | os.PathLike, fingerprint: dict | None = None):
        self.dir = Path(directory)
        self.fingerprint = fingerprint if fingerprint is not None else machine_fingerprint()
        digest = hashlib.sha256(json.dumps(self.fingerprint, sort_keys=True).encode()).hexdigest()[:16]
        self.path = self.dir / f"numpy-paths-{digest}.json"

    @staticmethod
    def name(work: tuple) -> str:
        """The JSON key of a work tuple (nested tuples of ints and strings)."""
        return json.dumps(work)

    def load(self) -> dict[str, str]:
        """Stored choices by work-key name; {} when there is no usable file."""
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as exc:
            log.warning("path store: ignoring unreadable %s (%s)", self.path, exc)
            return {}
        if not isinstance(data, dict):
            log.warning("path store: ignoring malformed %s", self.path)
            return {}
        if data.get("fingerprint") != self.fingerprint:
            log.warning("path store: ignoring %s, written for another machine or build", self.path)
            return {}
        choices = data.get("choices")
        if not isinstance(choices, dict) or not all(isinstance(v, str) for v in choices.values()):
            log.warning("path store: ignoring malformed %s", self.path)
            return {}
        log.info("path store: %d measured path choices from %s", len(choices), self.path)
        return dict(choices)

    def put(self, choices: dict[str, str], name: str, path_name: str) -> None:
        """Record a choice in `choices` and write the whole (small) file again."""
        choices[name] = path_name
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.dir, suffix=".tmp")
        except OSError as exc:
            log.warning("path store: cannot write in %s (%s)", self.dir, exc)
            return
        try:
            with os.fdopen(fd, "w") as f:
                json.dump({"fingerprint": self.fingerprint, "choices": choices}, f, indent=0, sort_keys=True)
            os.replace(tmp, self.path)
        except OSError as exc:
            log.warning("path store: could not save %s (%s)", self.path, exc)
            try:
                os.unlink(tmp)
            except OSError:
                pass
