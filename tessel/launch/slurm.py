"""The sbatch script `tessel launch slurm` prints (Kubernetes: k8s.py; what both share:
job_text.py).

Every launcher ends in the same worker command, `python -m tessel train ARGS`, so a run
behaves the same however it was started. The builder here is pure (text in, text out) so
that tests can check it without a cluster.
"""

from __future__ import annotations

import re
import shlex
import sys

from tessel.errors import TesselError
from tessel.launch.job_text import MAX_RESTARTS, check_count, check_text, default_name, train_args
from tessel.launch.node import EXIT_REQUEUE
from tessel.launch.rendezvous import ELASTIC_ENV

_SLURM_NAME = re.compile(r"[A-Za-z0-9._-]+")
_SLURM_LIST = re.compile(r"[A-Za-z0-9._,-]+")  # partitions may be a comma-separated list
_SLURM_TIME = re.compile(r"([0-9]+-)?[0-9]+:[0-5][0-9]:[0-5][0-9]")
_SBATCH_SEPARATORS = ("packjob", "hetjob")  # split a job wherever an #SBATCH line has them
# What an #SBATCH argument may hold unquoted (anything else is quoted for sbatch).
_SBATCH_PLAIN = re.compile(r"[A-Za-z0-9._/%+,:=@-]+")


def check_sbatch_text(what: str, text: str) -> None:
    """Refuse what no `#SBATCH` line carries: control characters and line breaks, and the
    words "hetjob" and "packjob", which make sbatch split the job there (the burst-buffer
    plugins look for them anywhere in the line; older sbatch blanks "packjob" out)."""
    check_text(what, text)
    if any(word in text.lower() for word in _SBATCH_SEPARATORS):
        raise TesselError(f"{what} {text!r} contains 'hetjob' or 'packjob', which sbatch takes "
                          "for a heterogeneous-job separator in an #SBATCH line; choose another")


def sbatch_quote(text: str) -> str:
    """TEXT (checked by `check_sbatch_text`) as one argument of an `#SBATCH` line. sbatch
    splits these lines itself, not through a shell (Slurm's get_argument): whitespace
    separates arguments, single or double quotes group, a backslash takes the next character
    as it is, an unquoted '#' starts a comment. Text outside a plain set is double-quoted
    with '\\' and '"' escaped; nothing else in it is special to sbatch."""
    if _SBATCH_PLAIN.fullmatch(text):
        return text
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def _processes(nodes: int, min_nodes: int | None, gpus_per_node: int,
               nproc_per_node: int | None, cpus_per_task: int | None
               ) -> tuple[int, bool, int, int | None]:
    """The job's shape, checked: (fewest nodes, CPU job?, processes per node, cores per
    task). A CPU job (`gpus_per_node` 0) defaults to one process, on one core each."""
    check_count("--nodes", nodes)
    low = nodes if min_nodes is None else min_nodes
    check_count("--nodes", low)
    if gpus_per_node < 0:
        raise TesselError(f"--gpus-per-node must be >= 0 (0: a CPU job), got {gpus_per_node}")
    cpu = gpus_per_node == 0
    if nproc_per_node is None:
        nproc_per_node = 1 if cpu else gpus_per_node
    check_count("--nproc-per-node", nproc_per_node)
    if not cpu and nproc_per_node != gpus_per_node:
        raise TesselError(f"--nproc-per-node {nproc_per_node} differs from --gpus-per-node "
                          f"{gpus_per_node}; a GPU job runs one process per GPU")
    if cpus_per_task is not None:
        check_count("--cpus-per-task", cpus_per_task)
    elif cpu:
        cpus_per_task = nproc_per_node  # under CPU binding a task gets one core otherwise
    return low, cpu, nproc_per_node, cpus_per_task


def _check_directives(port: int | None, grace_s: int, time: str | None, job_name: str,
                      partition: str | None, account: str | None) -> None:
    """Refuse a port, grace, time limit or name that its `#SBATCH` line cannot carry."""
    if port is not None and not 1 <= port <= 65535:
        raise TesselError(f"--port must be between 1 and 65535 (got {port})")
    if grace_s < 1:
        raise TesselError(f"--signal-grace must be >= 1 second (got {grace_s})")
    if time is not None and not _SLURM_TIME.fullmatch(time):
        raise TesselError(f"--time must be HH:MM:SS or D-HH:MM:SS (got {time!r}), e.g. --time 48:00:00")
    for flag, value, pattern in (("--job-name", job_name, _SLURM_NAME),
                                 ("--partition", partition, _SLURM_LIST),
                                 ("--account", account, _SLURM_NAME)):
        if value is not None and not pattern.fullmatch(value):
            raise TesselError(f"{flag} {value!r} is not a valid SLURM name; use letters, digits, "
                              "'.', '_' and '-'")
        if value is not None:
            check_sbatch_text(flag, value)


def _interpreter(python: str | None) -> str:
    """The Python that runs tessel on the nodes: `python`, checked, or this interpreter."""
    python = python if python is not None else sys.executable
    if not python:
        raise TesselError("--python needs the path of the Python that runs tessel on the nodes, "
                          "e.g. --python /opt/venv/bin/python")
    check_text("--python", python)
    return python


