"""What `convserve` checks before any work, each problem one line on stderr and a non-zero exit
(never a traceback): setting values, the backend asked for, the port to listen on, input files,
the server's validation of local inputs, MODELS entries (known presets, existing weights paths)
and their Hub weights, resolved into the cache."""
from __future__ import annotations

import errno
import importlib.util
import socket
from pathlib import Path

import numpy as np
import typer

from .. import listen_sockets


def fail(message: str, code: int = 2):
    """A start-up or usage error as one line on stderr and a non-zero exit, not a traceback."""
    typer.echo(f"convserve: error: {message}", err=True)
    raise typer.Exit(code)


def settings_problem(exc: ValueError, flags: set[str]) -> str:
    """pydantic's multi-line report of bad settings as one line: each value named as it was given
    (--flag when in `flags`, else its CONVSERVE_ variable), what it was and what is accepted
    (a Literal's choices: "--backend 'gpu': input should be 'auto', 'numpy', 'mlx' or 'cuda'")."""
    errors = getattr(exc, "errors", None)
    if errors is None:
        return f"settings: {exc}"
    parts = []
    for err in errors():
        field = str(err["loc"][0]) if err.get("loc") else "settings"
        where = f"--{field.replace('_', '-')} " if field in flags else f"CONVSERVE_{field.upper()}="
        msg = err["msg"].removeprefix("Value error, ")
        parts.append(f"{where}{err.get('input')!r}: {msg[:1].lower()}{msg[1:]}")
    return "; ".join(parts)


def check_backend(name: str) -> None:
    """A backend asked for by name that cannot run here is one line before any worker starts (its
    worker would fail to load, and start-up with it, later and amid log lines). Asks only what
    takes no CUDA context: whether the packages are installed and the driver's device count."""
    if name == "cuda":
        missing = [pkg for module, pkg in (("cupy", "CuPy"), ("cudnn", "the cuDNN frontend"))
                   if importlib.util.find_spec(module) is None]
        if missing:
            fail(f"backend 'cuda': {' and '.join(missing)} not installed (the cuda extra: pip install -e '.[cuda]'); "
                 "on a CPU use --backend auto or numpy")
        from convkernels.registry import visible_cuda_devices
        if visible_cuda_devices() == 0:
            fail("backend 'cuda': no CUDA GPU is visible (driver, CUDA_VISIBLE_DEVICES); "
                 "on a CPU use --backend auto or numpy")
    elif name == "mlx" and importlib.util.find_spec("mlx") is None:
        fail("backend 'mlx': mlx is not installed (the mlx extra: pip install -e '.[mlx]')")


def listen_socket(host: str, port: int, own: bool = False) -> socket.socket:
    """The server's (first) listening socket, bound as uvicorn binds one (whose own bind prints a
    bare `[Errno 98] Address already in use` and exits 1): a port in use, a privileged port or an
    address that is not this machine's is one line naming the flag to change. own: the further
    front ends get sockets of their own beside it (service/listen_sockets.py)."""
    try:
        sock = listen_sockets.bind_first(host, port, group=own and listen_sockets.spreads())
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            fail(f"port {port} on {host} is in use (another server?): choose another with --port or CONVSERVE_PORT")
        if exc.errno == errno.EACCES:
            fail(f"port {port} on {host} needs privileges to listen on: choose one above 1024 with --port or "
                 "CONVSERVE_PORT")
        fail(f"cannot listen on {host}:{port}: {exc.strerror or exc} (--host / CONVSERVE_HOST, --port / CONVSERVE_PORT)")
    return sock


def input_file(path: Path) -> Path:
    """An input file the command reads; a missing one is a one-line error (typer's `exists=True`
    prints a multi-line usage panel instead)."""
    if not path.exists():
        fail(f"{path}: no such file")
    if path.is_dir():
        fail(f"{path}: is a folder, not a file")
    return path


def validated(check, *args) -> np.ndarray:
    """The server's validation of a local input; what it rejects is a one-line error."""
    from ..problems import Problem

    try:
        return check(*args)
    except Problem as p:
        fail(p.detail)


def check_model_entries(entries) -> None:
    """Start-up checks of MODELS entries that need no loading and no network: every preset is a
    known one (a near miss is named: `sd-vea` -> did you mean sd-vae), and every local weights path
    exists. Problems end the command with one line naming each; an entry without a preset (a bare
    Hub reference for `pull`) has only its weights checked; an optional entry (`?`) only warns
    (the server starts without it, and says so in /readyz's `unavailable`)."""
    problems = []
    for entry in entries:
        found = _entry_problems(entry)
        if entry.optional:
            for p in found:
                typer.echo(f"convserve: warning: optional {p}", err=True)
        else:
            problems += found
    if problems:
        fail("; ".join(problems))


def _entry_problems(entry) -> list[str]:
    import difflib

    from models import PRESETS
    from models.hub import parse_weights

    problems = []
    if entry.preset and entry.preset not in PRESETS:
        known = sorted(PRESETS)
        close = difflib.get_close_matches(entry.preset, known, n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}? " if close else ""
        missing = "; ".join(f"{f}: {why}" for f, why in PRESETS.unavailable.items() if why != "not installed")
        problems.append(f"model {entry.name}: unknown preset {entry.preset!r}; {hint}known presets: "
                        f"{', '.join(known)}" + (f" (families unavailable: {missing})" if missing else ""))
    if not entry.weights:
        return problems
    try:
        parsed = parse_weights(entry.weights)
    except ValueError as exc:
        return problems + [f"model {entry.name}: {exc}"]
    if isinstance(parsed, str) and not Path(parsed).expanduser().exists():
        problems.append(f"model {entry.name}: weights {entry.weights!r}: no such file or folder (a local path: "
                        "a diffusers/HF model folder or a .safetensors file)")
    return problems


def model_entries(spec: str):
    from ..settings import parse_models

    try:
        return parse_models(spec)
    except ValueError as exc:
        fail(f"models {spec!r}: {exc}")


def fetch_hub_weights(entries, hashes: bool) -> list:
    """Resolve every Hub reference among `entries` into the Hub cache before anything loads, so a
    missing repository (offline, gated, a typo) stops start-up with one line naming it, and N
    workers find the files already there. Optional entries only warn."""
    from models.hub import HubRef, parse_weights, resolve

    resolved = []
    for entry in entries:
        try:
            ref = parse_weights(entry.weights) if entry.weights else None
            if isinstance(ref, HubRef):
                resolved.append((entry, resolve(ref, hashes=hashes)))
        except ValueError as exc:
            if not entry.optional:
                fail(str(exc))
            typer.echo(f"convserve: warning: optional model {entry.name} skipped: {exc}", err=True)
    return resolved
