"""The parts of benchmark scoring that need no model: the [lm_eval] section's checks, lm_eval's
results as metrics fields, score records beside training and validation records, the random
state scoring leaves alone and the environment report it skips. (Scores themselves:
tests/integration/test_lm_eval.py.)"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from tessel.config import Config, ConfigError
from tessel.observe.metrics import latest_per_step, record_kind
from tessel.train.harness import environment_report_skipped, random_state_kept, score_keys


def test_lm_eval_section_defaults_off_and_checks_its_fields():
    assert not Config().lm_eval.enabled
    cfg = Config.load(None, {"lm_eval.tasks": ["arc_easy"], "lm_eval.limit": 50,
                             "lm_eval.interval": 100, "lm_eval.num_fewshot": 0})
    assert cfg.lm_eval.enabled and cfg.lm_eval.num_fewshot == 0
    for bad, needle in (({"lm_eval.include_path": "tasks/"}, "lm_eval.tasks is empty"),
                        ({"lm_eval.tasks": [""]}, "empty name"),
                        ({"lm_eval.limit": -1}, "limit"),
                        ({"lm_eval.batch_size": 0}, "batch_size")):
        with pytest.raises(ConfigError) as exc:
            Config.load(None, bad)
        assert needle in str(exc.value) and "\n" not in str(exc.value)


def test_results_become_eval_task_metric_fields():
    results = {"arc_easy": {"alias": "arc_easy", "acc,none": 0.5, "acc_stderr,none": "N/A",
                            "acc_norm,none": 0.75},
               "gsm8k": {"exact_match,strict-match": 0.25, "exact_match_stderr,strict-match": 0.1}}
    assert score_keys(results) == {"eval/arc_easy/acc": 0.5, "eval/arc_easy/acc_norm": 0.75,
                                   "eval/gsm8k/exact_match_strict-match": 0.25}


def test_score_records_are_their_own_kind():
    train = {"step": 2, "loss": 3.0}
    val = {"step": 2, "val_loss": 3.1}
    scores = {"step": 2, "eval/t/acc": 0.5}
    assert [record_kind(r) for r in (train, val, scores)] == [0, 1, 2]
    again = {"step": 2, "eval/t/acc": 0.75}  # a resume re-scored step 2
    assert latest_per_step([train, val, scores, again])[0] == [train, val, again]


def test_scoring_leaves_the_random_state_as_it_was():
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    expected = (torch.rand(2), random.random(), np.random.rand())
    torch.manual_seed(3)
    random.seed(3)
    np.random.seed(3)
    with random_state_kept():
        torch.manual_seed(1234)  # what simple_evaluate does
        random.seed(1234)
        np.random.seed(1234)
        torch.rand(5)
    got = (torch.rand(2), random.random(), np.random.rand())
    assert torch.equal(got[0], expected[0]) and got[1:] == expected[1:]


def test_scoring_skips_lm_evals_environment_report_and_puts_it_back(monkeypatch):
    import subprocess

    import lm_eval.evaluator as evaluator
    original = evaluator.add_env_info, evaluator.get_git_commit_hash

    def no_process(*args, **kwargs):
        raise AssertionError(f"a process was started while scoring: {args[:1]}")

    results: dict = {}
    with environment_report_skipped():
        monkeypatch.setattr(subprocess, "Popen", no_process)  # collect_env runs pip, gcc, ...
        evaluator.add_env_info(results)
        assert evaluator.get_git_commit_hash() is None
        monkeypatch.undo()
    assert results == {}
    assert (evaluator.add_env_info, evaluator.get_git_commit_hash) == original  # lm_eval's own