def _log_pattern(output_dir: str) -> str:
    """The `#SBATCH --output` argument: the job's log in `output_dir`, named by job name
    and id."""
    check_sbatch_text("--output-dir", output_dir)
    if "\\" in output_dir:
        raise TesselError(f"--output-dir {output_dir!r} contains a backslash, which turns off the "
                          "%x/%j names in SLURM's log file pattern; choose a directory without one")
    # SLURM expands %x, %j, ... in the log's name: a '%' of the directory's is written '%%'.
    return sbatch_quote(output_dir.replace("%", "%%") + "/%x-%j.out")


def _directives(config_path: str, what: str, *, output_dir: str, job_name: str, low: int,
                nodes: int, optional: list[str], grace_s: int, log: str) -> list[str]:
    """The script's opening comment and its `#SBATCH` lines."""
    # One task per node: it starts that node's training processes. Not asked for by an
    # elastic job: from --ntasks-per-node sbatch fixes the job's task count at MIN x 1, and
    # SLURM then never gives it more than MIN nodes, not even at a requeue with every node
    # free (measured on slurm-wlm 22.05); one task per node is SLURM's default, and srun asks
    # for it itself.
    tasks = (["# One task per node, SLURM's default (no task count: one would keep the job at "
              f"{low} node(s))."]
             if low < nodes else
             ["# One task per node: it starts that node's training processes.",
              "#SBATCH --ntasks-per-node=1"])
    return [
        "#!/bin/bash",
        f"# tessel training job for {config_path} ({what}), written by `tessel launch slurm`.",
        "# Submit it, unedited, from the directory the paths below are relative to (the job",
        f"# starts there; {output_dir}/ was created for its log):",
        "#   sbatch THIS_FILE",
        "# It requeues itself when preempted or at its time limit (after saving a checkpoint)",
        "# and continues the run; it ends COMPLETED when the run is done, FAILED otherwise with",
        "# tessel's exit code (docs/exit-codes.md).",
        f"#SBATCH --job-name={job_name}",
        f"#SBATCH --nodes={nodes if low == nodes else f'{low}-{nodes}'}",
        *tasks,
        *optional,
        "#SBATCH --requeue",
        f"# SIGTERM to this script {grace_s} s before the time limit; it passes it on, tessel saves",
        "# a checkpoint at the next step and the job requeues itself. The grace must cover one",
        "# step plus one checkpoint save (docs/parallelism.md#slurm).",
        f"#SBATCH --signal=B:TERM@{grace_s}",
        "#SBATCH --open-mode=append",
        f"#SBATCH --output={log}",
        "",
    ]


def _step(nodes: int) -> tuple[list[str], str, list[str], list[str]]:
    """How the training step starts and is stopped: (its start line, the command that
    passes a stop signal on, the relay step's lines, what to do when a stop killed it)."""
    if nodes == 1:
        # Preemption signals a job's steps, not this script, and the launcher is not a step
        # here (so that `scancel --full` cannot make srun kill it): a small step of ours,
        # sharing the job's CPUs, passes such a signal on to the launcher.
        relay = [
            "srun --overlap --ntasks=1 --kill-on-bad-exit=0 bash -c "
            "'trap \"kill -TERM $0 2>/dev/null; exit 0\" TERM USR1; "
            "while :; do sleep 5 & wait $!; done' \"$STEP\" &",
            "RELAY=$!",
        ]
        return ['"${NODE[@]}" &'], 'kill -TERM "$STEP" 2>/dev/null', relay, []
    start = ['srun --kill-on-bad-exit=1 --ntasks-per-node=1 "${NODE[@]}" &']
    # to the steps' tasks only: srun itself, signalled, kills the step at once
    forward = 'scancel --signal=TERM "$SLURM_JOB_ID"'
    # ... which a stop signal sent to every process (`scancel --full`) does: srun turns its
    # own SIGTERM into a SIGKILL of the tasks before they can save. The job was asked to
    # stop, not crashed: requeued as stopped (not counted against the crash retries), it
    # resumes from its latest checkpoint (checkpoint.interval bounds what is lost). So
    # does a stop that comes while the processes are still preparing (they exit 143).
    killed = [
        '    if [ -n "$STOP" ]; then  # stopped, without a save of this start',
        '      echo "tessel: a stop signal ended the step without saving (exit $CODE: srun, '
        'signalled too, killed it, or training had not begun); requeueing job '
        '$SLURM_JOB_ID: it resumes from its latest checkpoint"',
        '      scontrol requeue "$SLURM_JOB_ID"; exit 0',
        "    fi",
    ]
    return start, forward, [], killed


