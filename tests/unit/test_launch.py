"""Launching: `tessel train --nproc N` (torchrun on this machine) and the job files that
`tessel launch slurm|k8s` prints. No test here starts more than one tiny Python child."""

from __future__ import annotations

import gzip
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from tessel.cli import main
from tessel.errors import TesselError
from tessel.launch import job_text, local, slurm

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/tiny.toml")
# An override whose value has a space, quotes and shell syntax that must reach tessel verbatim.
NASTY = """--data.paths=["my corpus/it's $(HOME) $$"]"""
FILES = "--data.source=files"  # data.paths is read by the files source
# configs/tiny.toml's global batch of 16 split over 8 data-parallel ranks.
MB2 = "--train.micro_batch_size=2"


def assert_one_line_error(code: int, err: str, needle: str) -> None:
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessel: error: "), err
    assert needle in lines[0], lines[0]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def train_array(script: str, cwd: Path) -> list[str]:
    """The `tessel train` arguments a job script passes, as bash parses them."""
    lines = script.splitlines()
    start = next(i for i, line in enumerate(lines) if line.lstrip().startswith("TRAIN=("))
    block = lines[start] + '\nprintf "%s\\0" "${TRAIN[@]}"\n'
    out = subprocess.run(["bash", "-c", block], cwd=cwd, capture_output=True, text=True, check=True)
    return out.stdout.split("\0")[:-1]


def k8s_expand(arg: str) -> str:
    """What Kubernetes does to a container arg before running it: `$$` becomes `$`, and
    `$(VAR)` becomes VAR's value (here a marker)."""
    return re.sub(r"\$(\$|\(\w+\))", lambda m: "$" if m[1] == "$" else "<expanded>", arg)


# ---- tessel train --nproc -----------------------------------------------------------------


def test_torchrun_command_runs_tessel_train_with_the_arguments_unchanged():
    assert local.torchrun_command(4, ["cfg.toml", "--train.steps", "5"]) == [
        sys.executable, "-m", "tessel.launch.torchrun", "--standalone", "--nproc-per-node", "4",
        "-m", "tessel", "train", "cfg.toml", "--train.steps", "5",
    ]


@pytest.mark.parametrize("argv, nproc", [
    (["cfg.toml", "--nproc", "2", "--x.y=1"], 2),
    (["--nproc=3", "cfg.toml", "--x.y=1"], 3),
    (["cfg.toml", "--x.y=1"], None),
])
def test_split_nproc_takes_out_only_the_nproc_flag(argv: list[str], nproc: int | None):
    assert local.split_nproc(argv) == (nproc, ["cfg.toml", "--x.y=1"])


@pytest.mark.parametrize("args", [["--nproc", "two"], ["--nproc=0"], ["--nproc", "-1"], ["--nproc"],
                                  ["--nproc=1.5"]])
def test_bad_nproc_is_one_line_and_exit_2(capsys, monkeypatch, args: list[str]):
    monkeypatch.setattr(local, "run_local", lambda *a: pytest.fail("must not launch"))
    code, _, err = run_cli(capsys, "train", *args)
    assert_one_line_error(code, err, "--nproc needs a whole number >= 1")


@pytest.mark.parametrize("var", ["TORCHELASTIC_RUN_ID", "LOCAL_RANK"])
def test_nproc_is_refused_inside_torchrun(capsys, monkeypatch, var: str):
    monkeypatch.setenv(var, "0")
    code, _, err = run_cli(capsys, "train", "--nproc", "2")
    assert_one_line_error(code, err, "drop it when launching with torchrun")


def test_nproc_validates_the_config_in_the_parent_before_spawning(capsys, monkeypatch):
    monkeypatch.setattr(local, "run_local", lambda *a: pytest.fail("must not launch"))
    code, _, err = run_cli(capsys, "train", CONFIG, "--nproc", "2", "--train.steps=-1")
    assert_one_line_error(code, err, "train.steps")
    code, _, err = run_cli(capsys, "train", "--nproc", "2", "--resume", "/nonexistent/run")
    assert_one_line_error(code, err, "not a tessel run directory")


