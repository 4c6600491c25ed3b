"""`python -m service.cli ...`: the `convserve` command (the console script runs service.cli.main:app)."""
import sys

from .main import app

app()
sys.exit(0)
