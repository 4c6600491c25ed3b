"""What `convserve` checks before any work, each problem one line on stderr and a non-zero exit
(never a traceback): input files, the server's validation of local inputs, MODELS entries (known
presets, existing weights paths) and their Hub weights, resolved into the cache."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import typer


def fail(message: str, code: int = 2):
    """A start-up or usage error as one line on stderr and a non-zero exit, not a traceback."""
    typer.echo(f"convserve: error: {message}", err=True)
    raise typer.Exit(code)


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
    from .problems import Problem

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
    from .settings import parse_models

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
