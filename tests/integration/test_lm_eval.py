"""Benchmark scores during training through lm-evaluation-harness, on a local multiple-choice
task the test writes (a JSONL file and a task YAML; never the network): `tessel train` writes
them at the interval and at the end, they equal what lm_eval's own `hf` model reports for the
same model exported to Hugging Face, and two-process runs (DDP, ZeRO-3, TP2, CP2) score the same
as one process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_cli import assert_one_line_error, tessel_here

from tessel.cli import main
from tessel.observe.metrics import read_metrics

TASK = "tessel_mc"
WORKER = Path(__file__).parents[1] / "distributed" / "worker.py"
# Questions in the corpus's own words (tests/conftest.py), so a few steps of training matter;
# the right choice is the corpus's continuation.
QUESTIONS = [
    ("the model reads", [" tokens and", " weights with", " every layer"], 0),
    ("the optimizer updates", [" the past", " weights with", " next token"], 1),
    ("predicts the next", [" layer", " gradients", " token"], 2),
    ("computed by", [" backpropagation through", " the model reads", " tokens and"], 0),
    ("through every", [" token", " layer", " weights"], 1),
    ("gradients computed by", [" the next", " every layer", " backpropagation"], 2),
    ("from the past while the", [" optimizer", " tokens", " layer"], 0),
    ("updates weights with", [" the model", " gradients", " every"], 1),
]


def write_task(root: Path) -> Path:
    """A directory with the task's JSONL data and its YAML (lm_eval's include_path form)."""
    root.mkdir(parents=True, exist_ok=True)
    data = root / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n"
                            for q, c, a in QUESTIONS))
    (root / f"{TASK}.yaml").write_text(f"""\
task: {TASK}
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: answer
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
""")
    return root


@pytest.fixture(autouse=True)
def _offline(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    # `datasets` reads the local JSONL through its cache: a temporary one, and no network.
    cache = tmp_path_factory.getbasetemp() / "hf-cache"
    for name in ("HF_HOME", "HF_DATASETS_CACHE"):
        monkeypatch.setenv(name, str(cache))
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")


def overrides(run: Path, corpus: Path, tasks: Path, **extra) -> dict:
    """A tiny GPT-shaped run scoring the task every 2 steps of 4."""
    return {"run.dir": str(run), "model.preset": "tiny", "model.dropout": 0.0,
            "data.source": "files", "data.paths": [str(corpus)], "data.tokenizer": "bytes",
            "data.split": "90,10", "train.seq_len": 32, "train.micro_batch_size": 2,
            "train.global_batch_size": 4, "train.steps": 4, "train.eval_interval": 0,
            "train.eval_iters": 1, "checkpoint.interval": 0, "metrics.tensorboard": False,
            "run.sample_tokens": 0, "lm_eval.tasks": [TASK], "lm_eval.include_path": str(tasks),
            "lm_eval.interval": 2, **extra}


def train_args(run: Path, corpus: Path, tasks: Path, **extra) -> list[str]:
    return ["train", *(f"--{k}={json.dumps(v)}" for k, v in
                       overrides(run, corpus, tasks, **extra).items())]


def scores(run: Path) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k.startswith("eval/")}
            for r in read_metrics(run / "metrics.jsonl") if any(k.startswith("eval/") for k in r)}


ENVIRONMENT_REPORTS: list[dict] = []
"""lm_eval's environment reports made while `trained` trained and scored."""


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    """A single-process `tessel train` run with the task scored every 2 steps, and its
    Hugging Face export (run/hf): (run, corpus, task directory). In this process (main(), what
    the command runs; a `python -m tessel` start-up costs ~5 s), with the environment the
    function-scoped fixtures are not up yet to give: no network, temporary caches."""
    from conftest import write_corpus

    root = tmp_path_factory.mktemp("lm_eval")
    corpus, tasks = write_corpus(root / "corpus"), write_task(root / "tasks")
    run = root / "run"
    env = {"CI": "true", "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "HF_HOME": str(root / "hf-cache"), "HF_DATASETS_CACHE": str(root / "hf-cache"),
           "TESSEL_CACHE": str(root / "cache")}
    with pytest.MonkeyPatch.context() as mp:
        for name, value in env.items():
            mp.setenv(name, value)
        # lm_eval's environment report (collect_env: pip, gcc, ...), as simple_evaluate would
        # make it, recorded: tessel's scoring must skip it
        import lm_eval.evaluator

        mp.setattr(lm_eval.evaluator, "add_env_info", ENVIRONMENT_REPORTS.append)
        assert main(train_args(run, corpus, tasks)) == 0
    assert main(["convert", "tessel-to-hf", str(run), str(run / "hf")]) == 0
    return run, corpus, tasks


