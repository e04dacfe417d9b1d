"""Micro-batches in flight on each pipeline rank: how many micro-batches' activations a
rank holds at its peak under each schedule, from PyTorch's own action order where it can be
built, else from a formula."""

from __future__ import annotations

import functools
from types import SimpleNamespace

from tessel.planner.layout import Layout

MAX_SIMULATED_CHUNKS = 128  # longer schedules use in_flight's formula
ZERO_BUBBLE_MEMORY = 1.75  # in-flight chunks over the warm-up count (see in_flight)


def in_flight(layout: Layout, rank: int, micro_batches: int) -> float:
    """Micro-batches whose activations pipeline rank `rank` holds at its peak, in units of
    all its layers (an interleaved chunk is 1/v of them)."""
    pp, v = layout.pp, layout.pp_virtual_stages
    if pp == 1:
        return 1.0
    if layout.pp_schedule == "gpipe":
        return float(micro_batches)
    if layout.pp_schedule == "1f1b":
        return float(min(pp - rank, micro_batches))
    # PyTorch's interleaved schedules: warm-up forwards before the first backward.
    rounds = max(1, micro_batches // pp)
    per_round = micro_batches // rounds
    zero_bubble = layout.pp_schedule == "zero-bubble"
    factor = 1 if zero_bubble else 2
    warmup = min((v - 1) * per_round + factor * (pp - 1 - rank), micro_batches * v)
    chunks = min(warmup + 1, micro_batches * v)
    if zero_bubble:
        # Deferred weight gradients keep each graph until its weight pass, and the last
        # stage's loss graphs until the step ends: measured up to 70% above the warm-up
        # count with pp = 2. A rough bound; the search does not propose zero-bubble.
        chunks = min(chunks * ZERO_BUBBLE_MEMORY, micro_batches * v)
    return chunks / v


def pipeline_order(layout: Layout, rank: int, micro_batches: int) -> list[tuple[str, int]] | None:
    """(action, stage) of pipeline rank `rank` in PyTorch's own interleaved schedule: F
    forward, B full backward, I input-gradient and W weight-gradient passes. None where
    PyTorch does not expose it (its schedules are built from stage objects; the few
    attributes they read are given here), and then `in_flight`'s formula is used."""
    if layout.pp == 1 or layout.pp_schedule in ("gpipe", "1f1b"):
        return None
    if micro_batches * layout.pp_virtual_stages > MAX_SIMULATED_CHUNKS:
        return None  # building PyTorch's order takes too long for a search; the formula
    return _pipeline_order(layout.pp, layout.pp_virtual_stages, layout.pp_schedule, rank,
                           micro_batches)


@functools.lru_cache(maxsize=4096)
def _pipeline_order(pp: int, v: int, schedule_name: str, rank: int, micro_batches: int
                    ) -> list[tuple[str, int]] | None:
    try:
        import torch
        from torch.distributed.pipelining import schedules

        base = (schedules.ScheduleInterleavedZeroBubble if schedule_name == "zero-bubble"
                else schedules.ScheduleInterleaved1F1B)

        class OrderOnly(base):  # type: ignore[misc, valid-type]
            """Only the computation order is read: adding the send/receive actions (most
            of the construction time, 0.3 s for pp 16) is skipped."""

            def _prepare_schedule_with_comms(self, *args: object, **kwargs: object) -> None:
                pass

        n = pp * v
        stages = [SimpleNamespace(num_stages=n, group_size=pp, group_rank=rank,
                                  stage_index=s, is_first=s == 0, is_last=s == n - 1,
                                  submod=torch.nn.Module())
                  for s in range(rank, n, pp)]
        schedule = OrderOnly(stages, n_microbatches=micro_batches,
                             loss_fn=lambda out, target: out)
        order = [str(a) for a in schedule.pipeline_order[rank] if a is not None]
    except Exception:  # a PyTorch version that builds its schedules differently
        return None
    out = []
    for action in order:
        head = action.rstrip("0123456789")
        kind = head.lstrip("0123456789")
        out.append((kind, int(head[: len(head) - len(kind)])))
    return out


def peak_in_flight(order: list[tuple[str, int]], chunk_bytes: dict[int, float]) -> float:
    """The most bytes held at once when each forward adds its stage's chunk and each full
    or weight-gradient backward releases one (an input-gradient pass keeps the graph)."""
    held = peak = 0.0
    for kind, stage in order:
        if kind == "F":
            held += chunk_bytes[stage]
            peak = max(peak, held)
        elif kind in ("B", "W"):
            held -= chunk_bytes[stage]
    return peak
