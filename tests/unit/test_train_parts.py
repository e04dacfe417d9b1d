"""The Trainer's parts, each through its public interface: TrainStep, Evaluator,
CheckpointManager, StopControl, Recovery, StepLogger and RunDir."""

from __future__ import annotations

import copy
import json
import math
import os
import signal
import time
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from tessel.checkpoint.manager import CheckpointManager
from tessel.config import Config
from tessel.data import Batch
from tessel.errors import Stopped
from tessel.observe.console import ConsoleDisplay
from tessel.optim.groups import build_optimizer
from tessel.parallel.apply import build_parallel_model
from tessel.parallel.dims import ParallelDims
from tessel.train.control import (
    StopControl,
    catch_early_signals,
    exit_code_for,
    stop_at_once,
)
from tessel.train.eval import Evaluator
from tessel.train.precision import resolve_precision
from tessel.train.recovery import Recovery, RecoveryGaveUp, SkipList
from tessel.train.run_dir import RunDir
from tessel.train.step import TrainStep
from tessel.train.step_log import StepLogger

CPU = torch.device("cpu")


def _cfg(**extra) -> Config:
    base = {"model.preset": "tiny", "train.seq_len": 16, "train.micro_batch_size": 2,
            "train.global_batch_size": 4, "optim.lr": 1e-2, "optim.warmup_steps": 0,
            "train.grad_clip": 1.0}
    base.update(extra)
    return Config.load(None, base)


def _step(cfg: Config) -> TrainStep:
    dims = ParallelDims.from_config(cfg.parallel, 1)
    torch.manual_seed(0)
    model = build_parallel_model(cfg, dims, None, CPU, None)
    opts = [build_optimizer(m, cfg.optim, CPU) for m in model.inner]
    return TrainStep(model, opts, dims, None, CPU, resolve_precision("fp32", CPU), accum=2,
                     grad_clip=cfg.train.grad_clip, parallel_cfg=cfg.parallel,
                     distributed=False)


def _batches(n: int, vocab: int, seed: int = 1) -> list[Batch]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        tokens = torch.randint(0, vocab, (2, 17), generator=g)
        out.append(Batch(tokens[:, :-1], tokens[:, 1:], None))
    return out


def test_train_step_equals_a_plain_pytorch_step():
    cfg = _cfg()
    step = _step(cfg)
    reference = copy.deepcopy(step.model.inner[0])
    opt = build_optimizer(reference, cfg.optim, CPU)
    batches = _batches(2, cfg.model.vocab_size)
    step.set_lr(1e-2)
    for g in opt.param_groups:
        g["lr"] = 1e-2

    loss, grad_norm = step(batches)

    x = torch.cat([b.inputs for b in batches])
    y = torch.cat([b.targets for b in batches])
    ref_loss = F.cross_entropy(reference(x).flatten(0, 1), y.flatten())  # one mean over tokens
    ref_loss.backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
    opt.step()
    assert loss.item() == pytest.approx(ref_loss.item(), rel=1e-6)
    assert grad_norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
    for (name, p), q in zip(step.model.inner[0].named_parameters(), reference.parameters()):
        # float32 tolerance as in the layout tests (Adam amplifies summation-order noise)
        torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-4, msg=name)
    assert step.global_loss(loss) == loss.item() and step.first_lr() == 1e-2


def test_evaluator_is_the_token_mean_over_the_validation_batches():
    cfg = _cfg()
    step = _step(cfg)
    batches = _batches(3, cfg.model.vocab_size, seed=5)

    class Val:
        n_samples, mbs, dp_rank, dp_size = 6, 2, 0, 1

        def reset(self):
            self.i = 0

        def next_batch(self):
            self.i += 1
            return batches[self.i - 1]

    loss = Evaluator(step, Val(), eval_iters=3).loss()
    model = step.model.inner[0]
    with torch.no_grad():
        expected = sum(F.cross_entropy(model(b.inputs).flatten(0, 1), b.targets.flatten(),
                                       reduction="sum").item() for b in batches) / (3 * 2 * 16)
    assert loss == pytest.approx(expected, rel=1e-6)
    assert model.training  # evaluation puts the model back in training mode

    # fine-tuning batches whose targets are all masked: a mean over nothing is NaN, not a
    # ZeroDivisionError that ends the run
    step.masked = True
    masked = [Batch(b.inputs, torch.full_like(b.targets, -100), None) for b in batches]
    batches[:] = masked
    assert math.isnan(Evaluator(step, Val(), eval_iters=3).loss())