def test_train_writes_scores_at_the_interval_and_at_the_end(trained):
    run, _, _ = trained
    got = scores(run)
    assert sorted(got) == [2, 4]
    assert ENVIRONMENT_REPORTS == []  # scored twice through simple_evaluate, no report made
    for rec in got.values():
        assert set(rec) == {f"eval/{TASK}/acc", f"eval/{TASK}/acc_norm"}
        # fractions of the 8 questions
        assert all(v * len(QUESTIONS) == round(v * len(QUESTIONS)) for v in rec.values())
    # The report plots them.
    assert main(["report", str(run)]) == 0
    page = (run / "report.html").read_text()
    assert 'id="plot-scores"' in page and f"{TASK}/acc_norm" in page


def test_scores_equal_lm_eval_on_the_hugging_face_export(trained):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    run, _, tasks = trained
    export = run / "hf"
    theirs = simple_evaluate(
        model="hf", model_args={"pretrained": str(export), "device": "cpu", "dtype": "float32"},
        tasks=[TASK], task_manager=TaskManager(include_path=str(tasks), include_defaults=False),
        bootstrap_iters=0,
        log_samples=False)["results"][TASK]
    ours = scores(run)[4]
    assert ours[f"eval/{TASK}/acc"] == theirs["acc,none"]
    assert ours[f"eval/{TASK}/acc_norm"] == theirs["acc_norm,none"]


def test_in_memory_log_likelihoods_equal_the_hf_models(trained):
    """The per-request figures behind the scores, context/continuation split and greedy flag
    included, against lm_eval's `hf` model on the export."""
    from lm_eval.api.instance import Instance
    from lm_eval.models.huggingface import HFLM

    from tessel.config import Config
    from tessel.train import Trainer

    run, _, _ = trained
    export = run / "hf"
    trainer = Trainer(Config.load(run / "config.toml"), resume=True, console=False)
    try:
        assert trainer.step == 4 and trainer.harness is not None
        reqs = [Instance("loglikelihood", {}, (q + " ", c.strip() + " ."), 0)
                for q, cs, _ in QUESTIONS for c in cs[:2]]
        reqs += [Instance("loglikelihood", {}, ("", "the model reads tokens"), 0)]
        ours = trainer.harness.lm.loglikelihood(reqs)
        hf = HFLM(pretrained=str(export), device="cpu", dtype="float32", batch_size=3)
        theirs = hf.loglikelihood(reqs)
        assert [g for _, g in ours] == [g for _, g in theirs]
        assert [lp for lp, _ in ours] == pytest.approx([lp for lp, _ in theirs], abs=1e-4)
        rolling = [Instance("loglikelihood_rolling", {}, ("the model reads tokens " * 9,), 0)]
        assert trainer.harness.lm.loglikelihood_rolling(rolling) == pytest.approx(
            hf.loglikelihood_rolling(rolling), abs=1e-3)
        until = [Instance("generate_until", {}, ("the model reads", {"until": ["."],
                                                                     "max_gen_toks": 12}), 0)]
        assert trainer.harness.lm.generate_until(until) == hf.generate_until(until)
    finally:
        trainer.close()


@pytest.mark.budget(35)  # seconds on the reference machine: measured, +~40%
def test_unknown_task_is_one_line_before_training(tmp_path: Path, corpus: Path):
    tasks = write_task(tmp_path / "tasks")
    run = tmp_path / "run"
    args = train_args(run, corpus, tasks, **{"lm_eval.tasks": [TASK, "no_such_task"]})
    assert_one_line_error(tessel_here(*args), "unknown task(s) 'no_such_task'")
    assert not (run / "metrics.jsonl").exists()


def test_pipeline_parallelism_is_refused_before_launch():
    from tessel.config import Config
    from tessel.train.harness_check import LMEvalError, check_lm_eval_layout

    cfg = Config.load(None, {"parallel.pp": 2, "lm_eval.tasks": [TASK]})
    with pytest.raises(LMEvalError, match="does not run under parallel.pp=2"):
        check_lm_eval_layout(cfg)
    check_lm_eval_layout(Config.load(None, {"parallel.cp": 2, "lm_eval.tasks": [TASK]}))


