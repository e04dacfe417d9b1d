"""`tessel launch slurm|k8s` from hostile values, for every option of both commands and every
value tessel derives (the config path and text, the default interpreter, the overrides it
passes on): shell syntax that would run `touch F`, quotes, `;`, spaces, `$VAR`s, globs,
sbatch's `#` and `%`, non-ASCII text. Each job file is executed as its scheduler would run it
(bash for the sbatch script; `bash -c` on a container's args after Kubernetes' own `$(VAR)`
expansion), with stub srun/scontrol/python/torchrun on PATH that record their argv: every
value arrives byte for byte, and nothing else runs (no file F appears). What a job file
cannot carry is refused in one line, exit 2, with nothing printed or created.
(The real sbatch reading such a script: tests/integration/test_slurm.py.)"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tessel.cli import main

ROOT = Path(__file__).resolve().parents[2]
MB2 = "--train.micro_batch_size=2"  # configs/tiny.toml's batch on up to 8 processes
# Runs `touch F` wherever a shell evaluates it; quotes, separators, variables, globs, brace
# and tilde expansion, an sbatch comment, SLURM's %-patterns, a backslash, non-ASCII.
NASTY = "q'\"$(touch F) `touch F`; touch F && $HOME ${IFS} * ?[x] \\ # %j %% ~ ! {a,b} é😀"
# The same without whitespace or a backslash (image references, mount paths, log directories
# take none of them).
WORD = "w'\"$(touch${IFS}F)`touch${IFS}F`;touch${IFS}F&&$HOME*?[x]#%j%%~!{a,b}é😀"
# Overrides of string fields (as `--key=value` and as `--key value`) and one of a number.
OVERRIDES = [f"--run.sample_prompt={NASTY}", f"--run.dir=runs/{NASTY}", "--data.cache_dir", NASTY,
             MB2]
PASSED = [f"--run.sample_prompt={NASTY}", f"--run.dir=runs/{NASTY}", f"--data.cache_dir={NASTY}",
          MB2, "--auto-resume"]  # what `tessel train` gets after the config path
STUB = f"""#!{sys.executable} -I
# Records its argv (as bytes) and working directory; srun runs its command like SLURM would.
import json, os, sys, tempfile
fd, _ = tempfile.mkstemp(dir=os.environ["RECORD_DIR"], suffix=".json")
with os.fdopen(fd, "w") as f:
    json.dump({{"argv": [os.fsencode(a).hex() for a in sys.argv], "cwd": os.getcwd()}}, f)
name = os.path.basename(sys.argv[0])
if "tessel.launch.node" in sys.argv:
    # A one-node job starts its relay step (srun --overlap) in the background and kills it when
    # the launcher ends: the launcher waits until srun has recorded its call, or a stub this
    # fast could end first and the relay be killed before it records anything.
    import glob, time
    def srun_recorded():
        for path in glob.glob(os.path.join(os.environ["RECORD_DIR"], "*.json")):
            try:
                argv0 = bytes.fromhex(json.load(open(path))["argv"][0]).decode()
            except ValueError:  # still being written
                continue
            if os.path.basename(argv0) == "srun":
                return True
        return False
    deadline = time.monotonic() + 20
    while not srun_recorded() and time.monotonic() < deadline:
        time.sleep(0.05)
if name == "scontrol" and sys.argv[1:3] == ["show", "hostnames"]:
    print("node1")
if name == "srun" and "--overlap" not in sys.argv:
    command = sys.argv[1:]
    while command[0].startswith("--"):
        command.pop(0)
    os.execv(command[0], command)
"""


def stub(path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(STUB)
    path.chmod(0o755)
    return path


@pytest.fixture
def place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A working directory (the job's), a stub bin/ and a config in a hostile directory."""
    work = tmp_path / "work"
    for name in ("srun", "scontrol", "scancel", "torchrun"):
        stub(tmp_path / "bin" / name)
    (tmp_path / "calls").mkdir()
    (tmp_path / NASTY).mkdir()
    # the config's own text too: it travels in the k8s ConfigMap
    (tmp_path / NASTY / "cfg.toml").write_text(
        (ROOT / "configs/tiny.toml").read_text() + f"# {NASTY} \u2028 \x85 \\u0041 \"\n")
    work.mkdir()
    monkeypatch.chdir(work)
    return tmp_path


