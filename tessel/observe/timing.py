"""Where a step's time goes: data wait, compute (forward + backward), optimizer.

On a GPU the phases are CUDA events on the compute stream, read only at log steps (reading
them there costs no extra synchronisation; recording them costs none either), so the split
is the GPU timeline's and sums to the step time. On a CPU everything is synchronous and
host clocks are exact.
"""

from __future__ import annotations

import time

import torch

PHASES = ("data", "compute", "optimizer")


class PhaseTimer:
    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self._marks: list[tuple[str, object]] = []  # (phase that starts here, time or event)
        self._totals = dict.fromkeys(PHASES, 0.0)

    def _now(self) -> object:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def start(self, phase: str) -> None:
        """`phase` begins now (and the previous one ends)."""
        self._marks.append((phase, self._now()))

    def end(self) -> None:
        """The last phase of the step ends now."""
        self._marks.append(("", self._now()))
        self._fold()

    def _fold(self) -> None:
        if not self.cuda:
            for (phase, t0), (_, t1) in zip(self._marks, self._marks[1:]):
                if phase:
                    self._totals[phase] += t1 - t0  # type: ignore[operator]
            self._marks.clear()

    def window(self) -> dict[str, float]:
        """Seconds per phase since the last call (waits for the GPU's events)."""
        if self.cuda and self._marks:
            self._marks[-1][1].synchronize()  # type: ignore[attr-defined]
            for (phase, e0), (_, e1) in zip(self._marks, self._marks[1:]):
                if phase:
                    self._totals[phase] += e0.elapsed_time(e1) / 1000  # type: ignore[attr-defined]
            self._marks.clear()
        out, self._totals = self._totals, dict.fromkeys(PHASES, 0.0)
        return out

    def discard(self) -> None:
        """Forget the current window (time spent evaluating or saving is not a step's)."""
        self._marks.clear()
        self._totals = dict.fromkeys(PHASES, 0.0)
