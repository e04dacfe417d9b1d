"""What every job file tessel writes shares (the sbatch script, slurm.py; the Kubernetes
job, k8s.py): the restart budget, the checks of user text a job file carries, the bash lines
that hold the `tessel train` arguments, and the default job name.
"""

from __future__ import annotations

import re
import shlex
import unicodedata
from collections.abc import Callable
from pathlib import Path

from tessel.errors import TesselError

# torchrun restarts a failed worker group this many times before giving up on the job.
MAX_RESTARTS = 3


def check_count(flag: str, value: int) -> None:
    if value < 1:
        raise TesselError(f"{flag} must be >= 1 (got {value})")


def check_text(what: str, text: str) -> None:
    """Refuse text that a job file cannot carry. Job files are line-based (sbatch directives,
    bash comments, YAML blocks): a control character (a newline, a tab, C1 codes such as
    NEL), a Unicode line or paragraph separator (YAML breaks lines there too), a lone
    surrogate (not text) or a non-character would silently change their meaning or make them
    unreadable rather than fail."""
    for c in text:
        if unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp") or c in "\ufffe\uffff":
            raise TesselError(f"{what} {text!r} contains a control character or line break "
                              f"({c!r}); remove it")


def train_args(
    config_path: str, overrides: list[str], quote: Callable[[str], str] = shlex.quote
) -> list[str]:
    """Bash lines that set TRAIN to the `tessel train` arguments. `--auto-resume` makes every
    start of the job (the first, a requeue, a resubmission, a pod restart, and torchrun's own
    --max-restarts) continue the run when its directory already holds one. `quote` makes
    one argument a bash word."""
    for text in (config_path, *overrides):
        check_text("argument", text)
    return [
        "# Start the run, or continue it from its latest checkpoint when it exists already.",
        "TRAIN=(" + " ".join([*map(quote, [config_path, *overrides]), "--auto-resume"]) + ")",
    ]


def default_name(config_path: str) -> str:
    """`tessel-<config file stem>`, made a valid DNS-1123 label (and SLURM job name)."""
    stem = re.sub(r"[^a-z0-9-]+", "-", Path(config_path).stem.lower()).strip("-")
    return ("tessel-" + stem)[:63].rstrip("-")
