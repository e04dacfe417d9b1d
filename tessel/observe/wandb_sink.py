"""Optional Weights & Biases sink (metrics.wandb = true; rank 0 only).

wandb is not a dependency of tessel: it is imported only when this sink is built, and a
missing package is a one-line config error. Offline mode needs no network; the files land
in RUN_DIR/wandb and `wandb sync` uploads them later.
"""

from __future__ import annotations

import importlib
import uuid
from pathlib import Path
from typing import Any

from tessel.errors import TesselError
from tessel.observe.secrets import redact_config

MODES = ("online", "offline")
# Where the W&B run id of a tessel run is kept, so `tessel train --resume` continues the same
# W&B run instead of starting a new one per restart.
_ID_FILE = Path("wandb") / "tessel-run-id"


class WandbSink:
    """Logs each metrics record's numeric fields to one W&B run, at the record's step.

    `config` (the resolved tessel config, as a dict) becomes the W&B run config after
    `redact_config`, so webhook URLs' paths, passwords and tokens never leave the machine.
    """

    def __init__(self, run_dir: Path, project: str, name: str | None, mode: str, config: dict[str, Any]):
        if mode not in MODES:
            raise TesselError(f"metrics.wandb_mode={mode!r} is not one of {list(MODES)}")
        try:
            wandb = importlib.import_module("wandb")
        except ImportError:
            raise TesselError(
                "metrics.wandb = true needs the wandb package: pip install wandb "
                "(or set metrics.wandb = false)"
            ) from None
        run_dir = Path(run_dir)
        id_file = run_dir / _ID_FILE
        if id_file.is_file():
            run_id = id_file.read_text().strip()
        else:
            # W&B ids are short lowercase alphanumerics; 8 hex digits are as unique as theirs.
            run_id = uuid.uuid4().hex[:8]
            id_file.parent.mkdir(parents=True, exist_ok=True)
            id_file.write_text(run_id + "\n")
        try:
            self._run = wandb.init(
                project=project,
                name=name,
                mode=mode,
                dir=str(run_dir),
                config=redact_config(config),
                id=run_id,
                resume="allow",
            )
        except Exception as e:  # wandb's errors (no API key, no network) as one line
            if mode == "online":
                hint = 'run `wandb login`, or set metrics.wandb_mode = "offline"'
            else:
                hint = "set metrics.wandb = false to train without it"
            raise TesselError(
                f"wandb.init failed ({type(e).__name__}: {' '.join(str(e).split())}); {hint}"
            ) from None

    def write(self, record: dict[str, Any]) -> None:
        """Log the record's numeric fields (not bools, None or strings) at step record["step"]."""
        data = {
            k: v
            for k, v in record.items()
            if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)
        }
        if data:
            self._run.log(data, step=int(record["step"]))

    def close(self) -> None:
        """Finish the W&B run (flushes it; in offline mode, writes the files to sync). Idempotent."""
        if self._run is not None:
            self._run.finish()
            self._run = None