def test_nproc_passes_the_other_arguments_to_the_workers(capsys, monkeypatch):
    calls = []
    monkeypatch.setattr(local, "run_local", lambda n, args: calls.append((n, args)) or 7)
    assert main(["train", CONFIG, "--nproc", "2", "--train.steps", "5", "--quiet"]) == 7
    assert calls == [(2, [CONFIG, "--train.steps", "5", "--quiet"])]


def test_nproc_1_trains_in_this_process(monkeypatch):
    monkeypatch.setattr(local, "run_local", lambda *a: pytest.fail("must not launch"))
    trained = []

    class FakeTrainer:
        def __init__(self, cfg, resume, console, force=False, auto_resume=False):
            trained.append(cfg.train.steps)

        def train(self):
            return SimpleNamespace(exit_code=0)

        def close(self):
            pass

    monkeypatch.setattr("tessel.train.Trainer", FakeTrainer)
    assert main(["train", CONFIG, "--nproc=1", "--train.steps=3"]) == 0
    assert trained == [3]


@pytest.mark.parametrize("sig, child_code, code", [
    (signal.SIGTERM, 7, 7),     # torchrun's exit code is ours
    (signal.SIGINT, 1, 130),    # torchrun exits 1 after a forwarded Ctrl-C; tessel's code is 130
])
def test_run_local_forwards_signals_and_returns_the_exit_code(tmp_path: Path, monkeypatch, sig,
                                                              child_code: int, code: int):
    # A stand-in for torchrun that exits with child_code on `sig`, once it can receive it.
    ready = tmp_path / "ready"
    child = ("import signal, sys, time, pathlib\n"
             f"signal.signal({int(sig)}, lambda *a: sys.exit({child_code}))\n"
             f"pathlib.Path({str(ready)!r}).touch()\n"
             "time.sleep(60)\n")
    monkeypatch.setattr(local, "torchrun_command", lambda n, args: [sys.executable, "-c", child])

    def signal_us_when_ready() -> None:
        deadline = time.monotonic() + 30
        while not ready.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        signal.raise_signal(sig)  # handled by the main thread, inside run_local

    before = signal.getsignal(sig)
    threading.Thread(target=signal_us_when_ready, daemon=True).start()
    assert local.run_local(2, []) == code
    assert signal.getsignal(sig) is before  # our handlers are put back


# ---- tessel launch slurm ------------------------------------------------------------------


def test_slurm_script_is_valid_bash_with_rendezvous_requeue_and_resume(capsys, tmp_path: Path,
                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, script, err = run_cli(capsys, "launch", "slurm", CONFIG, "--nodes", "4", "--gpus-per-node",
                                "2", "--time", "1-12:00:00", "--partition", "gpu", "--port", "29555",
                                "--run.dir", "runs/a b", NASTY, FILES, MB2)
    assert code == 0, err
    (tmp_path / "job.sh").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], check=True)
    for directive in ("--nodes=4", "--ntasks-per-node=1", "--gpus-per-node=2", "--time=1-12:00:00",
                      "--partition=gpu", "--signal=B:TERM@120", "--requeue", "--open-mode=append",
                      "--output=logs/%x-%j.out", "--job-name=tessel-tiny"):
        assert f"#SBATCH {directive}\n" in script
    assert (tmp_path / "logs").is_dir()  # SLURM cannot start a job whose log directory is missing
    assert "--cpus-per-task" not in script  # GPU jobs: the cluster's default unless asked
    assert 'scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1' in script
    assert "PORT=29555\n" in script and '--master-addr "$HEAD" --master-port "$PORT"' in script
    assert f"PYTHON={shlex.quote(sys.executable)}\n" in script  # TESSEL_PYTHON overrides it
    assert 'PYTHON="${TESSEL_PYTHON:-$PYTHON}"\n' in script
    assert re.search(r'NODE=\("\$PYTHON" -m tessel.launch.node --nproc-per-node 2 .* -- '
                     r'"\$\{TRAIN\[@\]\}"\)', script)
    # several nodes: srun starts one launcher per node; the shell's signal goes to the steps
    assert 'srun --kill-on-bad-exit=1 --ntasks-per-node=1 "${NODE[@]}" &' in script
    assert "scancel --signal=TERM \"$SLURM_JOB_ID\"" in script
    assert '75)' in script and 'scontrol requeue "$SLURM_JOB_ID"' in script
    assert '[ "${SLURM_RESTART_COUNT:-0}" -lt 3 ]' in script

    # Every start of the job (and every requeue) continues the run if it exists.
    overrides = ["--run.dir=runs/a b", NASTY, FILES, MB2]
    assert train_array(script, tmp_path) == [CONFIG, *overrides, "--auto-resume"]


