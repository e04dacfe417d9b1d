"""Preference tuning as a user runs it: `tessel train configs/dpo-tiny.toml` (the bundled
pairs) raises the preference accuracy and margin on the held-out pairs, a resume reuses the
reference log-probabilities kept in the run directory, compiled blocks train as eager ones,
and what DPO cannot do yet, or a resume without its reference, is one line with exit code 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli import ROOT

from tessel.observe.metrics import read_metrics

RECIPE = str(ROOT / "configs/dpo-tiny.toml")


def _train(tmp_path: Path, *extra: str) -> int:
    from tessel.cli import main

    return main(["train", RECIPE, f"--run.dir={tmp_path / 'run'}",
                 f"--data.cache_dir={tmp_path / 'cache'}", *extra])


@pytest.mark.budget(90)  # 40 steps and 3 evaluations (55 s measured on a loaded 2-core machine)
def test_dpo_tiny_raises_held_out_accuracy_and_margin(tmp_path: Path, capsys):
    """30 steps of the recipe (half of it), then a resume to 40: the held-out accuracy and
    margin (TRL's eval rewards/*) rise from 0 at the start (the policy is the reference) to
    a clear preference, and the margin grows from one evaluation to the next."""
    import os

    assert _train(tmp_path, "--train.steps=30", "--train.eval_interval=15",
                  "--checkpoint.interval=15") == 0
    ref = tmp_path / "run" / "reference_logps.npy"
    first = ref.stat().st_mtime_ns
    assert "reference log-probabilities of 300 pairs" in capsys.readouterr().out
    from tessel.cli import main

    assert main(["train", "--resume", str(tmp_path / "run"), "--train.steps=40"]) == 0
    assert "reference log-probabilities" not in capsys.readouterr().out  # reused
    assert ref.stat().st_mtime_ns == first
    evals = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "val_loss" in r]
    assert [r["step"] for r in evals] == [15, 30, 40]
    margins = [r["eval_rewards/margins"] for r in evals]
    print("held-out accuracy", [round(r["eval_rewards/accuracies"], 3) for r in evals],
          "margin", [round(m, 3) for m in margins])  # the figures, with pytest -s
    assert margins[0] > 0 and margins[2] > margins[0], margins
    assert evals[-1]["eval_rewards/accuracies"] >= 0.7, evals[-1]
    assert evals[-1]["eval_rewards/chosen"] > evals[-1]["eval_rewards/rejected"]
    trained = [r for r in read_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert all("rewards/margins" in r and "logps/chosen" in r for r in trained)

    os.remove(ref)  # a resume never recomputes the reference with trained weights
    code = main(["train", "--resume", str(tmp_path / "run"), "--train.steps=50"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "reference log-probabilities" in err[0], err


def test_what_dpo_cannot_do_yet_is_one_line(tmp_path: Path, capsys):
    assert _train(tmp_path, "--fault_tolerance.enable=true", "--fault_tolerance.group_size=2",
                  "--fault_tolerance.lighthouse=http://127.0.0.1:9") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.objective = \"dpo\" does not run with" in err[0], err
    assert not (tmp_path / "run").exists()
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "a", "chosen": "b"}) + "\n")
    assert _train(tmp_path, f"--dpo.paths={json.dumps([str(bad)])}") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a preference record" in err[0], err
    assert not (tmp_path / "run").exists()


@pytest.mark.budget(60)  # two 2-step runs, one compiling the blocks (~20 s on 2 cores)
def test_compiled_blocks_train_dpo_as_eager_ones(tmp_path: Path):
    """train.compile under DPO (the blocks compiled one by one, the preference loss outside
    them): the same losses, rewards and held-out figures as the eager run."""
    runs = {}
    for compiled in (False, True):
        run = tmp_path / f"compile_{compiled}"
        assert _train(tmp_path, "--train.steps=2", "--train.eval_interval=2",
                      "--metrics.log_interval=1", f"--train.compile={str(compiled).lower()}",
                      f"--run.dir={run}", "--quiet") == 0
        runs[compiled] = read_metrics(run / "metrics.jsonl")
    eager, compiled = runs[False], runs[True]
    assert [r["step"] for r in eager] == [r["step"] for r in compiled] == [1, 2, 2]
    for want, got in zip(eager, compiled):
        for key in ("loss", "rewards/margins", "rewards/accuracies", "val_loss",
                    "eval_rewards/margins"):
            if key in want:
                assert got[key] == pytest.approx(want[key], rel=1e-5, abs=1e-6), (key, got, want)