def test_checkpoint_manager_saves_publishes_restores_and_prunes(tmp_path: Path):
    cfg = _cfg()
    step = _step(cfg)
    models, opts = step.model.inner, step.optimizers
    manager = CheckpointManager(tmp_path / "checkpoints", models, opts, keep_last=2,
                                async_save=False, distributed=False)
    assert manager.latest() is None and manager.written_here()
    saved = {k: v.clone() for k, v in models[0].state_dict().items()}
    torch.manual_seed(123)
    expected_draw = torch.rand(3)
    torch.manual_seed(123)
    for s in (1, 2, 3):
        manager.save(s, {"note": s}, CPU)
    assert manager.latest().name == "step_00000003" and manager.last_saved_step == 3
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*")) == [
        "step_00000002", "step_00000003"]
    with torch.no_grad():
        for p in models[0].parameters():
            p.add_(1.0)
    torch.rand(5)  # the RNG moves on after the save...
    manager.restore(manager.latest(), CPU)
    assert torch.equal(torch.rand(3), expected_draw)  # ...and restore puts it back
    for k, v in models[0].state_dict().items():
        assert torch.equal(v, saved[k]), k

    async_manager = CheckpointManager(tmp_path / "async", models, opts, keep_last=3,
                                      async_save=True, distributed=False)
    async_manager.save(4, {}, CPU)
    assert async_manager.pending is not None and async_manager.latest() is None
    async_manager.publish_finished(wait=True)
    assert async_manager.pending is None and async_manager.latest().name == "step_00000004"


def test_stop_control_signals_and_alert_actions():
    control = StopControl(distributed=False, device_type="cpu")
    assert not control.should_stop(written_here=True) and control.reason() is None
    control.request("pause")
    control.request("continue")  # never weakens a stronger action
    assert control.should_stop(written_here=False) and control.reason() == "pause"
    assert control.save_written is False

    control = StopControl(distributed=False, device_type="cpu")
    before = signal.getsignal(signal.SIGTERM)
    control.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        assert control.should_stop(written_here=True) and control.reason() == "SIGTERM"
    finally:
        control.restore()
    assert signal.getsignal(signal.SIGTERM) is before
    assert [exit_code_for(r) for r in (None, "SIGTERM", "SIGINT", "pause", "stop")] == [0, 0, 130, 4, 5]


def test_a_stop_signal_during_start_up_stops_the_run_at_its_first_boundary():
    """A scheduler's SIGTERM while the run is still being built killed the process (no
    handler yet): no checkpoint, and the job was counted a failure."""
    before = signal.getsignal(signal.SIGUSR1)
    restore = catch_early_signals()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)  # before the loop's handlers exist
        control = StopControl(distributed=False, device_type="cpu")
        control.install()
        try:
            assert control.should_stop(written_here=True) and control.reason() == "SIGUSR1"
        finally:
            control.restore()
    finally:
        restore()
    assert signal.getsignal(signal.SIGUSR1) is before


