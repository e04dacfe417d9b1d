"""Fault injection for resilience tests and fire drills: TESSEL_FAULT in the environment.

    TESSEL_FAULT="spike:batch=7:scale=1000"   multiply the loss of global batch 7 by 1000
    TESSEL_FAULT="nan:batch=7"                make the loss of global batch 7 NaN
    TESSEL_FAULT="kill:rank=1:step=5"         SIGKILL rank 1 when step 5 starts (first attempt only)
    TESSEL_FAULT="hang:rank=1:step=3"         rank 1 sleeps forever when step 3 starts
    TESSEL_FAULT="term:rank=1:step=3"         SIGTERM to rank 1 when step 3 starts, as a
                                              scheduler's preemption notice (first attempt only)
    TESSEL_FAULT="killsync:step=3"            once 3 steps are done, SIGKILL this process
                                              as it enters the next step's all-reduce over
                                              the replica groups ([fault_tolerance]): it
                                              took part in that step's quorum, so its peers
                                              are in theirs
    TESSEL_FAULT="slow:seconds=0.1"           every step starts 0.1 s late (a slow machine;
                                              the losses are unchanged; step=N: from step N on;
                                              attempts=N: in the job's first N attempts only)
    TESSEL_FAULT="netdelay:seconds=0.05"      every collective of the process (from the first
                                              step on) starts 0.05 s late: a slow network; the
                                              losses are unchanged (rank=R: that rank only)

Steps count the steps done (step=3: once 3 are done); rank (optional) picks one process, else
every process fires. Each kind takes the keys shown (GRAMMAR); a spec with a key its kind
ignores, a missing key, a rank the run does not have, a step it never reaches, a negative or
non-finite number is refused in one line before the run starts (`check_faults`).

Several faults are separated by ";". A fault keyed by batch follows the data, not the step:
once a rollback skips that batch it never fires again, as a corrupted sample would behave.
`kill` and `term` fire only in a job's first attempt, so the restarted or requeued job can
finish. A job's attempts are counted by torchrun's restarts (TORCHELASTIC_RESTART_COUNT) and
SLURM's requeues (SLURM_RESTART_COUNT) together. Unset, nothing here does anything.

`netdelay` puts its wait inside the collective itself: a kernel of its own runs before the
backend's for every `c10d::` operator, the one door through which DDP, FSDP2, DTensor's
functional collectives, the pipeline's send/recv and all-to-all reach the backend. The
profiler sees the wait inside the collective's operator, where a slow link keeps the calling
thread (gloo); the other ranks of that collective wait for this one inside theirs, as they
would for a slow peer (on NCCL, inside the kernel). On a GPU the delayed rank's own kernel
is launched late, which leaves its GPU idle rather than communicating: there the other ranks
see the delay (`netdelay:rank=R`).
"""

from __future__ import annotations

import math
import os
import signal
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from tessel.errors import TesselError


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int | None = None
    step: int | None = None
    batch: int | None = None
    scale: float = 1.0
    seconds: float = 0.0
    attempts: int | None = None


GRAMMAR: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    # kind: (the keys it needs, the keys it may have); any other key is refused
    "spike": (("batch", "scale"), ()),
    "nan": (("batch",), ()),
    "kill": (("step",), ("rank",)),
    "hang": (("step",), ("rank",)),
    "killsync": (("step",), ("rank",)),
    "term": (("step",), ("rank",)),
    "slow": (("seconds",), ("rank", "step", "attempts")),
    "netdelay": (("seconds",), ("rank",)),
}
MAX_SECONDS = 86400.0
"""The longest `slow`/`netdelay` wait (a day; a rank that never returns is `hang`)."""


