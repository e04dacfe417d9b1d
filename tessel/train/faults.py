"""Fault injection for resilience tests and fire drills: TESSEL_FAULT in the environment.

    TESSEL_FAULT="spike:batch=7:scale=1000"   multiply the loss of global batch 7 by 1000
    TESSEL_FAULT="nan:batch=7"                make the loss of global batch 7 NaN
    TESSEL_FAULT="kill:rank=1:step=5"         SIGKILL rank 1 when step 5 starts (first attempt only)
    TESSEL_FAULT="hang:rank=1:step=3"         rank 1 sleeps forever when step 3 starts
    TESSEL_FAULT="killsync:step=3"            once 3 steps are done, SIGKILL this process
                                              as it enters the next step's all-reduce over
                                              the replica groups ([fault_tolerance]): it
                                              took part in that step's quorum, so its peers
                                              are in theirs
    TESSEL_FAULT="slow:seconds=0.1"           every step starts 0.1 s late (a slow machine;
                                              the losses are unchanged; step=N: from step N on)
    TESSEL_FAULT="netdelay:seconds=0.05"      every collective of the process (from the first
                                              step on) starts 0.05 s late: a slow network; the
                                              losses are unchanged (rank=R: that rank only)

Several faults are separated by ";". A fault keyed by batch follows the data, not the step:
once a rollback skips that batch it never fires again, as a corrupted sample would behave.
`kill` fires only in the first attempt of a torchrun job (TORCHELASTIC_RESTART_COUNT 0), so
the restarted job can finish. Unset, nothing here does anything.

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


def parse_faults(spec: str) -> list[Fault]:
    faults = []
    for item in filter(None, (s.strip() for s in spec.split(";"))):
        kind, *fields = item.split(":")
        if kind not in ("spike", "nan", "kill", "hang", "slow", "netdelay", "killsync"):
            raise TesselError(f"TESSEL_FAULT: unknown fault {kind!r}; use spike, nan, kill, hang, "
                              "slow, netdelay or killsync")
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
        self._delay: Any = None  # the netdelay kernels' registration while it is on

    def at_step(self, step: int) -> None:
        if self._delay is None:
            seconds = sum(f.seconds for f in self.faults
                          if f.kind == "netdelay" and f.rank in (None, self.rank))
            self._delay = delay_collectives(seconds) if seconds > 0 else False
        for f in self.faults:
            if f.kind == "slow":
                if f.rank in (None, self.rank) and (f.step is None or step >= f.step):
                    time.sleep(f.seconds)
                continue
            if f.step != step or (f.rank is not None and f.rank != self.rank):
                continue
            if f.kind == "kill" and self.first_attempt:
                os.kill(os.getpid(), signal.SIGKILL)
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
