import json
import math
import os
import signal
from pathlib import Path

import pytest
import torch

from tessel import Config, TesselError, Trainer
from tessel.checkpoint import CheckpointError, list_checkpoints, read_full
from tessel.observe.metrics import read_metrics


def _losses(run_dir: Path) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "loss" in r}


def test_loss_falls_below_unigram_baseline(tiny_config):
    cfg = tiny_config(**{"train.steps": 100, "train.eval_interval": 50, "train.seq_len": 64,
                         "metrics.log_interval": 10, "metrics.tensorboard": True})
    result = Trainer(cfg, console=False).train()
    losses = _losses(cfg_dir := Path(cfg.run.dir))
    assert losses[100] < losses[10] - 1.5
    assert result.val_loss < result.unigram_baseline - 0.5
    recs = read_metrics(cfg_dir / "metrics.jsonl")
    train_rec = next(r for r in recs if r["step"] == 100 and "loss" in r)
    for key in ("step", "loss", "lr", "grad_norm", "tokens_per_s", "tokens_seen", "elapsed_s"):
        assert key in train_rec
    assert train_rec["tokens_seen"] == 100 * 8 * 64
    assert train_rec["mfu"] is None  # CPU peak is unknown: no guessed MFU
    assert {r["step"] for r in recs if "val_loss" in r} == {50, 100}
    assert (cfg_dir / "config.toml").is_file() and (cfg_dir / "tokenizer.json").is_file()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(cfg_dir))
    events.Reload()
    assert {"loss/loss", "loss/val_loss", "train/lr"} <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("loss/val_loss")] == [50, 100]
    assert Config.load(cfg_dir / "config.toml") == cfg


def test_moe_model_trains_below_unigram_baseline_with_balance_metrics(tiny_config):
    cfg = tiny_config(**{"model.preset": "tiny-moe", "model.moe_bias_update_rate": 0.001,
                         "train.steps": 60, "train.eval_interval": 0, "train.seq_len": 64,
                         "metrics.log_interval": 10})
    result = Trainer(cfg, console=False).train()
    run_dir = Path(cfg.run.dir)
    losses = _losses(run_dir)
    assert losses[60] < losses[10] - 1.0
    assert result.val_loss < result.unigram_baseline - 0.3
    rec = next(r for r in read_metrics(run_dir / "metrics.jsonl") if r["step"] == 60 and "loss" in r)
    for layer in (1, 2, 3):  # layer 0 is dense
        assert rec[f"moe_load_imbalance_l{layer}"] >= 1.0
        assert 0.9 < rec[f"moe_aux_loss_l{layer}"] < 8.0  # 1.0 when perfectly balanced
    assert "moe_load_imbalance_l0" not in rec
    share = rec["moe_expert_share_l1"]  # what the report's heatmaps draw
    assert len(share) == 8 and sum(share) == pytest.approx(1.0, abs=1e-3)
    # the auxiliary-loss-free bias is checkpointed (moved by +-0.001 per step)
    weights = read_full(run_dir / "checkpoints/latest", "model")
    bias = weights["layers.1.feed_forward.expert_bias"]
    assert bias.abs().max() > 0 and bias.abs().max() <= 60 * 0.001 + 1e-6


def test_moe_resume_is_bitwise_identical_balancing_bias_included(tiny_config, tmp_path, corpus):
    moe = {"model.preset": "tiny-moe", "model.moe_bias_update_rate": 0.01}
    full = tiny_config("full", **moe, **{"train.steps": 6})
    Trainer(full, console=False).train()
    part = tiny_config("part", **moe, **{"train.steps": 3, "checkpoint.interval": 3})
    Trainer(part, console=False).train()
    run = Path(part.run.dir)
    Trainer(Config.load(run / "config.toml", {"train.steps": 6}), resume=True,
            console=False).train()
    assert _losses(run) == _losses(Path(full.run.dir))
    wa = read_full(Path(full.run.dir) / "checkpoints/latest", "model")
    wb = read_full(run / "checkpoints/latest", "model")
    assert wa["layers.1.feed_forward.expert_bias"].abs().sum() > 0
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k
    # model.init_from of an MoE run reads its MoE shape (and refuses an HF export of it)
    from tessel.checkpoint.init_from import model_fields_of

    fields = model_fields_of(run)
    assert (fields["moe_experts"], fields["moe_top_k"], fields["moe_first_dense_layers"]) == (8, 2, 1)
    # ... and carries its balancing bias (part of the trained router: the top-k choice is made
    # with it), from the run directory and from a consolidated safetensors file alike.
    from conftest import tiny_overrides

    from tessel.checkpoint.consolidate import consolidate
    from tessel.checkpoint.init_from import WeightSource, load_config

    biases = {k: v for k, v in wb.items() if k.endswith("feed_forward.expert_bias")}
    assert len(biases) == 3
    tuned = Trainer(load_config(None, tiny_overrides(tmp_path / "tuned", corpus,
                                                     **{"model.init_from": str(run)})),
                    console=False)
    assert tuned.cfg.model.moe_experts == 8
    state = tuned.model.inner[0].state_dict()
    for name, bias in biases.items():
        assert torch.equal(state[name], bias), name
    single = tmp_path / "consolidated.safetensors"
    consolidate(run / "checkpoints/latest", single)
    source = WeightSource(single, tuned.cfg.model)
    for name, bias in biases.items():
        assert torch.equal(source.buffer(name, (8,)), bias), name
    assert source.buffer("layers.1.feed_forward.no_such_buffer", (8,)) is None