def test_an_elastic_slurm_job_leaves_its_task_count_to_slurm():
    """`--nodes 1:2` asks for no task count: with `#SBATCH --ntasks-per-node=1` sbatch set the
    job's task count to MIN x 1 and SLURM never gave it a second node, not even at a requeue
    with both free (measured: tests/integration/test_slurm.py). srun still starts one node
    launcher per node of whatever was allocated; a fixed-size job keeps asking for one each."""
    def sbatch_lines(**kw: int) -> list[str]:
        script = slurm.slurm_script("cfg.toml", [], gpus_per_node=0, python="python", **kw)
        assert 'srun --kill-on-bad-exit=1 --ntasks-per-node=1 "${NODE[@]}" &' in script
        return [line for line in script.splitlines() if line.startswith("#SBATCH")]

    elastic = sbatch_lines(nodes=2, min_nodes=1)
    assert "#SBATCH --nodes=1-2" in elastic
    assert [line for line in elastic if "--ntasks" in line] == []
    assert "#SBATCH --ntasks-per-node=1" in sbatch_lines(nodes=2)


def _run_two_node_script(tmp_path: Path, srun: str, restarts: int) -> tuple[int, str, str]:
    """The two-node CPU script run by bash with stub srun, scancel and scontrol (which record
    their arguments in calls.txt); `srun` is the stub's body. (exit code, stdout, calls)"""
    script = slurm.slurm_script("cfg.toml", [], nodes=2, gpus_per_node=0, python="python")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    record = 'echo "$(basename "$0") $*" >> "$CALLS"\n'
    stubs = {"srun": record + srun,
             "scancel": record,
             "scontrol": record + '[ "$1" = show ] && echo n0\nexit 0\n'}
    for name, body in stubs.items():
        (bin_dir / name).write_text("#!/bin/bash\n" + body)
        (bin_dir / name).chmod(0o755)
    (tmp_path / "job.sh").write_text(script)
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "CALLS": str(tmp_path / "calls.txt"),
           "SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[0-1]",
           "SLURM_RESTART_COUNT": str(restarts)}
    out = subprocess.run(["bash", str(tmp_path / "job.sh")], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=30)
    return out.returncode, out.stdout, (tmp_path / "calls.txt").read_text()


def test_slurm_nodes_a_stop_that_makes_srun_kill_the_step_requeues_the_job(tmp_path: Path):
    """`scancel --signal=TERM --full` on several nodes: srun gets the SIGTERM too and kills the
    step before it can save (measured on a real two-node SLURM: tests/integration/
    test_slurm.py). The script, signalled as well, requeues the job as stopped, however many
    times it was requeued before: the crash retries are not spent on it."""
    # srun signals the script, as `--full` does at the same moment, then dies as the killed
    # step's srun does
    code, out, calls = _run_two_node_script(
        tmp_path, 'kill -TERM "$PPID"; sleep 1; exit 137\n', restarts=3)
    assert code == 0, out
    assert "requeue 7" in calls.splitlines()[-1], calls
    assert "a stop signal ended the step without saving (exit 137" in out
    assert "the run failed" not in out
    # a crash without a stop signal still ends the job after 3 requeues, with the step's code
    (tmp_path / "crash").mkdir()
    code, out, calls = _run_two_node_script(tmp_path / "crash", "exit 137\n", restarts=3)
    assert code == 137 and "requeue" not in calls, calls


