"""`convserve decode|encode --url`: the same commands against a running server; an error answer
(or none) is one line."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import numpy as np
import typer

from .checks import fail
from .files import IMAGE_SUFFIXES


def problem_text(r) -> str:
    """A server's error answer in one line: its problem+json detail, else the start of the body."""
    try:
        doc = r.json()
        detail = doc.get("detail") or doc.get("error") if isinstance(doc, dict) else None
    except ValueError:
        detail = None
    text = str(detail) if detail else " ".join(r.text.split())[:300]
    return f"server answered {r.status_code} {r.reason_phrase}: {text}"


def post(url: str, api_key: Optional[str], headers: dict | None = None, **kwargs):
    """A request to a running server; an error answer, or no answer, ends the command with one line."""
    try:
        import httpx
    except ImportError:  # a runtime dependency; an environment missing it gets the fix, not a traceback
        fail("--url needs the httpx package: pip install httpx")

    auth = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.post(url, headers={**(headers or {}), **auth}, timeout=600, **kwargs)
    except httpx.HTTPError as exc:
        fail(f"no answer from {url}: {exc.__class__.__name__}: {exc}", 1)
    if r.status_code != 200:
        fail(problem_text(r), 1)
    return r


def remote_decode(url, model, lat, output: Path, tiled, quality, fps, api_key, shards: str = "1",
                  channels: str | None = None) -> None:
    """The decode on a running server; channels (rgba | rgb) goes with it where given, else the
    server answers the model's own (service/alpha_option.py's rule, as the local decode applies it)."""
    from ..codecs import npy_bytes
    suffix = output.suffix.lower()
    if suffix not in (".npy", ".mp4", *IMAGE_SUFFIXES):
        fail("with --url, write .png/.jpg/.webp, .mp4 or .npy (frame folders are local only)")
    fmt = "npy" if suffix == ".npy" else "mp4" if suffix == ".mp4" else IMAGE_SUFFIXES[suffix]
    r = post(f"{url.rstrip('/')}/v1/models/{model}/decode", api_key, {"content-type": "application/x-npy"},
              content=npy_bytes(np.asarray(lat, np.float32)),
              params={"format": fmt, "quality": quality, "tiled": tiled, "fps": fps, "shards": shards,
                      **({"channels": channels} if channels else {})})
    shape = r.headers.get("x-output-shape")
    if r.headers.get("content-type") == "application/zip":  # several: out_000.png, out_001.png, ...
        import io
        import zipfile
        with zipfile.ZipFile(io.BytesIO(r.content)) as zf:
            names = zf.namelist()
            for i, member in enumerate(names):
                output.with_name(f"{output.stem}_{i:03d}{suffix}").write_bytes(zf.read(member))
        typer.echo(f"wrote {len(names)} files {output.stem}_000{suffix} ... (shape {shape})")
        return
    output.write_bytes(r.content)
    typer.echo(f"wrote {output} ({len(r.content)} bytes, shape {shape})")