@pytest.mark.slow
def test_compiled_blocks_match_eager(tiny_config):
    eager = tiny_config("eager", **{"train.steps": 3})
    compiled = tiny_config("compiled", **{"train.steps": 3, "train.compile": True})
    Trainer(eager, console=False).train()
    Trainer(compiled, console=False).train()
    le, lc = _losses(Path(eager.run.dir)), _losses(Path(compiled.run.dir))
    for step in le:
        assert lc[step] == pytest.approx(le[step], rel=1e-4)
    names = read_full(Path(compiled.run.dir) / "checkpoints/latest", "model")
    assert not any("_orig_mod" in k for k in names)  # checkpoints keep plain names


def test_gradient_accumulation_does_not_change_the_step(tiny_config):
    # 1 x 8 and 4 x 2 micro-batches see the same samples: same loss and weights (to fp32
    # rounding of the summation order).
    a = tiny_config("a", **{"train.micro_batch_size": 8, "train.steps": 3})
    b = tiny_config("b", **{"train.micro_batch_size": 2, "train.steps": 3})
    Trainer(a, console=False).train()
    Trainer(b, console=False).train()
    la, lb = _losses(Path(a.run.dir)), _losses(Path(b.run.dir))
    for step in la:
        assert la[step] == pytest.approx(lb[step], rel=1e-5)
    wa = read_full(Path(a.run.dir) / "checkpoints/latest", "model")
    wb = read_full(Path(b.run.dir) / "checkpoints/latest", "model")
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_trains(tiny_config, precision):
    cfg = tiny_config(**{"train.precision": precision, "train.steps": 6})
    trainer = Trainer(cfg, console=False)
    assert trainer.precision.name == precision
    assert (trainer.precision.scaler is not None) == (precision == "fp16")
    result = trainer.train()
    assert math.isfinite(result.loss)
    assert all(p.dtype == torch.float32 for p in trainer.model.parameters())  # fp32 master


def test_resume_is_bitwise_identical_to_an_uninterrupted_run(tiny_config, monkeypatch):
    extra = {"train.steps": 10, "model.dropout": 0.1, "checkpoint.interval": 3,
             "train.eval_interval": 4}
    full = tiny_config("full", **extra)
    Trainer(full, console=False).train()

    stopped = tiny_config("stopped", **extra)
    trainer = Trainer(stopped, console=False)
    real_step = trainer.run_step
    calls = {"n": 0}

    def step_then_sigterm():
        out = real_step()
        calls["n"] += 1
        if calls["n"] == 5:  # a real signal, delivered mid-run, handled at the step boundary
            os.kill(os.getpid(), signal.SIGTERM)
        return out

    monkeypatch.setattr(trainer, "run_step", step_then_sigterm)
    result = trainer.train()
    assert result.stopped_by == "SIGTERM" and result.step == 5 and result.exit_code == 0
    assert [s for s, _ in list_checkpoints(Path(stopped.run.dir) / "checkpoints")][-1] == 5
    # resume in a fresh trainer (fresh RNG state, as in a new process)
    torch.manual_seed(999)
    resumed = Trainer(Config.load(Path(stopped.run.dir) / "config.toml"), resume=True,
                      console=False)
    assert resumed.step == 5
    resumed.train()

    assert _losses(Path(full.run.dir)) == _losses(Path(stopped.run.dir))  # to the bit
    wa = read_full(Path(full.run.dir) / "checkpoints/latest", "model")
    wb = read_full(Path(stopped.run.dir) / "checkpoints/latest", "model")
    assert wa.keys() == wb.keys() and all(torch.equal(wa[k], wb[k]) for k in wa)
    oa = read_full(Path(full.run.dir) / "checkpoints/latest", "optim")
    ob = read_full(Path(stopped.run.dir) / "checkpoints/latest", "optim")
    assert all(torch.equal(oa[k], ob[k]) for k in oa)


