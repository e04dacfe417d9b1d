"""The `tessel` command as a user runs it. Real subprocesses where only a process can show
it: signals (SIGTERM/SIGINT at a step boundary, SIGKILL during saves) and the entry point's
own exit codes (`tessel fly`, `--bogus`). Everything else (training, generating, resuming,
refusals, `--help`, `config`, `presets`) runs in this process through the same
`tessel.cli.exit_code` the entry point calls (`tessel_here`): a subprocess costs ~5 s of
imports on the CI machine, and what a user sees comes from main() either way (stdout is not
a terminal in both, and CI=true is set in both)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tessel.checkpoint import list_checkpoints, load_model, load_optimizer, read_state
from tessel.config import Config
from tessel.models import build_model
from tessel.observe.metrics import read_metrics
from tessel.optim.groups import build_optimizer

ROOT = Path(__file__).resolve().parents[2]


def tessel(*args: str, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "CI": "true"}
    return subprocess.run([sys.executable, "-m", "tessel", *args], capture_output=True,
                          text=True, env=env, cwd=kw.pop("cwd", None), timeout=300, **kw)


def tessel_here(*args: str) -> subprocess.CompletedProcess:
    """`tessel ARGS` in this process, as `tessel.cli.run` runs it short of leaving the
    process (`tessel.cli.exit_code`: argparse's SystemExit becomes the exit code, an
    unexpected exception a traceback on stderr and exit 1, so "no traceback" is still
    checked)."""
    import contextlib
    import io

    from tessel.cli import exit_code

    out, err = io.StringIO(), io.StringIO()
    saved = os.environ.get("CI")
    os.environ["CI"] = "true"
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            code = exit_code(list(args))
    finally:
        if saved is None:
            os.environ.pop("CI", None)
        else:
            os.environ["CI"] = saved
    return subprocess.CompletedProcess(["tessel", *args], code, out.getvalue(), err.getvalue())


def start(*args: str) -> subprocess.Popen:
    env = {**os.environ, "CI": "true"}
    return subprocess.Popen([sys.executable, "-m", "tessel", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def train_args(run: Path, corpus: Path, *extra: str) -> list[str]:
    return ["train", str(ROOT / "configs/tiny.toml"), f"--run.dir={run}",
            "--data.source=files", f"--data.paths=['{corpus}']", "--data.tokenizer=bytes",
            "--train.seq_len=32",
            "--train.eval_iters=2", "--metrics.tensorboard=false", *extra]


def assert_one_line_error(proc: subprocess.CompletedProcess, needle: str) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessel: error: "), proc.stderr
    assert needle in lines[0]
    assert "Traceback" not in proc.stderr + proc.stdout


def test_presets_lists_every_shape_with_counts():
    out = tessel_here("presets")
    assert out.returncode == 0
    # gpt2-124m: 124,439,808 with its 50,257 ids, + 47 padding rows x 768 (vocab_pad_to=128)
    for name, count in [("gpt2-124m", "124,475,904"), ("llama3-8b", "8,030,261,248"),
                        ("llama3-405b", "405,853,388,800"), ("tiny", "149,248")]:
        assert any(line.startswith(name + " ") and count in line for line in out.stdout.splitlines())
    assert "padded to a multiple of model.vocab_pad_to" in out.stdout


def test_help_and_config_commands(tmp_path: Path):
    assert "--resume RUN_DIR" in tessel_here("train", "--help").stdout
    optim_keys = next(line for line in tessel_here("train", "--help").stdout.splitlines()
                      if line.strip().startswith("[optim]"))
    assert " name," in optim_keys and " lr," in optim_keys
    out = tessel_here("config", str(ROOT / "configs/gpt2-124m.toml"), "--train.steps=7")
    f = tmp_path / "c.toml"
    f.write_text(out.stdout)
    assert Config.load(f).train.steps == 7 and Config.load(f).model.d_model == 768
    assert "| `optim.lr` |" in tessel_here("config", "--reference").stdout


def test_train_generate_resume(tmp_path: Path, corpus: Path):
    run = tmp_path / "run"
    out = tessel_here(*train_args(run, corpus, "--train.steps=6", "--checkpoint.interval=3",
                                  "--metrics.log_interval=2", "--run.sample_tokens=10"))
    assert out.returncode == 0, out.stderr
    assert "step 6/6 | loss" in out.stdout and "sample:" in out.stdout
    assert "\x1b[" not in out.stdout  # CI=true: plain lines, no terminal control codes
    assert [s for s, _ in list_checkpoints(run / "checkpoints")] == [3, 6]
    assert (run / "checkpoints/latest").resolve().name == "step_00000006"

    greedy = [tessel_here("generate", str(run), "--prompt", "the ", "--max-new-tokens", "20",
                          "--temperature", "0") for _ in range(2)]
    assert greedy[0].returncode == 0 and greedy[0].stdout.startswith("the ")
    assert greedy[0].stdout == greedy[1].stdout
    unprompted = tessel_here("generate", str(run), "--max-new-tokens", "5", "--seed", "1")
    assert unprompted.returncode == 0, unprompted.stderr
    sampled = tessel_here("generate", str(run / "checkpoints/latest"), "--prompt", "the ",
                          "--max-new-tokens", "20", "--top-k", "5", "--seed", "3")
    assert sampled.returncode == 0 and sampled.stdout.startswith("the ")

    more = tessel_here("train", "--resume", str(run), "--train.steps=8")
    assert more.returncode == 0, more.stderr
    assert "resuming at step 6" in more.stdout
    steps = [r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    assert steps == [2, 4, 6, 8]


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["--model.n_layer=3"], "did you mean 'model.n_layers'"),
        (["--train.steps=ten"], "train.steps: input should be a valid integer"),
        (["--optim.lr=-1"], "optim.lr: input should be greater than 0"),
        (["--train.global_batch_size=12"], "not divisible by micro_batch_size*dp=8"),
        (["--train.seq_len=1000"], "exceeds model.max_seq_len=256"),
        (["--bogus"], "unknown option '--bogus'"),
        (["--data.paths=['/nonexistent/corpus']"],
         "does not exist; pass existing files or directories; fix data.paths"),
        (["--model.vocab_size=100"], "set model.vocab_size >= 257"),
    ],
)
def test_bad_train_input_is_one_line_exit_2_and_writes_nothing(tmp_path, corpus, args, needle):
    run = tmp_path / "run"
    assert_one_line_error(tessel_here(*train_args(run, corpus, *args)), needle)
    assert not run.exists()


def test_bad_files_and_commands(tmp_path: Path):
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    assert_one_line_error(tessel_here("train", str(bad)), "is not valid TOML")
    assert_one_line_error(tessel_here("train", str(tmp_path / "none.toml")), "does not exist")
    assert_one_line_error(tessel_here("train", "--resume", str(tmp_path)), "not a tessel run directory")
    assert_one_line_error(tessel_here("generate", str(tmp_path)), "not a tessel run directory")
    assert_one_line_error(tessel_here("generate", str(tmp_path), "--temperature", "-1"),
                          "--temperature must be >= 0")
    assert_one_line_error(tessel_here("generate", str(tmp_path), "--temperature", "nan"),
                          "--temperature must be >= 0")
    assert_one_line_error(tessel_here("generate", str(tmp_path), "--device", "tpu"), "invalid choice")
    assert_one_line_error(tessel_here("train", "--resume", str(tmp_path), "--run.dir=x"),
                          "drop --run.dir")
    # the same refusals from the real entry point (`python -m tessel`): one line, exit 2
    assert_one_line_error(tessel("fly"), "unknown command 'fly'")
    assert_one_line_error(tessel("train", "--bogus"), "unknown option '--bogus'")
    assert not list(tmp_path.iterdir())[1:]  # only bad.toml


def test_incompatible_or_damaged_resume_is_refused_and_changes_nothing(tmp_path, corpus):
    run = tmp_path / "run"
    assert tessel_here(*train_args(run, corpus, "--train.steps=2")).returncode == 0
    assert_one_line_error(tessel_here(*train_args(run, corpus, "--train.steps=2")),
                          "already holds a run")
    snapshot = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert_one_line_error(tessel_here("train", "--resume", str(run), "--model.n_layers=3"),
                          "model.n_layers was 2 in the run, now 3")
    weights = (run / "checkpoints/latest").resolve() / "__0_0.distcp"
    weights.write_bytes(weights.read_bytes()[:100])
    snapshot[weights] = weights.read_bytes()
    assert_one_line_error(tessel_here("train", "--resume", str(run)), "is damaged")
    assert_one_line_error(tessel_here("generate", str(run)), "is damaged")
    assert {p: p.read_bytes() for p in run.rglob("*") if p.is_file()} == snapshot


def _wait_for(predicate, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"exited early ({proc.returncode}): {proc.stderr.read()}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError("timed out")
        time.sleep(0.05)


@pytest.mark.budget(45)  # seconds on the reference machine: measured, +~40%
@pytest.mark.parametrize(("sig", "code"), [(signal.SIGTERM, 0), (signal.SIGINT, 130)])
def test_signal_checkpoints_at_the_step_boundary_and_exits(tmp_path, corpus, sig, code):
    run = tmp_path / "run"
    proc = start(*train_args(run, corpus, "--train.steps=100000", "--metrics.log_interval=1",
                             "--checkpoint.interval=0", "--train.eval_interval=0"))
    metrics = run / "metrics.jsonl"
    _wait_for(lambda: metrics.is_file() and len(metrics.read_text().splitlines()) >= 3, proc)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert "stopped at step" in out and f"tessel train --resume {run}" in out
    saved = list_checkpoints(run / "checkpoints")
    assert len(saved) == 1 and saved[0][0] >= 3
    resumed = tessel_here("train", "--resume", str(run), f"--train.steps={saved[0][0] + 1}")
    assert resumed.returncode == 0, resumed.stderr


@pytest.mark.budget(80)  # seconds on the reference machine: measured, +~40%
def test_sigkill_during_saves_never_leaves_a_damaged_checkpoint(tmp_path, corpus):
    """Kill -9 at random moments of a run that saves every step: every checkpoint that is
    visible must load completely, and the run must resume from the newest one."""
    run = tmp_path / "run"
    rng = random.Random(0)
    base = train_args(run, corpus, "--model.preset=demo", "--train.steps=100000",
                      "--checkpoint.interval=1", "--checkpoint.keep_last=2",
                      "--metrics.log_interval=1000")
    cfg = None
    ckpts = run / "checkpoints"
    for attempt in range(3):
        args = ["train", "--resume", str(run)] if attempt else base
        newest = list_checkpoints(ckpts)[-1][0] if attempt else -1
        proc = start(*args)
        _wait_for(lambda n=newest: list_checkpoints(ckpts)[-1:] and
                  list_checkpoints(ckpts)[-1][0] > n, proc)
        time.sleep(rng.uniform(0.0, 0.5))
        proc.kill()
        proc.wait()
        cfg = cfg or Config.load(run / "config.toml")
        visible = list_checkpoints(ckpts)
        assert visible, "no checkpoint survived"
        for _, path in visible:
            read_state(path)
            model = build_model(cfg.model, seed=1)
            load_model(path, model)
            load_optimizer(path, model, build_optimizer(model, cfg.optim, model.output.weight.device))
        assert (ckpts / "latest").resolve().parent == ckpts.resolve()
        assert (ckpts / "latest" / "state.json").is_file()


def test_auto_resume_starts_then_continues_the_run(tmp_path, corpus):
    run = tmp_path / "run"
    first = tessel_here(*train_args(run, corpus, "--train.steps=2", "--auto-resume"))
    assert first.returncode == 0, first.stderr
    assert "tessel: training" in first.stdout
    again = tessel_here(*train_args(run, corpus, "--train.steps=4", "--auto-resume"))
    assert again.returncode == 0, again.stderr
    assert "resuming at step 2" in again.stdout
    assert [s for s, _ in list_checkpoints(run / "checkpoints")][-1] == 4
    assert_one_line_error(tessel_here("train", "--auto-resume", "--resume", str(run)),
                          "exclude each other")