def test_sigterm_while_preparing_the_data_stops_at_once():
    """SIGTERM during start-up waits for the first step boundary, which data preparation
    (a slow chat template, a large corpus) could put off for hours: there it stops at once,
    with exit code 143 and nothing to save; SIGUSR1 (time left) still waits."""
    before = signal.getsignal(signal.SIGTERM)
    restore = catch_early_signals()
    try:
        with pytest.raises(Stopped) as info, stop_at_once("preparing the data"):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # interrupted long before
        assert info.value.exit_code == 143 and "while preparing the data" in str(info.value)
        with stop_at_once("preparing the data"):
            os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)  # start-up, not preparing: remembered
        with pytest.raises(Stopped), stop_at_once("preparing the data"):
            pass  # ... and it stops the preparation that follows
        control = StopControl(distributed=False, device_type="cpu")
        control.install()
        control.restore()
        assert control.reason() == "SIGUSR1"
    finally:
        restore()
    assert signal.getsignal(signal.SIGTERM) is before


def test_recovery_judges_and_refuses_rollbacks_it_cannot_do(tmp_path: Path):
    cfg = _cfg(**{"recovery.spike_sigma": 3.0, "recovery.max_rollbacks": 1})
    recovery = Recovery(cfg.recovery, SkipList(tmp_path / "skipped.json", [7], writer=True))
    assert recovery.enabled and 7 in recovery.skips.batches
    assert "not finite" in recovery.judge(math.nan, 1.0)
    with pytest.raises(RecoveryGaveUp, match="no checkpoint to roll back to"):
        recovery.check_rollback("spike", 3, 2, None, tmp_path)
    assert recovery.check_rollback("spike", 3, 2, tmp_path, tmp_path) == tmp_path
    recovery.skips.add(2, 3, "spike", 1)
    with pytest.raises(RecoveryGaveUp, match="max_rollbacks=1"):
        recovery.check_rollback("spike", 5, 4, tmp_path, tmp_path)
    assert SkipList(tmp_path / "skipped.json", [], writer=False).batches == {2}
    assert Recovery(_cfg().recovery, recovery.skips).enabled is False


def test_step_logger_writes_one_record_to_every_sink_and_the_alerts():
    cfg = _cfg(**{"train.steps": 10})

    class Sink:
        records: list = []

        def write(self, rec):
            self.records.append(rec)

        def close(self):
            pass

    sink, observed = Sink(), []
    log = StepLogger(cfg, ConsoleDisplay(10, enabled=False), sink, CPU, world_size=2,
                     peak_flops=None, observe=observed.append)
    log.train(step=5, loss=2.0, lr=1e-3, grad_norm=0.5, window_s=2.0, window_steps=4,
              tokens_seen=5 * 64, elapsed_s=10.0, eta_s=10.0, time_split={"data": 0.4},
              loss_scale=None)
    log.eval(step=5, val_loss=1.5, tokens_seen=320, elapsed_s=11.0)
    train, val = sink.records
    assert train["tokens_per_s"] == 4 * 64 / 2.0 and train["tokens_per_s_per_device"] == 64
    assert train["mfu"] is None and train["token_budget_pct"] == 50.0
    assert train["time_data_s"] == 0.1 and "loss_scale" not in train and "mem_rss_gib" in train
    assert val["val_ppl"] == pytest.approx(math.exp(1.5))
    assert observed == [train, val]


def test_run_dir_owns_the_names_and_the_halted_marker(tmp_path: Path):
    run = RunDir(tmp_path / "run")
    assert not run.holds_run() and run.halted() is None and run.latest_checkpoint() is None
    assert run.checkpoints == tmp_path / "run" / "checkpoints"
    assert run.latest_link == run.checkpoints / "latest"
    run.write_start("[run]\n", {"world_size": 1}, lambda p: p.write_text("{}"))
    assert run.holds_run() and run.tokenizer.read_text() == "{}"
    run.write_halted(4, "paused by an alert", 7)
    assert run.halted()["exit_code"] == 4
    run.halted_marker.write_text("{not json")
    assert run.halted() == {"message": "was halted"}
    assert not run.tokenizer_config.exists()  # no chat template: none written
    run.write_start("[run]\n", {"world_size": 1}, lambda p: None, {"chat_template": "T"})
    assert run.halted() is None  # an explicit resume clears the marker
    assert json.loads(run.tokenizer_config.read_text()) == {"chat_template": "T"}
