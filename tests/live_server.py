"""Real convserve servers for tests: `python -m service.cli serve` (the README's path) on a free
localhost port in a subprocess, ready once /readyz answers 200, plus the .npy and /metrics helpers
the service tests use. A module of its own (tests/conftest.py re-exports it) so tests/gpu/, whose
conftest would clash by name, can import it too."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _importable(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


#: CONVSERVE_HTTP values for tests that run under both of uvicorn's HTTP/1.1 parsers
HTTP_PROTOCOLS = [pytest.param("h11"),
                  pytest.param("httptools", marks=pytest.mark.skipif(not _importable("httptools"),
                                                                     reason="httptools not installed"))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class LiveServer:
    proc: subprocess.Popen
    port: int
    log_path: Path
    env: dict = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-6000:]

    def stop(self, timeout: float = 15.0) -> int | None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


#: the bytecode cache the servers of this test process share (see _bytecode_env)
_PYCACHE: str | None = None


def _bytecode_env() -> dict[str, str]:
    """Where the environment keeps Python from writing bytecode beside the sources
    (PYTHONDONTWRITEBYTECODE, as on the shared 2-core box), each server process compiled the
    modules it imports from source at every start: about 0.4 s of a server's start, and the
    suite starts some 70 servers. Theirs go to one cache in a temporary folder of this test
    process instead (PYTHONPYCACHEPREFIX): the same sources run, and nothing is written into
    the tree. Elsewhere the servers' own __pycache__ folders serve, as before."""
    global _PYCACHE
    if not os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return {}
    if _PYCACHE is None:
        import atexit
        import shutil
        import tempfile
        _PYCACHE = tempfile.mkdtemp(prefix="convserve-tests-pycache-")
        atexit.register(shutil.rmtree, _PYCACHE, True)
    return {"PYTHONDONTWRITEBYTECODE": "", "PYTHONPYCACHEPREFIX": _PYCACHE}


def plain_get(url: str, path: str, headers: dict | None = None, timeout: float = 10) -> tuple[int, bytes]:
    """GET url + path on a new connection: (status, body); OSError or HTTPException where nothing
    answered. Plain http.client, for what the tests poll: httpx.get builds a client (and a TLS
    context) per call, about 40 ms of this process's CPU each, which a poll every 0.02-0.1 s
    took from the server it waits on (two cores)."""
    import http.client
    from urllib.parse import urlsplit

    where = urlsplit(url)
    conn = http.client.HTTPConnection(where.hostname, where.port, timeout=timeout)
    try:
        conn.request("GET", path, headers=headers or {})
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def get_status(url: str, path: str, timeout: float = 2) -> int | None:
    """The status of GET url + path, or None where nothing answered."""
    import http.client

    try:
        return plain_get(url, path, timeout=timeout)[0]
    except (OSError, http.client.HTTPException):
        return None


def start_server(log_dir: Path, *, ready_timeout: float = 90.0, cli_args: tuple = (), env_extra: dict | None = None,
                 own_group: bool = False, **settings) -> LiveServer:
    """Start `convserve serve [cli_args]` with CONVSERVE_<KEY>=value settings (and env_extra's
    variables) and wait for /readyz. own_group: in a process group of its own (a test may signal
    the whole group)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("CONVSERVE_")}
    env.update({"CONVSERVE_BACKEND": "numpy", "CONVSERVE_LOG_LEVEL": "warning", "PYTHONUNBUFFERED": "1",
                **_bytecode_env()})
    env.update({f"CONVSERVE_{k.upper()}": str(v) for k, v in settings.items()})
    env.update(env_extra or {})
    log_path = log_dir / f"server-{port}.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--host", "127.0.0.1",
                             "--port", str(port), *cli_args], cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=own_group)
    server = LiveServer(proc, port, log_path, env)
    deadline = time.monotonic() + ready_timeout
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited {proc.returncode}:\n{server.log()}")
        if get_status(server.url, "/readyz") == 200:
            return server
        if time.monotonic() > deadline:
            server.stop()
            pytest.fail(f"server not ready in {ready_timeout}s:\n{server.log()}")
        time.sleep(0.1)


# ---- request/metrics helpers (tests import them from here) ---------------------------------------
def npy(arr) -> bytes:
    import io

    import numpy as np
    buf = io.BytesIO()
    np.save(buf, arr, allow_pickle=False)
    return buf.getvalue()


def from_npy(data: bytes):
    import io

    import numpy as np
    return np.load(io.BytesIO(data), allow_pickle=False)


def scrape(url: str, headers: dict | None = None) -> dict[tuple, float]:
    """/metrics as {(sample name, sorted label items): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    text = plain_get(url, "/metrics", headers)[1].decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(snap: dict, name: str, **labels) -> float:
    return snap.get((name, tuple(sorted((k, str(v)) for k, v in labels.items()))), 0.0)


def metric_sum(snap: dict, name: str, **labels) -> float:
    """Sum over every series of `name` whose labels include `labels`."""
    want = {(k, str(v)) for k, v in labels.items()}
    return sum(v for (n, lab), v in snap.items() if n == name and want <= set(lab))


def wait_for(cond, timeout: float = 60, what: str = "") -> None:
    """Poll `cond` until it holds (an event the server makes visible, never a guessed duration)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


def wait_until_every_device_is_ready(url: str, model: str, timeout: float = 120, answers: int = 120) -> None:
    """/readyz is true once any worker is; a group needs every one of its workers. And each front
    end has its own view: the first accepts before it is ready, the others once they are, and the
    kernel hands each new connection to any of them. So the devices must show ready in `answers`
    answers in a row, each on a fresh connection (16 front ends: one left unready is missed with
    probability (15/16)^120, about 4e-4). Each answer is asked with plain_get (with httpx.get
    the 120 answers took 6 s)."""
    import http.client
    import json

    deadline = time.monotonic() + timeout
    in_a_row = 0
    while in_a_row < answers:
        try:
            devices = json.loads(plain_get(url, f"/v1/models/{model}", timeout=5)[1]).get("devices", [])
            ok = len(devices) >= 2 and all(d["state"] == "ready" for d in devices)
        except (OSError, http.client.HTTPException, ValueError):
            ok = False
        in_a_row = in_a_row + 1 if ok else 0
        assert time.monotonic() < deadline, f"the devices of {model} did not all get ready"
        if not ok:
            time.sleep(0.1)
