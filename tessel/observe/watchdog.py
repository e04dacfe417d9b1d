"""Hang watchdog: no progress for `timeout_s` -> every rank dumps its Python stacks to
RUN_DIR/watchdog/ and the job ends with a message naming the stuck rank when it can.

Each rank runs one daemon thread. The trainer reports progress (`beat`) at every step,
evaluation batch and checkpoint, and says what it is doing (`phase`), naming its own
collectives ("collective: ..."). When the watchdog fires, each rank writes
`rank{R}.txt` (all its threads' stacks, from faulthandler) and `rank{R}.json` (step, phase,
whether it waits in a collective). Rank 0 reads the others' files for a few seconds and
names the ranks that are behind or not inside a collective: in a hang, the healthy ranks
wait in a collective for the one that does not arrive. A hang that holds the GIL (a stuck C
call) stops Python threads too; faulthandler's own C-level timer then still dumps the
stacks and ends the process.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO

EXIT_CODE = 3  # as for a collective timeout: the job hung
_GRACE_S = 30.0  # the C-level backstop fires this long after the Python watchdog should have


class Watchdog:
    def __init__(self, timeout_s: float, directory: Path, rank: int, world_size: int,
                 on_wait: Callable[[float, int], None] | None = None,
                 on_fire: Callable[[str, int], None] | None = None):
        self.timeout_s = timeout_s
        self.dir = directory  # where each rank's stacks go (RunDir.watchdog)
        self.rank, self.world = rank, world_size
        self.on_wait = on_wait  # called each poll with (seconds without progress, step)
        self.on_fire = on_fire  # rank 0: (message, step), before the process ends
        self.step = 0
        self._phase = "starting"
        self._last = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._backstop: IO[str] | None = None

    # ---- what the trainer calls ----------------------------------------------------------

    def beat(self, step: int, phase: str) -> None:
        """Progress: `step` is under way, now doing `phase`."""
        self.step, self._phase, self._last = step, phase, time.monotonic()
        if self._backstop is not None:
            faulthandler.dump_traceback_later(self.timeout_s + _GRACE_S, exit=True, file=self._backstop)

    def phase(self, phase: str) -> None:
        """What this rank does now, without counting as progress."""
        self._phase = phase

    def start(self) -> None:
        """Start watching: with a timeout, and/or to call `on_wait` (stall alerts)."""
        if (self.timeout_s <= 0 and self.on_wait is None) or self._thread is not None:
            return
        if self.timeout_s > 0:
            self.dir.mkdir(parents=True, exist_ok=True)
            self._backstop = open(self.dir / f"rank{self.rank}.backstop.txt", "w")  # noqa: SIM115
        self._last = time.monotonic()
        self.beat(self.step, self._phase)
        self._thread = threading.Thread(target=self._run, name="tessel-watchdog", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._backstop is not None:
            faulthandler.cancel_dump_traceback_later()
            self._backstop.close()
            self._backstop = None
            try:
                # Empty unless the backstop fired; nothing to keep then.
                path = self.dir / f"rank{self.rank}.backstop.txt"
                if path.stat().st_size == 0:
                    path.unlink()
                self.dir.rmdir()  # only if nothing else is in it
            except OSError:
                pass

    # ---- the thread ------------------------------------------------------------------------

    def _run(self) -> None:
        poll = min(1.0, self.timeout_s / 10) if self.timeout_s > 0 else 1.0
        while not self._stop.wait(poll):
            idle = time.monotonic() - self._last
            if self.on_wait is not None:
                try:
                    self.on_wait(idle, self.step)
                except Exception:  # noqa: BLE001 - a notification problem must not kill the watchdog
                    pass
            if 0 < self.timeout_s <= idle:
                self._fire(idle)
                return

    def _fire(self, idle: float) -> None:
        me = {"rank": self.rank, "step": self.step, "phase": self._phase,
              "in_collective": self._phase.startswith("collective"), "idle_s": round(idle, 1)}
        with open(self.dir / f"rank{self.rank}.txt", "w") as f:
            f.write(f"rank {self.rank}: no progress for {idle:.0f}s at step {self.step}, "
                    f"in {self._phase}\n\n")
            f.flush()
            faulthandler.dump_traceback(f, all_threads=True)
        (self.dir / f"rank{self.rank}.json").write_text(json.dumps(me))
        if self.rank == 0:
            message = self._summary(self._gather(me))
            if self.on_fire is not None:
                try:
                    self.on_fire(message, self.step)
                except Exception:  # noqa: BLE001 - the exit below matters more
                    pass
            print(f"tessel: error: {message}", file=sys.stderr, flush=True)
        else:
            # Let rank 0 read this rank's file and speak first; torchrun ends the rest.
            time.sleep(min(15.0, self.timeout_s))
        sys.stdout.flush()
        os._exit(EXIT_CODE)

    def _gather(self, me: dict) -> list[dict]:
        deadline = time.monotonic() + min(10.0, max(2.0, self.timeout_s))
        found: dict[int, dict] = {0: me}
        while time.monotonic() < deadline and len(found) < self.world:
            for r in range(1, self.world):
                path = self.dir / f"rank{r}.json"
                if r not in found and path.is_file():
                    try:
                        found[r] = json.loads(path.read_text())
                    except (OSError, json.JSONDecodeError):
                        pass  # being written; next poll
            time.sleep(0.2)
        return [found.get(r, {"rank": r, "missing": True}) for r in range(self.world)]

    def _summary(self, ranks: list[dict]) -> str:
        idle = ranks[0]["idle_s"]
        head = f"watchdog: no progress for {idle:.0f}s (watchdog.timeout_s={self.timeout_s:g})"
        where = f"stacks of every rank in {self.dir}"
        if self.world == 1:
            return f"{head} at step {ranks[0]['step']} in {ranks[0]['phase']}; {where}"
        known = [r for r in ranks if not r.get("missing")]
        low = min(r["step"] for r in known)
        stuck = [r for r in known if not r["in_collective"] or r["step"] < max(k["step"] for k in known)]
        stuck = [r for r in stuck if r["step"] == low] or stuck
        waiting = [r for r in known if r not in stuck]
        silent = [r["rank"] for r in ranks if r.get("missing")]
        parts = [head]
        if stuck:
            parts.append("stuck: " + ", ".join(
                f"rank {r['rank']} (step {r['step']}, in {r['phase']})" for r in stuck))
        if waiting:
            phases = sorted({r["phase"] for r in waiting})
            parts.append(f"waiting for it in a collective: rank(s) "
                         f"{', '.join(str(r['rank']) for r in waiting)} ({'; '.join(phases)})")
        if silent:
            parts.append(f"no report from rank(s) {', '.join(map(str, silent))} (dead or holding the GIL)")
        return "; ".join(parts) + f"; {where}"
