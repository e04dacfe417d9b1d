"""Shared fixtures: a small learnable text corpus and tiny configs that train in seconds."""

from __future__ import annotations

import json
import os
import random
import sys
from pathlib import Path

import pytest
import system_packages
import torch

from tessel.config import Config

# Two threads: the CI machine has two cores, and results must not depend on the host; one per
# worker when two xdist workers share them (two threads each, with the other core busy,
# made small ops up to 20 times slower).
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER:
    # ... and so does every process a test starts (`tessel train`, torchrun, a SLURM job):
    # torch and the tokenizers' Rayon pool otherwise take every core each. Measured on the
    # 2-core CI machine: the stdlib corpus test took 192 s beside the layout tests instead of
    # 27 s alone, `tessel train` subprocesses 2-4x their time.
    for _name in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
        os.environ.setdefault(_name, "1")
torch.set_num_threads(int(os.environ.get(
    "TESSEL_TEST_THREADS", 1 if _WORKER else min(2, os.cpu_count() or 1))))

WORKERS = 2
"""xdist workers for `-n auto`: the CI machine's two cores."""
PROCESSES = ("tests/distributed/", "tests/integration/test_lm_eval.py::test_two_processes_score_like_one")
"""Tests that start several training processes: one at a time, on one worker (the scope
"processes"), beside the other worker's single-process tests. Not test_slurm.py, whose jobs
mostly wait (a paced run of a tiny model, SLURM's scheduling): with it, this scope was 28 of
the suite's 47 summed minutes, and the other worker sat idle for the last 9; it is a module
like any other now, on whichever worker takes it."""


WAITING_FIRST = ("tests/distributed/test_multinode.py", "tests/distributed/test_scale_measure.py",
                 "tests/distributed/test_restarts.py", "tests/distributed/test_launch_exit_codes.py",
                 "tests/distributed/test_layouts.py::test_a_hung_rank_ends_the_job")