def parse_faults(spec: str, world_size: int | None = None, steps: int | None = None) -> list[Fault]:
    """The faults of a TESSEL_FAULT value, each checked against its kind's grammar (GRAMMAR):
    every key it needs and none it would ignore, whole numbers >= 0 for rank, step, batch and attempts,
    finite numbers for scale and seconds (a wait above 0); `world_size`: ranks below it;
    `steps` (train.steps): steps the run reaches. A fault that could never fire is refused
    in one line (TesselError), as is one that would fail inside the run."""
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, *fields = item.split(":")
        if kind not in GRAMMAR:
            raise TesselError(f"TESSEL_FAULT: unknown fault {kind!r} in {item!r}; use "
                              f"{', '.join(GRAMMAR)}")
        needs, may = GRAMMAR[kind]
        args: dict[str, float | int] = {}
        for f in fields:
            key, _, value = f.partition("=")
            if key not in (*needs, *may) or not value or key in args:
                raise TesselError(f"TESSEL_FAULT: bad field {f!r} in {item!r}; {kind} takes "
                                  f"{_keys(needs, may)}, each once")
            args[key] = _number(key, value, item)
        missing = [k for k in needs if k not in args]
        if missing:
            raise TesselError(f"TESSEL_FAULT: {item!r} does nothing without {missing[0]}=; "
                              f"{kind} takes {_keys(needs, may)}")
        fault = Fault(kind, **args)  # type: ignore[arg-type]
        _check_reach(fault, item, world_size, steps)
        faults.append(fault)
    return faults


def _keys(needs: tuple[str, ...], may: tuple[str, ...]) -> str:
    return " ".join([*(f"{k}=" for k in needs), *(f"[{k}=]" for k in may)])


def _number(key: str, value: str, item: str) -> float | int:
    """One field's value: a whole number >= 0 (rank, step, batch, attempts), a finite number
    >= 0 (scale), or a wait in seconds above 0 and at most MAX_SECONDS."""
    try:
        number: float | int = float(value) if key in ("scale", "seconds") else int(value)
    except ValueError:
        number = -1.0
    if key == "seconds" and not 0 < number <= MAX_SECONDS:
        raise TesselError(f"TESSEL_FAULT: bad value in {item!r}: seconds must be a number above "
                          f"0 and at most {MAX_SECONDS:g} (a day), e.g. seconds=0.1")
    if not 0 <= number < math.inf:  # also NaN
        kind = "a number" if key == "scale" else "a whole number"
        raise TesselError(f"TESSEL_FAULT: bad value in {item!r}: {key} must be {kind} >= 0, "
                          f"e.g. {key}=3")
    return number


def _check_reach(fault: Fault, item: str, world_size: int | None, steps: int | None) -> None:
    """Refuse a fault that would never fire in this run (a spike of scale 1 included)."""
    if fault.kind == "spike" and fault.scale == 1:
        raise TesselError(f"TESSEL_FAULT: {item!r} does nothing (scale=1 leaves the loss as "
                          "it is); use e.g. scale=1000")
    if world_size is not None and fault.rank is not None and fault.rank >= world_size:
        raise TesselError(f"TESSEL_FAULT: {item!r} names rank {fault.rank}, but the run has "
                          f"{world_size} process{'es' if world_size > 1 else ''} (ranks 0 to "
                          f"{world_size - 1}); name one of them")
    if fault.attempts == 0:
        raise TesselError(f"TESSEL_FAULT: {item!r} never fires: attempts=N slows the job's "
                          "first N attempts; use attempts=1 or more")
    if steps is not None and fault.step is not None and fault.step >= steps:
        raise TesselError(f"TESSEL_FAULT: {item!r} never fires: step=N fires once N steps are "
                          f"done, and the run ends at train.steps={steps}; use a step below "
                          f"{steps}")


def attempt() -> int:
    """How many attempts of this job came before this one: torchrun's restarts of its workers
    plus SLURM's requeues of the job (each requeue starts torchrun afresh at restart 0)."""
    count = 0
    for name in ("TORCHELASTIC_RESTART_COUNT", "SLURM_RESTART_COUNT"):
        value = os.environ.get(name, "0")
        count += int(value) if value.isdigit() else 0
    return count


