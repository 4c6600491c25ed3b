"""The `convserve` command (main.py; `python -m service.cli` runs it too): what it checks before any
work (checks.py), the files `decode` reads and writes (files.py), `--url` against a running server
(remote.py) and `decode --shards N` over local GPUs (sharded.py). `serve` parses and checks, then
service/supervisor.py runs the server's processes."""


def __getattr__(name: str):
    """`from service.cli import app`: what console scripts installed before the command moved to
    service/cli/main.py import (pyproject.toml now names service.cli.main:app); loaded on use, so
    importing one of this package's modules does not build the command."""
    if name == "app":
        from .main import app

        return app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