"""Tests of the scope "processes" that mostly wait (a lost node's rendezvous, paced and
timed sweeps, restarts, rendezvous timeouts, torchrun's 30 s before it kills a hung rank):
they run first, beside the other worker's CPU-bound single-process modules, so that the
layout matrix, which keeps both cores busy, falls beside SLURM's paced jobs, which mostly
wait. In collection order the two waiting stretches met (20-45% of the CPU idle for ~3
minutes); first, a full run here took 877 s against 888 s, idle 8.9% against 10.1%."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return min(WORKERS, os.cpu_count() or 1)


def _scope(nodeid: str) -> str:
    """The unit of work one xdist worker takes whole: the multi-process tests together (one
    at a time, and the session's reference runs trained once), otherwise the test's module
    (its module fixtures built once)."""
    return "processes" if nodeid.startswith(PROCESSES) else nodeid.split("::")[0]


def pytest_xdist_make_scheduler(config: pytest.Config, log):  # noqa: ANN001, ANN201
    """`--dist loadscope` with the scopes of `_scope`, in collection order (tests/distributed
    first: the longest scope starts at once). Not the `xdist_group` marker: pytest 9.2 keeps
    node ids where xdist 3.8's `--dist loadgroup` can no longer add the group to them, so
    grouped tests went to both workers."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class Scopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _scope(nodeid)

    config.option.loadscopereorder = False
    return Scopes(config, log)

_WORDS = (
    "the model reads tokens and predicts the next token from the past while the optimizer "
    "updates weights with gradients computed by backpropagation through every layer"
).split()


def write_corpus(root: Path, n_docs: int = 12, words_per_doc: int = 400, seed: int = 0) -> Path:
    """Deterministic English-like documents with learnable structure (a small vocabulary
    in mostly fixed phrases), enough for a tiny model to beat the unigram baseline fast."""
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for d in range(n_docs):
        words = []
        while len(words) < words_per_doc:
            start = rng.randrange(len(_WORDS) - 6)
            words += _WORDS[start : start + rng.randint(3, 6)] + ["."]
        (root / f"doc{d:03d}.txt").write_text(" ".join(words) + "\n")
    return root


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch):
    # One tokenized-corpus cache per test session, never the user's ~/.cache.
    monkeypatch.setenv("TESSEL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    return write_corpus(tmp_path / "corpus")


@pytest.fixture(scope="session")
def refs(tmp_path_factory: pytest.TempPathFactory):  # noqa: ANN201 (References lives in tests/distributed)
    """The single-process reference runs of tests/distributed, each trained when first asked
    for, once per session: test_layouts.py and test_restarts.py compare against the same ones.
    (It lives here, not in a tests/distributed/conftest.py: a second module named 'conftest'
    would shadow this one for every `from conftest import ...`.)"""
    from test_layouts import References  # importable once a tests/distributed module is collected

    return References(tmp_path_factory.mktemp("ref"))


def tiny_overrides(run_dir: Path, corpus_dir: Path, **extra) -> dict:
    """Overrides for a tiny model on `corpus_dir` that trains a step in milliseconds."""
    base = {
        "model.preset": "tiny",
        "data.source": "files",
        "data.paths": [str(corpus_dir)],
        "data.tokenizer": "bytes",
        "data.split": "90,10",
        "train.steps": 8,
        "train.seq_len": 32,
        "train.micro_batch_size": 4,
        "train.global_batch_size": 8,
        "train.eval_interval": 0,
        "train.eval_iters": 2,
        "optim.lr": 3e-3,
        "optim.warmup_steps": 2,
        "checkpoint.interval": 0,
        "metrics.log_interval": 1,
        "metrics.tensorboard": False,
        "run.dir": str(run_dir),
        "run.sample_tokens": 0,
    }
    base.update(extra)
    return base


@pytest.fixture
def tiny_config(tmp_path: Path, corpus: Path):
    def make(run_name: str = "run", **extra) -> Config:
        return Config.load(None, tiny_overrides(tmp_path / run_name, corpus, **extra))

    return make


def forge_state(path: Path) -> None:
    """Make a checkpoint's state.json agree with its files as they are now (sizes and
    checksums), as an attacker who controls the whole directory would."""
    from tessel.checkpoint.checksum import DIGEST_KEY, file_digests

    state = json.loads((path / "state.json").read_text())
    state["files"] = {f: (path / f).stat().st_size for f in state["files"]}
    state[DIGEST_KEY] = file_digests([path / f for f in state["files"]])
    state.pop("state_sha256", None)  # its self-checksum: an attacker drops it too
    (path / "state.json").write_text(json.dumps(state))


# ---- the time budget: a test that grows past its budget is named in every run's summary ----
#
# Budgets are in seconds on the reference machine (the slower CI host: a 2-core AMD EPYC with
# AVX2, on which the demo trains at ~3k tokens/s) and scale with this machine's speed,
# measured once per session by a fixed workload (`_machine_factor`). Tests assert behaviour,
# never time: an overrun is reported (CI prints it; `TESSEL_TEST_BUDGET=strict` turns it into a
# failed session), so growth is seen when it happens rather than at the 90-minute limit.
BUDGET_S = {"default": 20.0, "slow": 120.0}
"""Seconds (reference machine) a test may take, setup and teardown included; a test states
its own with @pytest.mark.budget(seconds), and with `waits=seconds` the part of it that no
faster machine shortens (torchrun's grace before it kills a hung rank, SLURM's scheduling),
added to the scaled budget rather than scaled with it."""
SUITE_BUDGET_S = 25 * 60
"""The whole suite on the reference machine (15 minutes on the fast CI machine)."""
_REFERENCE_WORKLOAD_S = 0.20
"""What `_machine_factor`'s workload takes on the reference machine (measured there: 0.18 to
0.23 s with the other core busy)."""
_durations: dict[str, float] = {}
_budgets: dict[str, tuple[float, float]] = {}
"""Each test's budget: (seconds on the reference machine, seconds of waiting on any machine)."""
_DEFAULT_BUDGET = (BUDGET_S["default"], 0.0)


def over_budget(durations: dict[str, float], budgets: dict[str, tuple[float, float]],
                factor: float) -> list[tuple[float, str, float]]:
    """(seconds taken, test, its budget on this machine) of each test over its budget,
    slowest first: the scaled part times the machine `factor`, plus the waits."""
    def here(nodeid: str) -> float:
        scaled, waits = budgets.get(nodeid, _DEFAULT_BUDGET)
        return scaled * factor + waits

    return sorted(((d, nodeid, here(nodeid)) for nodeid, d in durations.items()
                   if d > here(nodeid)), reverse=True)


def _machine_factor() -> float:
    """This machine's time for a fixed workload (a tiny model's training steps, the kind of
    work the suite does) over the reference machine's: < 1 on a faster machine."""
    import time

    from tessel.models import build_model

    cfg = Config.load(None, {"model.preset": "tiny-llama", "model.n_layers": 2}).model
    model = build_model(cfg, "cpu", seed=0)
    x = torch.randint(0, cfg.vocab_size, (4, 128), generator=torch.Generator().manual_seed(0))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: a busy second core must not make it 20x slower
    try:
        model(x).float().logsumexp(-1).mean().backward()  # warm-up: allocator, first calls
        best = float("inf")
        for _ in range(3):  # the best of three: what the machine can do, not what it did
            start = time.perf_counter()
            for _ in range(10):
                model(x).float().logsumexp(-1).mean().backward()
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best / _REFERENCE_WORKLOAD_S


def pytest_configure(config: pytest.Config) -> None:
    if _WORKER:  # the session's id, which every worker shares (tests/system_packages.py)
        os.environ[system_packages.RUN_ID] = config.workerinput["testrunuid"]
    else:  # before the workers start: they, and every process they start, inherit it
        _write_bytecode()


def _write_bytecode() -> None:
    """Every process of the session writes the bytecode of the modules it imports (each
    module's __pycache__; git ignores them), so the next process reads it instead of
    compiling again, even where PYTHONDONTWRITEBYTECODE is set (as on the project's
    machines). The suite starts ~300 Python processes (`tessel` subprocesses, torchrun
    workers, SLURM job steps), most of which import the trainer: 3.7 s of CPU with bytecode,
    4.2 s without. With it the README's test command installs with `pip install
    --no-compile`: pip byte-compiles every file of every package it installs, on one core
    (44 s of the 96 s install on the 2-core machine), where the suite imports a fraction of
    them; here each is compiled once, by the first process that imports it (importlib writes
    it atomically: concurrent first imports are safe)."""
    os.environ.pop("PYTHONDONTWRITEBYTECODE", None)
    sys.dont_write_bytecode = False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # the same order on every worker (xdist compares their collections): a stable sort
    items.sort(key=lambda item: not item.nodeid.startswith(WAITING_FIRST))
    for item in items:
        mark = item.get_closest_marker("budget")
        budget = (float(mark.args[0]) if mark is not None
                  else BUDGET_S["slow" if item.get_closest_marker("slow") else "default"])
        waits = float(mark.kwargs.get("waits", 0.0)) if mark is not None else 0.0
        # in the report, which reaches the xdist controller (collection is the workers')
        item.user_properties.append(("budget_s", (budget, waits)))


def pytest_collection_finish(session: pytest.Session) -> None:
    # the Debian packages the selected tests (after -m and -k) run and this machine lacks,
    # installed in the background while the first tests run
    if not session.config.option.collectonly:
        system_packages.start([item.nodeid for item in session.items])


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if _WORKER:  # the controller gets every worker's reports too
        return
    nodeid = report.nodeid.split("@")[0]  # without xdist's group suffix
    _durations[nodeid] = _durations.get(nodeid, 0.0) + report.duration
    _budgets[nodeid] = tuple(dict(report.user_properties).get("budget_s", _DEFAULT_BUDGET))
    log = os.environ.get("TESSEL_TEST_DURATIONS")
    if log:  # every phase as it ends: a run cut short still says where its time went
        with open(log, "a") as f:
            f.write(f"{nodeid}\t{report.when}\t{report.duration:.2f}\t{report.outcome}\n")


_verdict: dict[str, object] = {}
_started: list[float] = []


def pytest_sessionstart(session: pytest.Session) -> None:
    import time

    _started.append(time.monotonic())


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    if len(_durations) < 50 or _WORKER:  # a few tests picked by hand; or an xdist worker
        return
    factor = _machine_factor()
    over = over_budget(_durations, _budgets, factor)
    import time

    total = time.monotonic() - _started[0]  # wall time: with two workers less than the sum
    _verdict.update(factor=factor, over=over, total=total, summed=sum(_durations.values()))
    if os.environ.get("TESSEL_TEST_BUDGET") == "strict" and (over or total > SUITE_BUDGET_S * factor):
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:  # noqa: ANN001
    if not _verdict:
        return
    factor, over, total = _verdict["factor"], _verdict["over"], _verdict["total"]
    write = terminalreporter.write_line
    terminalreporter.section("time budget")
    write(f"machine factor {factor:.2f} (1.0 = the reference 2-core AMD EPYC); the session took "
          f"{total / 60:.1f} min of {SUITE_BUDGET_S * factor / 60:.1f} min budgeted (tests "
          f"{_verdict['summed'] / 60:.1f} min summed)")
    for d, nodeid, budget in over:  # type: ignore[attr-defined]
        write(f"over budget: {nodeid} took {d:.1f} s, budget {budget:.1f} s")
    if not over:
        write("every test within its budget")
