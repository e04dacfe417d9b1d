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


@pytest.mark.budget(40)  # five 2-step runs of the recipe, three reference passes (~12 s)
def test_the_reference_pass_is_cached_across_runs(tmp_path: Path, capsys):
    """A run that differs from an earlier one only in what the reference pass does not read
    (dpo.beta, the loss, the learning rate, the steps) takes the reference log-probabilities
    from the data cache: the very numbers, so it trains exactly as the same run computing
    them itself does. Another seed (other initial weights) computes its own; a damaged cache
    entry is said in one line and computed again, never used."""
    import numpy as np

    from tessel.cli import main

    cache = tmp_path / "cache"
    short = ["--train.steps=2", "--train.eval_interval=2", "--checkpoint.interval=0",
             f"--data.cache_dir={cache}"]

    def run(name: str, *extra: str) -> tuple[str, np.ndarray, list]:
        assert main(["train", RECIPE, f"--run.dir={tmp_path / name}", *short, *extra]) == 0
        out = capsys.readouterr().out
        recs = read_metrics(tmp_path / name / "metrics.jsonl")
        return out, np.load(tmp_path / name / "reference_logps.npy"), recs

    first, ref, _ = run("a")
    assert "one pass of the initial model" in first and "from the data cache" not in first
    sweep = ["--dpo.beta=0.3", "--dpo.loss=ipo", "--optim.lr=1e-3", "--train.steps=3"]
    out, hit, recs = run("b", *sweep)
    assert "reference log-probabilities of 300 pairs from the data cache" in out, out
    assert np.array_equal(hit, ref)
    # The same run with an empty cache computes the same numbers and trains the same.
    out, own, own_recs = run("b_alone", *sweep, f"--data.cache_dir={tmp_path / 'other'}")
    assert "one pass of the initial model" in out and np.array_equal(own, ref)
    pick = lambda rs: [(r["step"], r.get("loss"), r.get("val_loss")) for r in rs]  # noqa: E731
    assert pick(recs) == pick(own_recs)

    out, seeded, _ = run("c", "--train.seed=7")  # other initial weights: a pass of its own
    assert "one pass of the initial model" in out and not np.array_equal(seeded, ref)

    [entry] = [p for p in (cache / "dpo-reference").iterdir()
               if np.array_equal(np.load(p / "reference_logps.npy"), ref)]
    blob = bytearray((entry / "reference_logps.npy").read_bytes())
    blob[-3] ^= 0x40  # one value changed: the checksum no longer matches
    (entry / "reference_logps.npy").write_bytes(bytes(blob))
    out, again, _ = run("d")
    assert "are damaged (its checksum does not match); computing them again" in out, out
    assert "one pass of the initial model" in out and np.array_equal(again, ref)
    assert np.array_equal(np.load(entry / "reference_logps.npy"), ref)  # written anew


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
