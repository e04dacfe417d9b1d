"""`python -m tessel ...` is the same as `tessel ...` (what torchrun launches)."""

from tessel.cli import run

run()
