"""Fault injection for resilience tests and fire drills: TESSEL_FAULT in the environment.

    TESSEL_FAULT="spike:batch=7:scale=1000"   multiply the loss of global batch 7 by 1000
    TESSEL_FAULT="nan:batch=7"                make the loss of global batch 7 NaN
    TESSEL_FAULT="kill:rank=1:step=5"         SIGKILL rank 1 when step 5 starts (first attempt only)
    TESSEL_FAULT="hang:rank=1:step=3"         rank 1 sleeps forever when step 3 starts
    TESSEL_FAULT="slow:seconds=0.1"           every step starts 0.1 s late (a slow machine;
                                              the losses are unchanged)

Several faults are separated by ";". A fault keyed by batch follows the data, not the step:
once a rollback skips that batch it never fires again, as a corrupted sample would behave.
`kill` fires only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT 0), so
the restarted job can finish. Unset, nothing here does anything.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

from tessel.errors import TesselError


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    batch: int | None = None
    scale: float = 1.0
    seconds: float = 0.0


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, *fields = item.split(":")
        if kind not in ("spike", "nan", "kill", "hang", "slow"):
            raise TesselError(f"TESSEL_FAULT: unknown fault {kind!r}; use spike, nan, kill, hang "
                              "or slow")
        args: dict[str, float | int] = {}
        for f in fields:
            key, _, value = f.partition("=")
            if key not in ("rank", "step", "batch", "scale", "seconds") or not value:
                raise TesselError(f"TESSEL_FAULT: bad field {f!r} in {item!r}")
            try:
                args[key] = float(value) if key in ("scale", "seconds") else int(value)
            except ValueError:
                raise TesselError(f"TESSEL_FAULT: bad value in {f!r}") from None
        faults.append(Fault(kind, **args))  # type: ignore[arg-type]
    return faults


class Faults:
    def __init__(self, rank: int, spec: str | None = None):
        self.rank = rank
        self.faults = parse_faults(spec if spec is not None else os.environ.get("TESSEL_FAULT", ""))
        self.first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"

    def at_step(self, step: int) -> None:
        for f in self.faults:
            if f.kind == "slow" and (f.rank is None or f.rank == self.rank):
                time.sleep(f.seconds)
                continue
            if f.step != step or (f.rank is not None and f.rank != self.rank):
                continue
            if f.kind == "kill" and self.first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "hang":
                while True:
                    time.sleep(3600)

    def loss_factor(self, batch: int) -> float:
        """What the loss of global batch `batch` is multiplied by (1.0: untouched)."""
        factor = 1.0
        for f in self.faults:
            if f.batch == batch and f.kind == "spike":
                factor *= f.scale
            elif f.batch == batch and f.kind == "nan":
                factor = float("nan")
        return factor