def check_faults(world_size: int, steps: int) -> None:
    """Refuse a bad TESSEL_FAULT of this environment (one line, TesselError) before a run
    starts: what every rank of a `world_size`-process run of `steps` steps would refuse."""
    parse_faults(os.environ.get("TESSEL_FAULT", ""), world_size, steps)


class Faults:
    def __init__(self, rank: int, spec: str | None = None, world_size: int | None = None,
                 steps: int | None = None):
        """`spec`: TESSEL_FAULT's value (default: the environment's), checked as `parse_faults`
        checks it; ranks against `world_size` in the first attempt only (a restarted elastic
        job may have fewer processes, and `kill` fires in the first attempt alone)."""
        self.rank = rank
        self.attempt = attempt()
        self.faults = parse_faults(spec if spec is not None else os.environ.get("TESSEL_FAULT", ""),
                                   world_size if self.first_attempt else None, steps)
        self._delay: Any = None  # the netdelay kernels' registration while it is on

    @property
    def first_attempt(self) -> bool:
        return self.attempt == 0

    def at_step(self, step: int) -> None:
        if self._delay is None:
            seconds = sum(f.seconds for f in self.faults
                          if f.kind == "netdelay" and f.rank in (None, self.rank))
            self._delay = delay_collectives(seconds) if seconds > 0 else False
        for f in self.faults:
            if f.kind == "slow":
                if (f.rank in (None, self.rank) and (f.step is None or step >= f.step)
                        and (f.attempts is None or self.attempt < f.attempts)):
                    time.sleep(f.seconds)
                continue
            if f.step != step or (f.rank is not None and f.rank != self.rank):
                continue
            if f.kind == "kill" and self.first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)
            if f.kind == "term" and self.first_attempt:
                os.kill(os.getpid(), signal.SIGTERM)  # as a scheduler's preemption notice
            if f.kind == "hang":
                while True:
                    time.sleep(3600)

    def at_replica_allreduce(self, step: int) -> None:
        """Where a replica group enters the step's all-reduce over the groups (`step`: as
        `at_step`'s, the steps done)."""
        for f in self.faults:
            if (f.kind == "killsync" and f.step == step and f.rank in (None, self.rank)
                    and self.first_attempt):
                time.sleep(1.0)  # its peers are in the all-reduce by then, waiting for it
                os.kill(os.getpid(), signal.SIGKILL)

    def loss_factor(self, batch: int) -> float:
        """What the loss of global batch `batch` is multiplied by (1.0: untouched)."""
        factor = 1.0
        for f in self.faults:
            if f.batch == batch and f.kind == "spike":
                factor *= f.scale
            elif f.batch == batch and f.kind == "nan":
                factor = float("nan")
        return factor

    def close(self) -> None:
        """Take the netdelay kernels away (the process may train again without them)."""
        if self._delay:
            self._delay._destroy()
        self._delay = None


def delay_collectives(seconds: float) -> torch.library.Library:
    """Every `c10d::` collective of this process waits `seconds` before it runs, inside
    its operator (see the module docstring); until the returned registration is destroyed.
    The kernel sits at the ADInplaceOrView key, which every call of a training tensor passes
    through, whether it comes from Python, from C++ (DDP's reducer) or from inside a
    functional collective's kernel; it then hands the call on to the backend's kernel."""
    lib = torch.library.Library("c10d", "IMPL")
    nested = threading.local()  # a collective issued inside another waits once

    def kernel_for(op: Any) -> Any:
        def delayed(keyset: Any, *args: Any, **kwargs: Any) -> Any:
            outer = getattr(nested, "inside", False)
            if not outer:
                time.sleep(seconds)
            nested.inside = True
            try:
                return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args,
                                     **kwargs)
            finally:
                nested.inside = outer
        return delayed

    for qualified in torch._C._dispatch_get_all_op_names():
        ns, _, name = qualified.partition("::")
        if ns == "c10d" and name != "check_for_nan":
            lib.impl(name, kernel_for(getattr(torch.ops.c10d, name).default), "ADInplaceOrView",
                     with_keyset=True)
    return lib
