"""The single-process training loop.

`Trainer(cfg).train()` runs a whole job: checks the run directory, builds data, model and
optimizer, trains with gradient accumulation and mixed precision, evaluates, logs, saves
atomic checkpoints (periodically, at the end and on SIGTERM/SIGINT) and resumes from them
bit-exactly.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tessel.checkpoint import (
    CheckpointError,
    latest_checkpoint,
    load_model,
    load_optimizer,
    read_state,
    read_tensors,
    save_checkpoint,
)
from tessel.config import Config
from tessel.data import Batch, build_data, load_tokenizer
from tessel.errors import DataError, TesselError
from tessel.fileio import write_text_atomic
from tessel.generate import sample
from tessel.models import build_model, flops_per_token, param_count
from tessel.observe.console import ConsoleDisplay
from tessel.observe.metrics import MetricsWriter
from tessel.observe.mfu import device_peak_flops
from tessel.train.loss import token_loss_sum
from tessel.train.optim import build_optimizer, lr_at
from tessel.train.precision import resolve_precision

# Changing these on resume would silently change what the checkpoint means.
# (Mixture weights and cache locations may change; the loader checks the datasets themselves.)
_FROZEN_ON_RESUME = (
    "model", "data.source", "data.tokenizer", "data.split", "data.json_key", "train.seq_len",
    "train.seed",
)


@dataclass
class TrainResult:
    step: int
    """Optimizer steps completed."""
    loss: float | None
    """Training loss of the last step."""
    val_loss: float | None
    """Validation loss of the last evaluation."""
    unigram_baseline: float
    """Validation loss of a context-free unigram model, for comparison."""
    stopped_by: str | None
    """Signal name when training stopped early (SIGTERM/SIGINT), else None."""
    run_dir: Path

    @property
    def exit_code(self) -> int:
        return 130 if self.stopped_by == "SIGINT" else 0


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise TesselError("train.device='cuda' but no CUDA device is visible; use 'auto' or 'cpu'")
    return torch.device(name)


class Trainer:
    def __init__(self, cfg: Config, resume: bool = False, console: bool = True):
        self.cfg = cfg
        self.run_dir = Path(cfg.run.dir)
        self.ckpt_root = self.run_dir / "checkpoints"
        self.display = ConsoleDisplay(cfg.train.steps, enabled=console)

        # Everything that can reject the input happens before anything is written.
        resume_from = self._check_run_dir(resume)
        self.device = pick_device(cfg.train.device)
        self.peak_flops = device_peak_flops(self.device)
        self.precision = resolve_precision(cfg.train.precision, self.device)
        self.data = build_data(cfg, console=self.display.print)
        self.tokenizer = self.data.tokenizer
        if resume_from is not None:
            self._check_tokenizer()

        torch.manual_seed(cfg.train.seed)
        self.model = build_model(cfg.model, self.device, seed=cfg.train.seed)
        if cfg.train.compile:
            # Regional compilation: one graph per block keeps start-up short and the
            # parameter names (and so the checkpoints) unchanged.
            for block in self.model.layers.values():
                block.compile()
        self.optimizer = build_optimizer(self.model, cfg.optim, self.device)
        self.accum = cfg.train.global_batch_size // (
            cfg.train.micro_batch_size * cfg.parallel.dp_size
        )
        self.step = 0
        self.tokens_seen = 0
        self.elapsed_prev = 0.0
        self.last_saved_step = -1
        self.last_val_loss: float | None = None
        if resume_from is not None:
            self._restore(*resume_from)
        self._stop_signal: int | None = None

    # ---- setup ----------------------------------------------------------------------------

    def _check_run_dir(self, resume: bool) -> tuple[Path, dict[str, Any]] | None:
        """Refuse to overwrite a run, or to resume one incompatibly; returns the checkpoint
        to resume from and its state."""
        holds_run = (self.run_dir / "config.toml").exists() or self.ckpt_root.exists()
        if not resume:
            if holds_run:
                raise TesselError(
                    f"{str(self.run_dir)!r} already holds a run; continue it with "
                    f"`tessel train --resume {self.run_dir}` or choose another --run.dir"
                )
            return None
        if not holds_run:
            raise CheckpointError(f"nothing to resume: {str(self.run_dir)!r} holds no run")
        ckpt = latest_checkpoint(self.ckpt_root)
        if ckpt is None:  # stopped before its first checkpoint: start it again from step 0
            self.display.print(f"tessel: {self.run_dir} has no checkpoint yet; starting from step 0")
            return None
        state = read_state(ckpt)
        try:
            then = Config.from_dict(state["config"])
        except KeyError:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks its config; it is damaged") from None
        for key in _FROZEN_ON_RESUME:
            old, new = _get(then, key), _get(self.cfg, key)
            if old != new:
                diff = _first_difference(key, old, new)
                raise CheckpointError(
                    f"cannot resume {str(self.run_dir)!r}: {diff}; resume without changing it "
                    f"or start a new run"
                )
        return ckpt, state

    def _check_tokenizer(self) -> None:
        saved = load_tokenizer(self.run_dir / "tokenizer.json")
        if saved.fingerprint() != self.tokenizer.fingerprint():
            raise DataError(
                f"the data's tokenizer differs from the one {str(self.run_dir)!r} was trained "
                "with; resume with the data the run was started with"
            )

    def _restore(self, ckpt: Path, state: dict[str, Any]) -> None:
        load_model(ckpt, self.model)
        load_optimizer(ckpt, self.model, self.optimizer)
        try:
            self.data.train.load_state_dict(state["loader"])
            if self.precision.scaler is not None and state.get("scaler"):
                self.precision.scaler.load_state_dict(state["scaler"])
            rng = read_tensors(ckpt, "rng.safetensors")
            torch.set_rng_state(rng["torch_cpu"])
            if self.device.type == "cuda" and "torch_cuda" in rng:
                torch.cuda.set_rng_state(rng["torch_cuda"], self.device)
            self.step = self.last_saved_step = int(state["step"])
            self.tokens_seen = int(state["tokens_seen"])
        except KeyError as exc:
            raise CheckpointError(f"checkpoint {str(ckpt)!r} lacks {exc}; it is damaged") from None
        self.elapsed_prev = float(state.get("elapsed_s", 0.0))
        self.last_val_loss = state.get("val_loss")

    # ---- the loop -------------------------------------------------------------------------

    def train(self) -> TrainResult:
        cfg, t = self.cfg, self.cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        if self.step >= t.steps:
            self.display.print(
                f"{self.run_dir} is already at step {self.step} of train.steps={t.steps}; "
                f"pass --train.steps=N with N > {self.step} to train further"
            )
            return self._result(None, None)
        # Written only now that the run really starts: a refused or no-op call leaves the
        # run directory as it was.
        self.run_dir.mkdir(parents=True, exist_ok=True)
        write_text_atomic(self.run_dir / "config.toml", cfg.to_toml())
        self.tokenizer.save(self.run_dir / "tokenizer.json")
        self._announce()
        metrics = MetricsWriter(self.run_dir, cfg.metrics.tensorboard)
        previous_handlers = self._install_signal_handlers()
        loss = grad_norm = None
        start = time.perf_counter()
        first_step = self.step
        window_start, window_steps = time.perf_counter(), 0
        self.display.start(self.step)
        self.model.train()  # evaluate() puts it back after each evaluation
        try:
            while self.step < t.steps and self._stop_signal is None:
                loss, grad_norm = self._train_step()
                self.step += 1
                self.tokens_seen += tokens_per_step
                window_steps += 1
                self.display.step(self.step)
                if self.step % cfg.metrics.log_interval == 0 or self.step == t.steps:
                    window = time.perf_counter() - window_start
                    self._log_train(metrics, loss, grad_norm, window, window_steps,
                                    elapsed=time.perf_counter() - start, first_step=first_step)
                    window_start, window_steps = time.perf_counter(), 0
                eval_now = t.eval_interval and self.step % t.eval_interval == 0
                if eval_now or self.step == t.steps:
                    self._log_eval(metrics, start)
                    window_start, window_steps = time.perf_counter(), 0
                if cfg.checkpoint.interval and self.step % cfg.checkpoint.interval == 0:
                    self._save(start)
                    window_start, window_steps = time.perf_counter(), 0
            if self.step != self.last_saved_step:
                self._save(start)
        finally:
            self.display.stop()
            self._restore_signal_handlers(previous_handlers)
            metrics.close()

        stopped_by = signal.Signals(self._stop_signal).name if self._stop_signal else None
        if stopped_by:
            self.display.print(
                f"{stopped_by}: stopped at step {self.step} with a checkpoint in "
                f"{self.ckpt_root / 'latest'}; continue with `tessel train --resume {self.run_dir}`"
            )
        else:
            self._finish_message()
        return self._result(loss, stopped_by)

    def _result(self, loss: torch.Tensor | None, stopped_by: str | None) -> TrainResult:
        return TrainResult(
            step=self.step,
            loss=loss.item() if loss is not None else None,
            val_loss=self.last_val_loss,
            unigram_baseline=self.data.unigram_baseline,
            stopped_by=stopped_by,
            run_dir=self.run_dir,
        )

    def _log_train(
        self,
        metrics: MetricsWriter,
        loss: torch.Tensor,
        grad_norm: torch.Tensor,
        window: float,
        window_steps: int,
        elapsed: float,
        first_step: int,
    ) -> None:
        """One metrics line for the steps since the last one (`window` seconds)."""
        t = self.cfg.train
        tokens_per_step = t.global_batch_size * t.seq_len
        tps = window_steps * tokens_per_step / window
        rec = {
            "step": self.step,
            "loss": loss.item(),  # host syncs happen here, at log steps only
            "lr": self.optimizer.param_groups[0]["lr"],
            "grad_norm": grad_norm.item(),
            "tokens_per_s": tps,
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_prev + elapsed,
            "step_time_s": window / window_steps,
        }
        if self.peak_flops is not None:
            rec["mfu"] = flops_per_token(self.cfg.model, t.seq_len) * tps / self.peak_flops
        if self.precision.scaler is not None:
            rec["loss_scale"] = float(self.precision.scaler.get_scale())
        if self.device.type == "cuda":
            rec["mem_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        metrics.write(rec)
        eta = elapsed / (self.step - first_step) * (t.steps - self.step)
        self.display.log(rec, t.steps, eta, 100 * self.step / t.steps)

    def _train_step(self) -> tuple[torch.Tensor, torch.Tensor]:
        """One optimizer step over `accum` micro-batches; returns device tensors (no sync)."""
        cfg = self.cfg
        lr = lr_at(self.step, cfg.train.steps, cfg.optim)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        batches = [self.data.train.next_batch() for _ in range(self.accum)]
        # The loss is a mean over every target token of the step, not a mean of
        # micro-batch means, so accumulation never changes its value.
        n_tokens = sum(b.targets.numel() for b in batches)
        scaler = self.precision.scaler
        total = torch.zeros((), device=self.device)
        for batch in batches:
            x, y, docs = self._on_device(batch)
            with self.precision.autocast():
                logits = self.model(x, docs)  # (B, T, V)
            loss = token_loss_sum(logits, y) / n_tokens
            (scaler.scale(loss) if scaler is not None else loss).backward()
            total += loss.detach()
        if scaler is not None:
            scaler.unscale_(self.optimizer)
        clip = cfg.train.grad_clip if cfg.train.grad_clip > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if scaler is not None:
            scaler.step(self.optimizer)
            scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return total, grad_norm

    def _on_device(self, batch: Batch) -> tuple[torch.Tensor, ...]:
        if self.device.type != "cuda":
            return tuple(batch)
        # Pinned memory lets the copy overlap with compute (non_blocking).
        return tuple(
            t.pin_memory().to(self.device, non_blocking=True) if t is not None else None
            for t in batch
        )

    @torch.no_grad()
    def evaluate(self) -> float:
        """Token-mean cross-entropy over `train.eval_iters` validation micro-batches."""
        val = self.data.val
        assert val is not None
        val.reset()
        iters = max(1, min(self.cfg.train.eval_iters, val.n_samples // (val.mbs * val.dp_size)))
        total = torch.zeros((), device=self.device, dtype=torch.float64)
        count = 0
        self.model.eval()
        for _ in range(iters):
            x, y, docs = self._on_device(val.next_batch())
            with self.precision.autocast():
                logits = self.model(x, docs)
            total += token_loss_sum(logits, y)
            count += y.numel()
        self.model.train()
        return total.item() / count

    def _log_eval(self, metrics: MetricsWriter, start: float) -> None:
        if self.data.val is None:
            return
        val_loss = self.evaluate()
        self.last_val_loss = val_loss
        rec = {
            "step": self.step,
            "val_loss": val_loss,
            "val_ppl": math.exp(min(val_loss, 50.0)),
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_prev + time.perf_counter() - start,
        }
        metrics.write(rec)
        self.display.log(rec, self.cfg.train.steps, 0.0, 0.0)

    # ---- checkpoints and signals ---------------------------------------------------------

    def _save(self, start: float) -> Path:
        rng = {"torch_cpu": torch.get_rng_state()}
        if self.device.type == "cuda":
            rng["torch_cuda"] = torch.cuda.get_rng_state(self.device)
        state: dict[str, Any] = {
            "tokens_seen": self.tokens_seen,
            "elapsed_s": self.elapsed_prev + time.perf_counter() - start,
            "loader": self.data.train.state_dict(),
            "val_loss": self.last_val_loss,
            "config": self.cfg.to_dict(),
        }
        if self.precision.scaler is not None:
            state["scaler"] = self.precision.scaler.state_dict()
        path = save_checkpoint(
            self.ckpt_root, self.step, self.model, self.optimizer, state, rng,
            keep_last=self.cfg.checkpoint.keep_last,
        )
        self.last_saved_step = self.step
        return path

    def _install_signal_handlers(self) -> dict[int, Any]:
        def on_signal(signum: int, _frame: Any) -> None:
            self._stop_signal = signum
            # A second Ctrl-C interrupts at once; checkpoints stay safe (saves are atomic).
            signal.signal(signal.SIGINT, signal.default_int_handler)

        previous = {}
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                previous[sig] = signal.signal(sig, on_signal)
            except ValueError:  # not the main thread (e.g. some notebook runners)
                pass
        return previous

    @staticmethod
    def _restore_signal_handlers(previous: dict[int, Any]) -> None:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

    # ---- messages -------------------------------------------------------------------------

    def _announce(self) -> None:
        cfg, t = self.cfg, self.cfg.train
        planned = t.steps * t.global_batch_size * t.seq_len
        verb = f"resuming at step {self.step}" if self.step else "training"
        self.display.print(
            f"tessel: {verb} {param_count(cfg.model):,}-parameter model "
            f"({cfg.model.preset or 'custom'}) on {self.device.type} ({self.precision.name}), "
            f"{t.steps} steps x {t.global_batch_size} x {t.seq_len} tokens = {planned:,} tokens "
            f"(accumulation {self.accum}); run dir {self.run_dir}"
        )

    def _finish_message(self) -> None:
        msg = f"done: step {self.step}"
        if self.last_val_loss is not None:
            msg += (
                f", val loss {self.last_val_loss:.4f} "
                f"(unigram baseline {self.data.unigram_baseline:.4f})"
            )
        self.display.print(msg + f"; checkpoint in {self.ckpt_root / 'latest'}")
        n = self.cfg.run.sample_tokens
        if n:
            prompt = self.cfg.run.sample_prompt
            ids = sample(self.model, self.tokenizer.encode(prompt), n, seed=self.cfg.train.seed,
                         stop_id=self.tokenizer.eod_id)
            self.display.print("sample:\n" + prompt + self.tokenizer.decode(ids))


def _get(cfg: Config, dotted: str) -> Any:
    node: Any = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node.model_dump() if hasattr(node, "model_dump") else node


def _first_difference(key: str, old: Any, new: Any) -> str:
    if isinstance(old, dict) and isinstance(new, dict):
        for k in old:
            if old[k] != new.get(k):
                return f"{key}.{k} was {old[k]!r} in the run, now {new.get(k)!r}"
    return f"{key} was {old!r} in the run, now {new!r}"