def test_a_signal_after_the_last_step_stops_nothing(tiny_config, monkeypatch):
    """A SIGTERM (a time limit's warning) that arrives during the final evaluation comes too
    late to stop anything: the run finished and says so (a `finish` event, exit 0), not a
    preemption that a SLURM job would requeue itself for. One before the last step does stop
    it, with the code tessel's node launcher asks for (tessel.launch.node)."""
    from tessel.launch.node import EXIT_REQUEUE, STOPPED_EXIT_ENV
    from tessel.observe.events import read_events

    monkeypatch.setenv(STOPPED_EXIT_ENV, str(EXIT_REQUEUE))
    for last, at_step in (("late", 3), ("early", 2)):
        cfg = tiny_config(last, **{"train.steps": 3, "train.eval_interval": 2})
        trainer = Trainer(cfg, console=False)
        real_evaluate = trainer._evaluate

        def evaluate_then_sigterm(*args, real=real_evaluate, when=at_step, tr=trainer):
            out = real(*args)
            if tr.step == when:
                os.kill(os.getpid(), signal.SIGTERM)
            return out

        monkeypatch.setattr(trainer, "_evaluate", evaluate_then_sigterm)
        result = trainer.train()
        kinds = [e["kind"] for e in read_events(Path(cfg.run.dir))]
        if last == "late":
            assert (result.stopped_by, result.exit_code, result.step) == (None, 0, 3)
            assert kinds[-1] == "finish" and "preempt" not in kinds
        else:
            assert (result.stopped_by, result.exit_code, result.step) == ("SIGTERM", 75, 2)
            assert kinds[-1] == "preempt" and "finish" not in kinds


def test_resume_can_extend_steps_but_not_change_the_model(tiny_config):
    cfg = tiny_config(**{"train.steps": 4})
    Trainer(cfg, console=False).train()
    run = Path(cfg.run.dir)
    with pytest.raises(CheckpointError, match="model.d_model was 64 in the run, now 128"):
        Trainer(Config.load(run / "config.toml", {"model.d_model": 128}), resume=True)
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    noop = Config.load(run / "config.toml", {"optim.lr": 1e-4})
    again = Trainer(noop, resume=True, console=False).train()
    assert again.step == 4 and again.loss is None  # finished: nothing to do, nothing written
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == before
    longer = Config.load(run / "config.toml", {"train.steps": 6, "train.global_batch_size": 16})
    result = Trainer(longer, resume=True, console=False).train()
    assert result.step == 6
    assert Config.load(run / "config.toml").train.steps == 6
    last = read_metrics(run / "metrics.jsonl")[-1]
    assert last["tokens_seen"] == 4 * 8 * 32 + 2 * 16 * 32  # counted, not step x batch


def test_existing_run_is_never_overwritten(tiny_config):
    cfg = tiny_config(**{"train.steps": 2})
    Trainer(cfg, console=False).train()
    run = Path(cfg.run.dir)
    before = {p: p.stat().st_mtime_ns for p in run.rglob("*")}
    with pytest.raises(TesselError, match="already holds a run; continue it with"):
        Trainer(cfg, console=False)
    assert {p: p.stat().st_mtime_ns for p in run.rglob("*")} == before


def test_resume_without_a_run_is_refused_and_before_a_checkpoint_restarts(tiny_config):
    cfg = tiny_config()
    with pytest.raises(CheckpointError, match="nothing to resume"):
        Trainer(cfg, resume=True)
    assert not Path(cfg.run.dir).exists()
    # a run killed before its first checkpoint: --resume starts it again from step 0
    run = Path(cfg.run.dir)
    run.mkdir()
    (run / "config.toml").write_text(cfg.to_toml())
    result = Trainer(cfg, resume=True, console=False).train()
    assert result.step == cfg.train.steps


def _indexed(tmp_path: Path, name: str, seed: int) -> str:
    from conftest import write_corpus

    from tessel.data.preprocess import preprocess
    from tessel.data.tokenizer import byte_tokenizer

    src = write_corpus(tmp_path / f"src-{name}", n_docs=8, seed=seed)
    prefix = tmp_path / "data" / name
    preprocess([str(src)], byte_tokenizer(), prefix, append_eod=True, progress=False)
    return str(prefix)


def test_blend_of_indexed_datasets_trains_resumes_with_new_weights(tmp_path, tiny_config):
    web, books = _indexed(tmp_path, "web", 1), _indexed(tmp_path, "books", 2)
    extra = {"data.source": "indexed", "data.paths": [f"0.75 {web}", f"0.25 {books}"],
             "data.tokenizer": "auto", "data.document_mask": True, "train.steps": 4,
             "checkpoint.interval": 2}
    cfg = tiny_config(**extra)
    Trainer(cfg, console=False).train()
    run = Path(cfg.run.dir)
    state = json.loads((run / "checkpoints/latest/state.json").read_text())["loader"]
    assert state["consumed"] == [24, 8]  # 4 steps x 8 samples at 3:1
    # new mixture on resume: counters continue, the new weights apply from here
    longer = Config.load(run / "config.toml", {"train.steps": 8,
                                               "data.paths": [f"0.25 {web}", f"0.75 {books}"]})
    Trainer(longer, resume=True, console=False).train()
    state = json.loads((run / "checkpoints/latest/state.json").read_text())["loader"]
    assert state["consumed"] == [24 + 8, 8 + 24]
    # a tokenizer other than the data's is refused
    with pytest.raises(TesselError, match="differs from the tokenizer"):
        Trainer(tiny_config("other", **{**extra, "data.tokenizer": str(_bpe(tmp_path))}))


def _bpe(tmp_path: Path) -> Path:
    from tessel.data.tokenizer import train_bpe

    path = tmp_path / "bpe.json"
    train_bpe(["some text to learn merges from " * 20] * 4, vocab_size=300).save(path)
    return path