def run(place: Path, argv: list[str], cwd: Path, **env: str) -> list[dict]:
    """Run `argv` as its scheduler would (a minimal environment, the stubs first on PATH);
    the stubs' calls, in no particular order: {"argv": [bytes], "cwd": str}."""
    shutil.rmtree(place / "calls")
    (place / "calls").mkdir()
    env = {"PATH": f"{place / 'bin'}:/usr/bin:/bin", "HOME": "/home/user", "LANG": "C.UTF-8",
           "RECORD_DIR": str(place / "calls"), **env}
    out = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, timeout=60)
    assert out.returncode == 0, out.stderr.decode()
    assert not [p for p in place.rglob("F")], "the job ran a command hidden in a value"
    calls = [json.loads(p.read_text()) for p in (place / "calls").iterdir()]
    return [{"argv": [bytes.fromhex(a) for a in c["argv"]], "cwd": c["cwd"]} for c in calls]


def called(calls: list[dict], name: str) -> list[list[str]]:
    """The argv of each call of the stub `name` (checked to be valid UTF-8 on the way)."""
    return [[a.decode() for a in c["argv"]] for c in calls
            if Path(c["argv"][0].decode()).name == name]


def launch(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    code = main(["launch", *argv])
    out, err = capsys.readouterr()
    assert code == 0, err
    return out


def sbatch_arguments(script: str) -> list[str]:
    """The arguments sbatch reads from a script's #SBATCH lines, by the rules of Slurm's
    get_argument (src/common/proc_args.c): blanks separate, quotes group, a backslash takes
    the next character, an unquoted '#' ends the line; the first command line ends the
    directives."""
    found = []
    for line in script.splitlines()[1:]:
        if not line.startswith("#SBATCH"):
            if line.strip() and not line.lstrip().startswith("#"):
                break
            continue
        arg: str | None = None
        quote, escaped = "", False
        for c in line[len("#SBATCH"):]:
            if escaped:
                escaped = False
            elif c == "\\":
                escaped = True
                continue
            elif quote:
                if c == quote:
                    quote = ""
                    continue
            elif c in "'\"":
                quote, arg = c, arg or ""
                continue
            elif c == "#":
                break
            elif c in " \t":
                if arg is not None:
                    found.append(arg)
                arg = None
                continue
            arg = (arg or "") + c
        assert not quote, f"sbatch refuses an unmatched quote: {line!r}"
        if arg is not None:
            found.append(arg)
    return found


def k8s_expand(text: str) -> str:
    """What Kubernetes does to a container's command and args before running them: `$$` is
    `$`, `$(NAME)` the variable's value (here every name is taken for defined)."""
    return re.sub(r"\$(\$|\([^)]*\))", lambda m: "$" if m[1] == "$" else "<EXPANDED>", text)


# ---- Slurm -------------------------------------------------------------------------------


def test_slurm_one_node_carries_every_value_intact(capsys, place: Path):
    config = str(place / NASTY / "cfg.toml")
    python = stub(place / f"venv {NASTY}" / f"py{WORD}")
    other = stub(place / f"other {NASTY}" / "python")
    log_dir = f"logs/{NASTY.replace(chr(92), '')}"  # a backslash is refused (below)
    script = launch(capsys, "slurm", config, *OVERRIDES, "--nodes", "1", "--gpus-per-node", "0",
                    "--nproc-per-node", "2", "--cpus-per-task", "3", "--partition", "cpu,debug",
                    "--time", "1-00:00:00", "--signal-grace", "90", "--job-name", "j.o_b-1",
                    "--account", "acct", "--port", "29999", "--python", str(python),
                    "--output-dir", log_dir)
    (place / "job.sh").write_text(script)
    assert sbatch_arguments(script) == [
        "--job-name=j.o_b-1", "--nodes=1", "--ntasks-per-node=1", "--partition=cpu,debug",
        "--account=acct", "--time=1-00:00:00", "--cpus-per-task=3", "--requeue",
        "--signal=B:TERM@90", "--open-mode=append",
        f"--output={log_dir.replace('%', '%%')}/%x-%j.out"]  # SLURM reads %% as %
    assert Path(log_dir).is_dir()  # made now, under its exact name
    node = ["-m", "tessel.launch.node", "--nproc-per-node", "2", "--master-addr", "node1",
            "--master-port", "29999", "--", config, *PASSED]
    calls = run(place, ["bash", str(place / "job.sh")], cwd=Path.cwd(), SLURM_JOB_ID="7",
                SLURM_JOB_NODELIST="node1")
    assert called(calls, python.name) == [[str(python), *node]]
    # the relay step, and nothing else through srun; no requeue, no scancel
    assert [a[1] for a in called(calls, "srun")] == ["--overlap"]
    assert [a[1:] for a in called(calls, "scontrol")] == [["show", "hostnames", "node1"]]
    assert len(calls) == 3
    # TESSEL_PYTHON, set at submission, is taken as it is too
    calls = run(place, ["bash", str(place / "job.sh")], cwd=Path.cwd(), SLURM_JOB_ID="7",
                SLURM_JOB_NODELIST="node1", TESSEL_PYTHON=str(other))
    assert called(calls, "python") == [[str(other), *node]] and not called(calls, python.name)


def test_slurm_nodes_run_the_default_interpreter_through_srun_intact(capsys, place: Path,
                                                                     monkeypatch):
    python = stub(place / f"venv {NASTY}" / "bin" / "python3")
    monkeypatch.setattr(sys, "executable", str(python))  # `tessel` run from a hostile venv
    script = launch(capsys, "slurm", str(place / NASTY / "cfg.toml"), *OVERRIDES, "--nodes", "2",
                    "--gpus-per-node", "2")
    assert "--job-name=tessel-cfg" in sbatch_arguments(script)
    calls = run(place, ["bash", "-c", script], cwd=Path.cwd(), SLURM_JOB_ID="123",
                SLURM_JOB_NODELIST="node[1-2]")
    node = [str(python), "-m", "tessel.launch.node", "--nproc-per-node", "2", "--master-addr",
            "node1", "--master-port", str(20000 + 123), "--", str(place / NASTY / "cfg.toml"),
            *PASSED]
    assert called(calls, "srun") == [[str(place / "bin/srun"), "--kill-on-bad-exit=1",
                                      "--ntasks-per-node=1", *node]]
    assert called(calls, "python3") == [node]


# ---- Kubernetes ----------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_k8s_carries_every_value_intact(capsys, place: Path, kind: str):
    config = place / NASTY / "cfg.toml"
    mount = place / f"claim{WORD}"
    mount.mkdir()
    # DNS labels that YAML would read as a boolean, null or a number unquoted
    text = launch(capsys, "k8s", str(config), *OVERRIDES, "--nodes", "2", "--gpus-per-node", "0",
                  "--nproc-per-node", "4", "--image", f"registry.example/{WORD}:1", "--pvc", "123",
                  "--mount-path", str(mount), "--name", "yes", "--namespace", "null",
                  "--kind", kind, "--runtime", "on")
    config_map, job = yaml.safe_load_all(text)
    assert config_map["data"] == {"config.toml": config.read_text()}
    assert config_map["metadata"] == {"name": "yes-config", "namespace": "null"}
    assert job["metadata"] == {"name": "yes", "namespace": "null"}
    if kind == "trainjob":
        trainer = job["spec"]["trainer"]
        assert job["spec"]["runtimeRef"] == {"name": "on"}
        (patch,) = job["spec"]["runtimePatches"]
        (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
        pods = [(node["template"]["spec"]["template"]["spec"], trainer)]
        expected = ["torchrun", "--max-restarts", "3"]
        cwd = place  # the script changes into the claim itself
    else:
        pods = [(spec["template"]["spec"], spec["template"]["spec"]["containers"][0])
                for spec in job["spec"]["pytorchReplicaSpecs"].values()]
        expected = ["torchrun", "--nnodes", "2", "--nproc-per-node", "4", "--rdzv-id", "yes",
                    "--rdzv-backend", "c10d", "--rdzv-endpoint", "10.0.0.1:29500",
                    "--max-restarts", "3"]
        cwd = mount  # the container's workingDir
    expected += ["-m", "tessel", "train", "/etc/tessel/config.toml", *PASSED]
    for pod, container in pods:
        assert container["image"] == f"registry.example/{WORD}:1"
        assert container.get("workingDir", str(mount)) == str(mount)
        assert pod["volumes"][2]["persistentVolumeClaim"] == {"claimName": "123"}
        assert pod["volumes"][1]["configMap"] == {"name": "yes-config"}
        mounts = pod["containers"][0]["volumeMounts"]
        assert mounts[2] == {"name": "work", "mountPath": str(mount)}
        assert container["command"] == ["bash", "-c"]
        (script,) = container["args"]
        script = k8s_expand(script)
        assert "<EXPANDED>" not in script  # no user text becomes a Kubernetes $(VAR)
        calls = run(place, ["bash", "-c", script], cwd=cwd, MASTER_ADDR="10.0.0.1",
                    MASTER_PORT="29500")
        assert called(calls, "torchrun") == [[str(place / "bin/torchrun"), *expected[1:]]]
        assert [c["cwd"] for c in calls] == [str(mount)]


# ---- what cannot be carried ------------------------------------------------------------------

K8S = ["--image", "i", "--pvc", "p"]


@pytest.mark.parametrize("args, needle", [
    *[(["slurm", "--nodes", "1", flag, NASTY], "invalid int value")
      for flag in ("--gpus-per-node", "--nproc-per-node", "--cpus-per-task", "--port",
                   "--signal-grace")],
    (["slurm", "--nodes", NASTY], "--nodes needs N or MIN:MAX"),
    *[(["slurm", "--nodes", "1", flag, NASTY], "not a valid SLURM name")
      for flag in ("--job-name", "--partition", "--account")],
    (["slurm", "--nodes", "1", "--time", NASTY], "--time must be HH:MM:SS"),
    (["slurm", "--nodes", "1", "--time", "١٢:00:00"], "--time must be HH:MM:SS"),  # not ASCII digits
    (["slurm", "--nodes", "1", "--job-name", "my-hetjob"], "heterogeneous-job separator"),
    (["slurm", "--nodes", "1", "--partition", "gpu,PackJob"], "heterogeneous-job separator"),
    (["slurm", "--nodes", "1", "--output-dir", "logs/hetjob"], "heterogeneous-job separator"),
    (["slurm", "--nodes", "1", "--output-dir", "logs\\x"], "contains a backslash"),
    (["slurm", "--nodes", "1", "--output-dir", "lo\ngs"], "control character"),
    (["slurm", "--nodes", "1", "--python", "/x/py\n#SBATCH --uid=0"], "control character"),
    (["slurm", "--nodes", "1", "--python", ""], "--python needs the path"),
    (["slurm", "--nodes", "1", "--run.sample_prompt=a\nb"], "control character"),
    (["slurm", "--nodes", "1", "--run.sample_prompt=a\u2028b"], "control character"),
    (["slurm", "--nodes", "1", "--run.sample_prompt=a\x85b"], "control character"),
    *[(["k8s", "--nodes", "1", *K8S, "--kind", "trainjob", flag, NASTY], "not a DNS-1123 label")
      for flag in ("--pvc", "--name", "--namespace", "--runtime")],
    *[(["k8s", *K8S, "--nodes", "1", flag, NASTY], "invalid int value")
      for flag in ("--gpus-per-node", "--nproc-per-node")],
    (["k8s", *K8S, "--nodes", NASTY], "--nodes needs N or MIN:MAX"),
    (["k8s", "--nodes", "1", *K8S, "--kind", NASTY], "invalid choice"),
    (["k8s", "--nodes", "1", "--pvc", "p", "--image", NASTY], "is not an image reference"),
    (["k8s", "--nodes", "1", "--pvc", "p", "--image", "i\x85"], "is not an image reference"),
    (["k8s", "--nodes", "1", "--pvc", "p", "--image", "i\x00"], "control character"),
    (["k8s", "--nodes", "1", *K8S, "--mount-path", f"/m {NASTY}"], "absolute path without spaces"),
    (["k8s", "--nodes", "1", *K8S, "--mount-path", "/m\x00"], "control character"),
    (["k8s", "--nodes", "1", *K8S, "--run.sample_prompt=a\u2029b"], "control character"),
])
def test_what_a_job_file_cannot_carry_is_refused_in_one_line(capsys, place: Path, args, needle):
    target, *rest = args
    code = main(["launch", target, str(place / NASTY / "cfg.toml"), MB2, *rest])
    out, err = capsys.readouterr()
    assert code == 2 and out == "", err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("tessel: error: ") and needle in lines[0], err
    assert list(Path.cwd().iterdir()) == []  # no log directory made


@pytest.mark.parametrize("target", ["slurm", "k8s"])
@pytest.mark.parametrize("name", ["c\nfg.toml", "c\u2028fg.toml"])
def test_a_config_path_with_a_line_break_is_refused(capsys, place: Path, target: str, name: str):
    shutil.copy(place / NASTY / "cfg.toml", place / name)
    k8s = K8S if target == "k8s" else []
    code = main(["launch", target, str(place / name), "--nodes", "1", MB2, *k8s])
    out, err = capsys.readouterr()
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, err
    assert "control character or line break" in err


def _options(target: str, capsys: pytest.CaptureFixture[str]) -> set[str]:
    with pytest.raises(SystemExit):
        main(["launch", target, "--help"])
    flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)(?![\w.-])", capsys.readouterr().out)
    return set(flags) - {"--help"}


def test_every_option_has_a_hostile_value_above(capsys):
    """A new option of `tessel launch` needs a case here (carried intact, or refused)."""
    source = Path(__file__).read_text()
    for target in ("slurm", "k8s"):
        missing = sorted(o for o in _options(target, capsys) if f'"{o}"' not in source)
        assert missing == [], f"launch {target}: {missing}"