def test_slurm_cpu_job_on_one_node(capsys, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, script, err = run_cli(capsys, "launch", "slurm", CONFIG, "--nodes", "1",
                                "--gpus-per-node", "0", "--nproc-per-node", "2", "--python",
                                "/opt/env/bin/python", "--signal-grace", "300", "--output-dir",
                                "out/slurm", MB2)
    assert code == 0, err
    assert "gpus" not in script.replace("--gpus-per-node 0", "")  # no GRES on a CPU partition
    assert "#SBATCH --cpus-per-task=2\n" in script  # one core per process at least
    assert "#SBATCH --signal=B:TERM@300\n" in script
    assert "#SBATCH --output=out/slurm/%x-%j.out\n" in script and (tmp_path / "out/slurm").is_dir()
    assert "PYTHON=/opt/env/bin/python\n" in script
    assert "PORT=$((20000 + SLURM_JOB_ID % 40000))" in script  # each job its own rendezvous
    # one node: the launcher is started directly (`scancel --full` cannot make srun kill it);
    # a relay step passes a signal sent to the job's steps (preemption) on to it
    assert "srun --kill-on-bad-exit=1" not in script and '"${NODE[@]}" &' in script
    assert "srun --overlap --ntasks=1" in script and 'kill "$RELAY"' in script
    assert "kill -TERM \"$STEP\"" in script


def test_slurm_optional_directives_are_left_out(capsys, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, script, _ = run_cli(capsys, "launch", "slurm", CONFIG, "--nodes=1", MB2)
    assert code == 0
    assert "--partition" not in script and "--time=" not in script


def test_the_node_launcher_gives_each_worker_its_place_and_passes_their_exit_code():
    from tessel.launch import node

    a, train = node._parse(["--nproc-per-node", "4", "--nnodes", "2", "--node-rank", "1",
                            "--master-addr", "h", "--master-port", "1234", "--", "cfg.toml"])
    env = node.worker_env(3, a)
    assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == \
        ("7", "3", "8", "4")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], train) == ("h", "1234", ["cfg.toml"])
    out = subprocess.run([sys.executable, "-m", "tessel.launch.node", "--nproc-per-node", "2",
                          "--master-port", "29999", "--", CONFIG, "--train.steps=-1"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "train.steps" in out.stderr  # bad input: not requeued
    out = subprocess.run([sys.executable, "-m", "tessel.launch.node", "--nproc-per-node", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must follow '--'" in out.stderr
    # SLURM scripts written before the launcher moved call its former path: the same launcher
    out = subprocess.run([sys.executable, "-m", "tessel.parallel.node", "--nproc-per-node", "2"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "must follow '--'" in out.stderr
    assert out.stderr.startswith("usage: python -m tessel.launch.node"), out.stderr


@pytest.mark.parametrize("worker_ends", ["stopped", "finished"])
def test_the_node_launcher_requeues_only_a_run_its_signal_stopped_early(monkeypatch, capfd,
                                                                       tmp_path: Path,
                                                                       worker_ends: str):
    """A SIGTERM forwarded to the workers requeues the job (75) only when they say it stopped
    their run before its last step (the code the launcher put in their environment, which
    `tessel train` exits with: tests/integration/test_train.py); workers that finished anyway
    (the signal came during the final evaluation or save) end the job (0). The workers here
    stand in for `tessel train`: they wait for the forwarded signal, then exit one way or the
    other."""
    from tessel.launch import node

    code_at_exit = (f"int(os.environ[{node.STOPPED_EXIT_ENV!r}])" if worker_ends == "stopped"
                    else "0")
    worker = ("import os, signal, sys, time\n"
              "got = []\n"
              "signal.signal(signal.SIGTERM, lambda *_: got.append(1))\n"
              "signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})\n"
              "open(os.environ['READY'] + os.environ['LOCAL_RANK'], 'w').close()\n"
              "while not got: time.sleep(0.05)\n"
              f"sys.exit({code_at_exit})\n")
    real_popen = subprocess.Popen
    monkeypatch.setattr(node.subprocess, "Popen",
                        lambda cmd, **kw: real_popen([sys.executable, "-c", worker], **kw))
    ready = tmp_path / "ready"
    monkeypatch.setenv("READY", str(ready))

    def signal_once_ready() -> None:
        deadline = time.monotonic() + 60
        while not all(Path(f"{ready}{r}").exists() for r in range(2)):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # to the launcher, which forwards it

    threading.Thread(target=signal_once_ready, daemon=True).start()
    code = node.main(["--nproc-per-node", "2", "--master-port", "29998", "--", "cfg.toml"])
    err = capfd.readouterr().err
    if worker_ends == "stopped":
        assert code == node.EXIT_REQUEUE and "so the job requeues itself" in err
    else:
        assert code == 0 and "requeue" not in err


# ---- tessel launch k8s --------------------------------------------------------------------


def _manifest(capsys, *args: str) -> tuple[str, dict, dict]:
    """(text, ConfigMap, PyTorchJob), the job checked against the PyTorchJob CRD's own schema
    (Kubeflow Training Operator v1.9.0: tests/data/make_crd_schemas.py)."""
    import jsonschema
    import yaml

    code, text, err = run_cli(capsys, "launch", "k8s", CONFIG, "--image", "ghcr.io/o/tessel:1",
                              "--pvc", "train-data", MB2, *args)
    assert code == 0, err
    config_map, job = yaml.safe_load_all(text)
    schema = json.loads(gzip.decompress((ROOT / "tests/data/pytorchjob_v1.schema.json.gz")
                                        .read_bytes()))
    jsonschema.Draft4Validator(schema).validate(job)  # raises, naming the field, if invalid
    return text, config_map, job


def test_the_crd_schema_check_can_fail():
    import jsonschema

    schema = json.loads(gzip.decompress((ROOT / "tests/data/pytorchjob_v1.schema.json.gz")
                                        .read_bytes()))
    bad = {"apiVersion": "kubeflow.org/v1", "kind": "PyTorchJob", "metadata": {"name": "x"},
           "spec": {"nprocPerNode": 2, "pytorchReplicaSpecs": {}}}  # an int, not a string
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'string'"):
        jsonschema.Draft4Validator(schema).validate(bad)


def test_k8s_manifest_for_one_node_has_only_a_master(capsys):
    _, config_map, job = _manifest(capsys, "--nodes", "1")
    assert job["apiVersion"] == "kubeflow.org/v1" and job["kind"] == "PyTorchJob"
    assert job["metadata"] == {"name": "tessel-tiny"}
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Master"] and specs["Master"]["replicas"] == 1
    # the config travels with the job: no pod has the submitting machine's path
    assert config_map["kind"] == "ConfigMap" and config_map["metadata"] == {"name": "tessel-tiny-config"}
    assert config_map["data"] == {"config.toml": Path(CONFIG).read_text()}


def test_k8s_manifest_for_four_nodes(capsys, tmp_path: Path):
    _, config_map, job = _manifest(capsys, "--nodes", "4", "--gpus-per-node", "2", "--name",
                                   "gpt-run", "--namespace", "ml", NASTY, FILES)
    assert job["metadata"] == {"name": "gpt-run", "namespace": "ml"}
    assert config_map["metadata"] == {"name": "gpt-run-config", "namespace": "ml"}
    assert job["spec"]["nprocPerNode"] == "2"
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert {kind: spec["replicas"] for kind, spec in specs.items()} == {"Master": 1, "Worker": 3}
    for spec in specs.values():
        assert spec["restartPolicy"] == "OnFailure"
        pod = spec["template"]["spec"]
        (container,) = pod["containers"]
        assert container["name"] == "pytorch" and container["image"] == "ghcr.io/o/tessel:1"
        assert container["resources"]["limits"] == {"nvidia.com/gpu": 2}
        assert container["workingDir"] == "/workspace"  # the run directory is on the claim
        assert container["volumeMounts"] == [
            {"name": "dshm", "mountPath": "/dev/shm"},
            {"name": "config", "mountPath": "/etc/tessel", "readOnly": True},
            {"name": "work", "mountPath": "/workspace"}]
        assert pod["volumes"] == [
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
            {"name": "config", "configMap": {"name": "gpt-run-config"}},
            {"name": "work", "persistentVolumeClaim": {"claimName": "train-data"}}]
        assert container["command"] == ["bash", "-c"]
        script = k8s_expand(container["args"][0])
        assert "<expanded>" not in script  # user text cannot become a Kubernetes $(VAR)
        subprocess.run(["bash", "-n", "-c", script], check=True)
        assert '--rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT"' in script
        assert "--nnodes 4 --nproc-per-node 2" in script and "--max-restarts 3" in script
        assert train_array(script, tmp_path) == ["/etc/tessel/config.toml", MB2, NASTY, FILES,
                                                 "--auto-resume"]


def test_k8s_manifest_for_a_cpu_pool(capsys):
    _, _, job = _manifest(capsys, "--nodes", "2", "--gpus-per-node", "0", "--nproc-per-node", "2",
                          "--mount-path", "/mnt/runs")
    assert job["spec"]["nprocPerNode"] == "2"
    for spec in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = spec["template"]["spec"]["containers"]
        assert container["resources"] == {"requests": {"cpu": "2"}}  # no GPU asked for
        assert container["workingDir"] == "/mnt/runs"


def _trainjob(capsys, *args: str) -> tuple[dict, dict]:
    """(ConfigMap, TrainJob), the job checked against Kubeflow Trainer's TrainJob CRD schema
    (tests/data/make_crd_schemas.py)."""
    import jsonschema
    import yaml

    code, text, err = run_cli(capsys, "launch", "k8s", CONFIG, "--image", "ghcr.io/o/tessel:1",
                              "--pvc", "train-data", "--kind", "trainjob", MB2, *args)
    assert code == 0, err
    config_map, job = yaml.safe_load_all(text)
    schema = json.loads(gzip.decompress((ROOT / "tests/data/trainjob_v1alpha1.schema.json.gz")
                                        .read_bytes()))
    jsonschema.Draft4Validator(schema).validate(job)
    with pytest.raises(jsonschema.ValidationError, match="is not of type 'integer'"):
        bad = {**job, "spec": {**job["spec"], "trainer": {**job["spec"]["trainer"],
                                                          "numProcPerNode": "2"}}}
        jsonschema.Draft4Validator(schema).validate(bad)  # the check can fail
    return config_map, job


def test_k8s_trainjob_for_kubeflow_trainer_v2(capsys, tmp_path: Path):
    config_map, job = _trainjob(capsys, "--nodes", "4", "--gpus-per-node", "2", "--name",
                                "gpt-run", "--namespace", "ml", NASTY, FILES)
    assert (job["apiVersion"], job["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert job["metadata"] == {"name": "gpt-run", "namespace": "ml"}
    assert config_map["metadata"] == {"name": "gpt-run-config", "namespace": "ml"}
    spec = job["spec"]
    assert spec["runtimeRef"] == {"name": "torch-distributed"}
    trainer = spec["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (4, 2)
    assert trainer["resourcesPerNode"] == {"limits": {"nvidia.com/gpu": 2}}
    script = k8s_expand(trainer["args"][0])
    subprocess.run(["bash", "-n", "-c", script], check=True)
    assert script.startswith("cd /workspace\n")  # a runtime patch cannot set workingDir
    # torchrun takes the node count, rank and rendezvous from the runtime's PET_* variables
    assert 'exec torchrun --max-restarts 3 -m tessel train "${TRAIN[@]}"' in script
    assert train_array(script, tmp_path) == ["/etc/tessel/config.toml", MB2, NASTY, FILES,
                                             "--auto-resume"]
    (patch,) = spec["runtimePatches"]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    pod = node["template"]["spec"]["template"]["spec"]
    assert node["name"] == "node" and pod["containers"][0]["name"] == "node"
    assert [v["name"] for v in pod["volumes"]] == ["dshm", "config", "work"]
    assert pod["volumes"][2] == {"name": "work",
                                 "persistentVolumeClaim": {"claimName": "train-data"}}
    assert pod["containers"][0]["volumeMounts"][1] == {
        "name": "config", "mountPath": "/etc/tessel", "readOnly": True}


def test_k8s_trainjob_for_a_cpu_pool_on_another_runtime(capsys):
    _, job = _trainjob(capsys, "--nodes", "1", "--gpus-per-node", "0", "--nproc-per-node", "2",
                       "--runtime", "torch-cpu")
    assert job["spec"]["runtimeRef"] == {"name": "torch-cpu"}
    assert job["spec"]["trainer"]["resourcesPerNode"] == {"requests": {"cpu": "2"}}


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("args, needle", [
    (["slurm", CONFIG], "required: --nodes"),
    (["slurm", CONFIG, "--nodes", "0"], "--nodes needs N or MIN:MAX with 1 <= MIN <= MAX"),
    (["slurm", CONFIG, "--nodes", "two"], "--nodes needs N or MIN:MAX"),
    (["k8s", CONFIG, "--nodes", "3:2", "--image", "i", "--pvc", "p"], "--nodes needs N or MIN:MAX"),
    (["slurm", CONFIG, "--nodes", "1", "--gpus-per-node", "-1"], "--gpus-per-node must be >= 0"),
    (["slurm", CONFIG, "--nodes", "1", "--gpus-per-node", "2", "--nproc-per-node", "3"],
     "a GPU job runs one process per GPU"),
    (["slurm", CONFIG, "--nodes", "1", "--signal-grace", "0"], "--signal-grace must be >= 1"),
    (["slurm", CONFIG, "--nodes", "1", "--time", "90m"], "--time must be HH:MM:SS"),
    (["slurm", CONFIG, "--nodes", "1", "--time", "1:75:00"], "--time must be HH:MM:SS"),
    (["slurm", CONFIG, "--nodes", "1", "--job-name", "my job"], "not a valid SLURM name"),
    (["slurm", CONFIG, "--nodes", "1", "--port", "70000"], "--port must be between"),
    (["slurm", CONFIG, "--nodes", "1", "--frobnicate"], "unknown option '--frobnicate'"),
    (["slurm", CONFIG, "--nodes", "1", "--resume", "runs/x"], "unknown option '--resume'"),
    (["slurm", "--nodes", "1"], "needs a config file"),
    (["slurm", CONFIG, CONFIG, "--nodes", "1"], "more than one config file"),
    (["slurm", CONFIG, "--nodes", "1", "--train.steps=-1"], "train.steps"),
    (["slurm", CONFIG, "--nodes", "1", "--train.steps"], "--train.steps needs a value"),
    (["k8s", CONFIG, "--nodes", "2", "--pvc", "p"], "required: --image"),
    (["k8s", CONFIG, "--nodes", "2", "--image", "i"], "required: --pvc"),
    (["k8s", CONFIG, "--nodes", "2", "--image", "i", "--pvc", "p", "--name", "Tessel_Run"],
     "not a DNS-1123 label"),
    (["k8s", CONFIG, "--nodes", "2", "--image", "i", "--pvc", "p", "--namespace=ml-"],
     "not a DNS-1123 label"),
    (["k8s", CONFIG, "--nodes", "2", "--image", "i", "--pvc", "My_Claim"], "not a DNS-1123 label"),
    (["k8s", CONFIG, "--nodes", "2", "--image", "i", "--pvc", "p", "--mount-path", "rel"],
     "must be an absolute path"),
    (["k8s", CONFIG, "--nodes", "2", "--image", "i", "--pvc", "p", "--run.dir=a\nb"],
     "control character"),
    (["k8s", CONFIG, "--nodes", "2", "--image", "i", "--pvc", "p", "--kind", "job"],
     "invalid choice: 'job'"),
    (["k8s", CONFIG, "--nodes", "2", "--image", "i", "--pvc", "p", "--kind", "trainjob",
      "--runtime", "Torch_Runtime"], "not a DNS-1123 label"),
    (["pbs", CONFIG], "invalid choice: 'pbs'"),
])
def test_bad_launch_input_is_one_line_and_exit_2(capsys, args: list[str], needle: str):
    code, out, err = run_cli(capsys, "launch", *args)
    assert_one_line_error(code, err, needle)
    assert out == ""


def test_builders_check_their_own_arguments():
    from tessel.launch.k8s import k8s_manifest

    with pytest.raises(TesselError, match="--nodes must be >= 1"):
        k8s_manifest("c.toml", "", [], nodes=0, image="i", pvc="p")
    assert job_text.default_name("configs/GPT2_124M.toml") == "tessel-gpt2-124m"


@pytest.mark.parametrize("args, needle", [
    (["--nproc", "3", "--parallel.tp=3"], "not divisible by tp=3"),
    (["--nproc", "3", "--parallel.tp=2"], "does not divide the 3 processes"),
    (["--nproc", "4", "--parallel.tp=2", "--parallel.dp_shard=1"],
     "tp*pp*dp*cp = 2 but 4 processes were started"),
    (["--nproc", "8"], "not divisible by micro_batch_size*dp = 8*8"),
    (["--nproc", "2", "--parallel.cp=2", "--train.seq_len=30"],
     "context parallelism cuts train.seq_len=30 into 2*cp = 4 equal chunks"),
])
def test_nproc_checks_the_layout_in_the_parent(capsys, monkeypatch, args, needle):
    monkeypatch.setattr(local, "run_local", lambda *a: pytest.fail("must not launch"))
    code, _, err = run_cli(capsys, "train", CONFIG, *args)
    assert_one_line_error(code, err, needle)


def test_launch_checks_the_layout_against_nodes_times_gpus(capsys):
    code, out, err = run_cli(capsys, "launch", "slurm", CONFIG, "--nodes", "2", "--gpus-per-node", "4",
                             "--parallel.tp=3")
    assert_one_line_error(code, err, "does not divide the 8 processes")
    assert out == ""


@pytest.mark.parametrize("args, needle", [
    (["--nproc", "2", "--parallel.cp=2", "--train.seq_len=30"],
     "context parallelism cuts train.seq_len=30 into 2*cp = 4 equal chunks"),
    # tiny: 4 heads (and 4 KV heads), which Ulysses cannot split over 3 ranks
    (["--nproc", "3", "--parallel.cp=3", "--parallel.cp_mode=ulysses", "--train.seq_len=120",
      "--train.global_batch_size=8"],
     "parallel.cp_mode='ulysses' splits the 4 attention heads (model.n_heads) over cp=3"),
    # 12 cuts into 4 chunks and divides by tp = 4, but a cp rank's 6 positions do not
    (["--nproc", "8", "--parallel.cp=2", "--parallel.tp=4", "--train.seq_len=12"],
     "sequence parallelism splits each context-parallel rank's 6 positions"),
])
def test_context_parallel_rules_are_one_line_and_nothing_is_written(capsys, monkeypatch, tmp_path,
                                                                    args, needle):
    monkeypatch.setattr(local, "run_local", lambda *a: pytest.fail("must not launch"))
    run = tmp_path / "run"
    code, out, err = run_cli(capsys, "train", CONFIG, *args, f"--run.dir={run}")
    assert_one_line_error(code, err, needle)
    assert not run.exists() and out == ""