def _run_and_requeue(nodes: int) -> list[str]:
    """The lines that start the step, pass a stop signal on, wait for it, and requeue the
    job or end it by the step's exit code."""
    start, forward, relay, killed = _step(nodes)
    return [
        "# The time-limit warning, or `scancel --signal=TERM --full`, reaches this shell: pass",
        "# it on (remembered if it comes before the step has started).",
        'STOP=""; STEP=""',
        f"trap 'STOP=1; [ -n \"$STEP\" ] && {forward}' TERM USR1",
        *start,
        "STEP=$!",
        f'[ -n "$STOP" ] && {forward}',
        *relay,
        'while kill -0 "$STEP" 2>/dev/null; do wait "$STEP"; done',
        'wait "$STEP"; CODE=$?',
        *(['kill "$RELAY" 2>/dev/null'] if relay else []),
        'case "$CODE" in',
        "  0) exit 0 ;;  # the run is done",
        f"  {EXIT_REQUEUE})  # stopped by preemption or the time limit, checkpoint saved",
        '    echo "tessel: requeueing job $SLURM_JOB_ID; it resumes from its checkpoint"',
        '    scontrol requeue "$SLURM_JOB_ID"; exit 0 ;;',
        '  2|4|5|6|7) exit "$CODE" ;;  # bad input, halted (docs/exit-codes.md): a person decides',
        "  *)  # a crash or a hang: try again from the last checkpoint, a few times",
        *killed,
        f'    if [ "${{SLURM_RESTART_COUNT:-0}}" -lt {MAX_RESTARTS} ]; then',
        '      echo "tessel: the run failed (exit $CODE); requeueing job $SLURM_JOB_ID"',
        '      scontrol requeue "$SLURM_JOB_ID"',
        "    fi",
        '    exit "$CODE" ;;',
        "esac",
    ]


def slurm_script(
    config_path: str,
    overrides: list[str],
    *,
    nodes: int,
    min_nodes: int | None = None,
    gpus_per_node: int = 8,
    nproc_per_node: int | None = None,
    cpus_per_task: int | None = None,
    partition: str | None = None,
    time: str | None = None,
    job_name: str | None = None,
    account: str | None = None,
    port: int | None = None,
    python: str | None = None,
    grace_s: int = 120,
    output_dir: str = "logs",
) -> str:
    """An sbatch script that trains CONFIG (with OVERRIDES) on `nodes` nodes and survives
    preemption and time limits on its own (docs/parallelism.md#slurm).

    `gpus_per_node` 0 is a CPU job: `nproc_per_node` processes (default 1) on
    `cpus_per_task` cores (default one per process), no GPU resources asked for. Every node
    runs `python -m tessel.launch.node` (not torchrun: see that module), through srun when
    there are several nodes and directly with one (so `scancel --full` cannot make srun kill
    the step before it saves). `python` (default: this interpreter) runs it, overridable at
    submission with TESSEL_PYTHON. The rendezvous port comes from the job id unless `port`
    is given, so jobs sharing a node never share a rendezvous. `min_nodes` < `nodes` makes
    the job elastic: SLURM allocates between the two at every start, a requeue included, and
    the run continues at the world size it gets (docs/parallelism.md#elastic-world-size)."""
    low, cpu, nproc_per_node, cpus_per_task = _processes(nodes, min_nodes, gpus_per_node,
                                                         nproc_per_node, cpus_per_task)
    job_name = job_name if job_name is not None else default_name(config_path)
    _check_directives(port, grace_s, time, job_name, partition, account)
    python = _interpreter(python)
    log = _log_pattern(output_dir)

    span = f"{low}-{nodes}" if low < nodes else str(nodes)
    what = f"{span} x {nproc_per_node} CPU processes" if cpu else f"{span} x {gpus_per_node} GPUs"
    optional = [f"#SBATCH --{key}={value}" for key, value in
                (("partition", partition), ("account", account), ("time", time),
                 ("gpus-per-node", None if cpu else gpus_per_node),
                 ("cpus-per-task", cpus_per_task)) if value]
    node = (f'NODE=("$PYTHON" -m tessel.launch.node --nproc-per-node {nproc_per_node} '
            '--master-addr "$HEAD" --master-port "$PORT" -- "${TRAIN[@]}")')
    elastic = ([f"# Elastic: {low} to {nodes} nodes at each start; the workers re-plan the batch "
                "split for the",
                "# world they find (the global batch is kept).",
                f"export {ELASTIC_ENV}={low}:{nodes}"] if low < nodes else [])
    lines = [
        *_directives(config_path, what, output_dir=output_dir, job_name=job_name, low=low,
                     nodes=nodes, optional=optional, grace_s=grace_s, log=log),
        "set -uo pipefail",
        "# The interpreter tessel was installed in when this script was written; TESSEL_PYTHON,",
        "# set at submission, overrides it.",
        f"PYTHON={shlex.quote(python)}",
        'PYTHON="${TESSEL_PYTHON:-$PYTHON}"',
        'HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n1)',
        *(["# A rendezvous port of this job's own: jobs sharing a node never share one.",
           "PORT=$((20000 + SLURM_JOB_ID % 40000))"] if port is None else [f"PORT={port}"]),
        *train_args(config_path, overrides),
        *elastic,
        node,
        "",
        *_run_and_requeue(nodes),
    ]
    return "\n".join(lines) + "\n"
