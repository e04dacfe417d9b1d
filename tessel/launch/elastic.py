"""Elastic world size: what changes, and what may not, when a run restarts on another number
of nodes (`--nnodes MIN:MAX`, tessel/launch/rendezvous.py).

Kept: the global batch (train.global_batch_size sequences per optimizer step) and with it the
learning-rate schedule (a function of the step) and the data order (the loader's position is
a count of samples in the one global order, whatever the data-parallel size). Re-planned: the
split of the global batch into micro-batches and accumulation steps for the data-parallel
size found, `micro_batch_for`; the trainer then checks memory for it as for any start. The
checkpoint reshards on load (torch.distributed.checkpoint).

Refused at launch (`check_node_counts`): a layout whose fixed degrees (tp, pp, cp, ep,
dp_replicate) do not fit every node count of MIN:MAX, in one line naming the counts that fit
(found arithmetically, so that a range of a billion counts is answered at once).
"""

from __future__ import annotations

import os
from collections.abc import Callable

from tessel.config import Config
from tessel.errors import TesselError
from tessel.launch.rendezvous import ELASTIC_ENV
from tessel.parallel.dims import ParallelDims


def micro_batch_for(global_batch: int, micro_batch: int, dp: int) -> int | None:
    """The largest micro-batch <= `micro_batch` that splits a data-parallel rank's share of the
    global batch evenly (so that accumulation = global / (micro x dp) is whole), or None when
    `dp` does not divide the global batch."""
    if global_batch % dp:
        return None
    share = global_batch // dp
    return next(m for m in range(min(micro_batch, share), 0, -1) if share % m == 0)


def replan(cfg: Config, dims: ParallelDims) -> tuple[Config, str | None]:
    """`cfg` with train.micro_batch_size re-planned for `dims.dp` when the configured one does
    not split the global batch there (the global batch is kept), and the line that says so."""
    t = cfg.train
    mbs = micro_batch_for(t.global_batch_size, t.micro_batch_size, dims.dp)
    if mbs is None:
        raise TesselError(
            f"train.global_batch_size={t.global_batch_size} cannot be split over {dims.dp} "
            f"data-parallel ranks ({dims.world_size} processes); use a global batch that "
            "every allowed node count divides")
    if mbs == t.micro_batch_size:
        return cfg, None
    accum = t.global_batch_size // (mbs * dims.dp)
    note = (f"tessel: elastic: {dims.world_size} processes, dp={dims.dp}: micro-batch "
            f"{t.micro_batch_size} -> {mbs}, accumulation {accum}, global batch "
            f"{t.global_batch_size} kept")
    return cfg.with_overrides({"train.micro_batch_size": mbs}), note


def replan_if_elastic(cfg: Config, dims: ParallelDims, say: Callable[[str], None]) -> Config:
    """In a worker of an elastic run (ELASTIC_ENV set by the launcher), `cfg` re-planned for
    the world it found (`replan`); elsewhere `cfg` unchanged: a fixed-size run keeps refusing a
    micro-batch that does not split its global batch, as the user asked for that split."""
    if not os.environ.get(ELASTIC_ENV):
        return cfg
    cfg, note = replan(cfg, dims)
    if note:
        say(note)
    return cfg


def fits(cfg: Config, world: int) -> str | None:
    """Why `cfg`'s layout cannot run on `world` processes (with the micro-batch re-planned),
    or None when it can."""
    try:
        dims = ParallelDims.from_config(cfg.parallel, world)
        replanned, _ = replan(cfg, dims)
        dims.validate(replanned)
    except TesselError as exc:
        return str(exc)
    return None


def _divisors(n: int) -> list[int]:
    small = [d for d in range(1, int(n ** 0.5) + 1) if n % d == 0]
    return sorted({*small, *(n // d for d in small)})


def candidate_counts(cfg: Config, nproc: int, counts: range) -> list[int]:
    """The node counts of `counts` that may fit `cfg`'s layout, found arithmetically (a range
    may be 1:1000000000): the data-parallel size is the world over cp x tp x pp, and it must
    divide the global batch, so a world that fits is a divisor of the global batch times
    cp x tp x pp. Every other count fails `fits`."""
    p = cfg.parallel
    per_dp = p.cp * p.tp * p.pp
    worlds = (d * per_dp for d in _divisors(cfg.train.global_batch_size))
    return sorted({w // nproc for w in worlds if w % nproc == 0 and w // nproc in counts})


def check_node_counts(cfg: Config, nproc: int, counts: range, flag: str = "--nnodes") -> None:
    """Refuse, in one line, a layout that does not fit every node count of `counts` (nodes of
    `nproc` processes), naming the counts it fits; `flag` is the option the user gave the
    range with (`tessel launch` calls it --nodes)."""
    good = [n for n in candidate_counts(cfg, nproc, counts) if fits(cfg, n * nproc) is None]
    if len(good) == len(counts):
        return
    # the first count that does not fit: at most len(good) + 1 counts from the start
    first = next(n for n in counts if n not in good)
    span = f"{counts.start}:{counts.stop - 1}"
    shown = ", ".join(map(str, good[:20])) + (f" (and {len(good) - 20} more)"
                                                if len(good) > 20 else "")
    allowed = (f"node counts allowed for this layout in {span}: {shown}" if good else
               f"no node count in {span} fits this layout")
    raise TesselError(f"{flag} {span}: the layout cannot run on {first} node(s) x {nproc} "
                      f"processes ({fits(cfg, first * nproc)}); {allowed}; narrow {flag} or "
                      "change the parallel degrees")