def test_launchers_refuse_what_the_workers_would_before_starting_them(
        tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """`tessel train --nproc 2` refuses lm_eval under pipeline parallelism (and a task that
    does not load) itself, in one line, instead of starting torchrun; `tessel launch`
    refuses the layout before printing a job."""
    import tessel.launch.local

    def launched(*args):
        raise AssertionError(f"torchrun was started: {args}")

    monkeypatch.setattr(tessel.launch.local, "run_local", launched)
    tasks = write_task(tmp_path / "tasks")
    run = tmp_path / "run"
    for extra, needle in (({"parallel.pp": 2}, "does not run under parallel.pp=2"),
                          ({"lm_eval.tasks": ["broken_mc"]}, "task 'broken_mc'")):
        if "lm_eval.tasks" in extra:
            _broken_task(tasks, "missing_data")
        capsys.readouterr()
        assert main([*train_args(run, corpus, tasks, **extra), "--nproc", "2"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and needle in err[0], err
        assert not run.exists()
    capsys.readouterr()
    root = Path(__file__).parents[2]
    assert main(["launch", "slurm", str(root / "configs/tiny.toml"), "--nodes", "1",
                 "--gpus-per-node", "2", "--parallel.pp=2", f"--lm_eval.tasks=['{TASK}']",
                 f"--lm_eval.include_path={tasks}", f"--output-dir={tmp_path / 'logs'}"]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "does not run under parallel.pp=2" in out.err


BROKEN = {
    # lm_eval raises a TypeError without a message at the first document
    "no_doc_to_text": (lambda text: text.replace('doc_to_text: "{{question}}"\n', ""),
                       "cannot be loaded: TypeError (in doc_to_text)"),
    "missing_data": (lambda text: text.replace("mc.jsonl", "gone.jsonl"),
                     "cannot be loaded: FileNotFoundError: Unable to find"),
    "syntax_error": (lambda text: text.replace("output_type: multiple_choice",
                                               "output_type: [multiple_choice"),
                     "broken_mc.yaml cannot be parsed (while parsing a flow sequence from line 7, "
                     "column 14: expected ',' or ']', but got ':' at line 8"),
    # these three were lm_eval's words, which name nothing ("StopIteration (in
    # _split_generators)", "KeyError: None (in __init__)", "TypeError: expected str, bytes or
    # os.PathLike object, not NoneType (in _parse_args)"), or a failure at the first scoring
    "empty_data": (lambda text: text.replace("mc.jsonl", "empty.jsonl"),
                   "cannot be loaded: task 'broken_mc' reads "),  # ... empty.jsonl, which is empty
    "unknown_metric": (lambda text: text.replace(
        "  - metric: acc_norm\n    aggregation: mean\n    higher_is_better: true\n",
        "  - metric: acc_nrom\n"),
        "task 'broken_mc' asks for metric 'acc_nrom', which lm_eval does not have (its "
        "metrics: acc, "),
    "unknown_metric_aggregated": (lambda text: text.replace("metric: acc_norm", "metric: acc_nrom"),
                                  "task 'broken_mc' asks for metric 'acc_nrom', which lm_eval "
                                  "does not have"),
    "group_unknown_task": (lambda text: f"group: broken_mc\ntask:\n  - {TASK}\n  - tessel_nc\n",
                           "group 'broken_mc' (TASKS/broken_mc.yaml) lists task 'tessel_nc', "
                           "which lm_eval does not know"),
    "long_generation": (lambda text: text.replace(
        "output_type: multiple_choice",
        "output_type: generate_until\ngeneration_kwargs:\n  until: ['.']\n  max_gen_toks: 4096"),
        "a task asks for 4096 generated tokens but the model's context is 256"),
}


def _broken_task(tasks: Path, case: str) -> None:
    """Task `broken_mc` beside the good one: its YAML edited as BROKEN[case] says."""
    edit, _ = BROKEN[case]
    (tasks / "empty.jsonl").write_text("")
    text = (tasks / f"{TASK}.yaml").read_text().replace(f"task: {TASK}", "task: broken_mc")
    (tasks / "broken_mc.yaml").write_text(edit(text))


@pytest.mark.parametrize("case", BROKEN)
def test_a_task_that_cannot_be_scored_is_refused_before_training(case, tmp_path: Path,
                                                                 corpus: Path, capsys):
    """Each task is loaded and one request built before the first step (a broken task used to
    train to the end and fail at the final scoring, with no checkpoint); a YAML that does not
    parse is named with its line, not reported as an unknown task."""
    tasks = write_task(tmp_path / "tasks")
    _broken_task(tasks, case)
    run = tmp_path / "run"
    capsys.readouterr()
    assert main(train_args(run, corpus, tasks, **{"lm_eval.tasks": [TASK, "broken_mc"]})) == 2
    err = capsys.readouterr().err.strip().splitlines()
    needle = BROKEN[case][1].replace("TASKS", str(tasks))
    assert len(err) == 1 and "lm_eval.tasks:" in err[0] and needle in err[0], err
    assert str(tasks / "broken_mc.yaml") in err[0]
    if case == "empty_data":
        assert f"reads {tasks / 'empty.jsonl'}, which is empty (no records)" in err[0], err
    assert not run.exists()


def test_a_scoring_failure_costs_the_scores_not_the_checkpoint(tmp_path: Path, corpus: Path):
    """A task that loaded before training but fails at a scoring (its data file removed
    since): one line and an event, training goes on to its final checkpoint, no more scoring,
    and the run ends with exit code 7, which automatic restarts keep."""
    from tessel.checkpoint import latest_checkpoint
    from tessel.config import Config
    from tessel.observe.events import read_events
    from tessel.train import Trainer

    tasks = write_task(tmp_path / "tasks")
    run = tmp_path / "run"
    cfg = Config.load(None, overrides(run, corpus, tasks, **{
        "train.steps": 2, "lm_eval.interval": 1, "data.cache_dir": str(tmp_path / "cache")}))
    trainer = Trainer(cfg, console=False)
    (tasks / "mc.jsonl").rename(tmp_path / "mc.jsonl")
    try:
        result = trainer.train()
    finally:
        trainer.close()
    assert result.step == 2 and result.exit_code == 7
    assert "lm_eval scoring failed at step 1: FileNotFoundError" in result.scoring_failure
    assert latest_checkpoint(run / "checkpoints").name == "step_00000002"
    failed = [e for e in read_events(run) if e["kind"] == "lm_eval_failed"]
    assert [e["step"] for e in failed] == [1]
    assert scores(run) == {}
    (tmp_path / "mc.jsonl").rename(tasks / "mc.jsonl")
    assert main(["train", "--auto-resume", f"--run.dir={run}", "--quiet"]) == 7


@pytest.mark.budget(60)  # seconds on the reference machine: measured (up to 48 s in CI), +~25%
@pytest.mark.slow
def test_two_processes_score_like_one(trained, tmp_path: Path):
    """DDP (the wrapped module), ZeRO-3 (every rank calls forward together: FSDP's
    all-gathers), TP2 (vocabulary-sharded logits gathered) and CP2 (training on half of each
    sequence per rank; scoring on whole requests, replicated over the cp ranks), one after
    another in one torchrun job (tests/distributed/worker.py), against the single-process
    run."""
    run, corpus, tasks = trained
    layouts = {"ddp": {"parallel.zero": 0}, "zero3": {"parallel.zero": 3}, "tp2": {"parallel.tp": 2},
               "cp2": {"parallel.cp": 2}}
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"runs": [{"overrides": overrides(tmp_path / name, corpus, tasks,
                                                                 **extra)}
                                         for name, extra in layouts.items()]}))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_DATASETS_OFFLINE": "1",
           "HF_HUB_OFFLINE": "1"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node=2", str(WORKER), str(spec)],
                         capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    for name in layouts:
        assert scores(tmp_path / name) == scores(run), name


def test_a_local_task_can_run_python_as_the_docs_warn(tmp_path: Path):
    """docs/evaluation.md: a task YAML's `!function` imports a .py file beside it (lm_eval's
    design), so `lm_eval.include_path` must name only task files you trust. It does."""
    from tessel.train.harness_check import task_manager

    docs = (Path(__file__).parents[2] / "docs" / "evaluation.md").read_text()
    assert "point `lm_eval.include_path` only at task files you trust" in docs
    tasks, ran = write_task(tmp_path / "tasks"), tmp_path / "RAN"
    (tasks / "utils.py").write_text(f"import pathlib\npathlib.Path({str(ran)!r}).touch()\n"
                                    "def doc_to_text(doc):\n    return doc['question']\n")
    yaml_path = tasks / f"{TASK}.yaml"
    yaml_path.write_text(yaml_path.read_text().replace(f"task: {TASK}", "task: fn_mc").replace(
        'doc_to_text: "{{question}}"', "doc_to_text: !function utils.doc_to_text"))
    task_manager(str(tasks), defaults=False).load(["fn_mc"])
    assert ran.exists()  # loading the task ran utils.py
