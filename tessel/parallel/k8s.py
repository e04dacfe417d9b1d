"""The Kubernetes job `tessel launch k8s` prints: a ConfigMap holding the config file and a
Kubeflow PyTorchJob (kubeflow.org/v1, checked against the Training Operator's own CRD schema
in tests/unit/test_launch.py) that trains it.

Every pod mounts the config (a ConfigMap: the submitting machine's path exists in no pod) and
a PersistentVolumeClaim as its working directory, where the run directory (and relative data
paths) live, so a restarted pod continues the run (`--auto-resume`).
"""

from __future__ import annotations

import json
import re
import shlex

from tessel.errors import TesselError
from tessel.parallel.launch import MAX_RESTARTS, check_count, check_text, default_name, train_args

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
CONFIG_DIR = "/etc/tessel"  # where the ConfigMap is mounted
CONFIG_KEY = "config.toml"


def _yaml_str(text: str) -> str:
    return json.dumps(text)  # a JSON string is a valid YAML double-quoted scalar


def k8s_manifest(
    config_path: str,
    config_text: str,
    overrides: list[str],
    *,
    nodes: int,
    image: str,
    pvc: str,
    gpus_per_node: int = 8,
    nproc_per_node: int | None = None,
    mount_path: str = "/workspace",
    name: str | None = None,
    namespace: str | None = None,
) -> str:
    """A ConfigMap with `config_text` and a PyTorchJob that trains it on `nodes` pods (one
    Master and nodes - 1 Workers; a one-node job has no Worker spec, as the operator
    accepts), each with `gpus_per_node` GPUs, or, with 0, `nproc_per_node` CPU processes."""
    check_count("--nodes", nodes)
    if gpus_per_node < 0:
        raise TesselError(f"--gpus-per-node must be >= 0 (0: a CPU pool), got {gpus_per_node}")
    cpu = gpus_per_node == 0
    nproc = nproc_per_node if nproc_per_node is not None else (1 if cpu else gpus_per_node)
    check_count("--nproc-per-node", nproc)
    if not cpu and nproc != gpus_per_node:
        raise TesselError(f"--nproc-per-node {nproc} differs from --gpus-per-node "
                          f"{gpus_per_node}; a GPU pod runs one process per GPU")
    name = name if name is not None else default_name(config_path)
    for flag, value in (("--name", name), ("--namespace", namespace), ("--pvc", pvc)):
        if value is not None and not _DNS_LABEL.fullmatch(value):
            raise TesselError(f"{flag} {value!r} is not a DNS-1123 label; use at most 63 lower-case "
                              "letters, digits and '-', starting and ending with a letter or digit")
    if not image or any(c.isspace() for c in image):
        raise TesselError(f"--image {image!r} is not an image reference, e.g. --image ghcr.io/org/tessel:1.0")
    if not mount_path.startswith("/") or mount_path.rstrip("/") in ("", CONFIG_DIR) or \
            any(c.isspace() for c in mount_path):
        raise TesselError(f"--mount-path {mount_path!r} must be an absolute path without spaces, "
                          f"other than / and {CONFIG_DIR}")
    check_text("--mount-path", mount_path)

    # Kubernetes expands `$(VAR)` and `$$` in args before bash runs them, so a `$` in the
    # user's text is doubled to reach bash unchanged. The operator sets MASTER_ADDR and
    # MASTER_PORT in every pod; bash reads them.
    script = train_args(f"{CONFIG_DIR}/{CONFIG_KEY}", overrides,
                        quote=lambda text: shlex.quote(text).replace("$", "$$"))
    script.append(
        f"exec torchrun --nnodes {nodes} --nproc-per-node {nproc} --rdzv-id {name} "
        '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" '
        f'--max-restarts {MAX_RESTARTS} -m tessel train "${{TRAIN[@]}}"'
    )
    resources = ([f"                  nvidia.com/gpu: {gpus_per_node}"] if not cpu else
                 [f'                  cpu: "{nproc}"'])

    def replica(kind: str, count: int) -> list[str]:
        return [
            f"    {kind}:",
            f"      replicas: {count}",
            "      restartPolicy: OnFailure",
            "      template:",
            "        spec:",
            "          containers:",
            "            - name: pytorch  # the name the training operator looks for",
            f"              image: {_yaml_str(image)}",
            f"              workingDir: {_yaml_str(mount_path)}",
            '              command: ["bash", "-c"]',
            "              args:",
            "                - |-",
            *("                  " + line for line in script),
            "              resources:",
            "                limits:" if not cpu else "                requests:",
            *resources,
            "              volumeMounts:",
            "                - name: dshm",
            "                  mountPath: /dev/shm",
            "                - name: config",
            f"                  mountPath: {CONFIG_DIR}",
            "                  readOnly: true",
            "                - name: work",
            f"                  mountPath: {_yaml_str(mount_path)}",
            "          volumes:",
            "            # Shared memory for data-loader workers and NCCL (the default is 64 MiB).",
            "            - name: dshm",
            "              emptyDir:",
            "                medium: Memory",
            "            - name: config",
            "              configMap:",
            f"                name: {name}-config",
            "            # The run directory lives here: a restarted pod resumes from it.",
            "            - name: work",
            "              persistentVolumeClaim:",
            f"                claimName: {pvc}",
        ]

    what = f"{nodes} x {nproc} CPU processes" if cpu else f"{nodes} x {gpus_per_node} GPUs"
    meta_ns = [f"  namespace: {namespace}"] if namespace else []
    lines = [
        f"# tessel training job for {config_path} ({what}), written by `tessel launch k8s`.",
        f"# The config travels in the ConfigMap; the pods work in PersistentVolumeClaim {pvc}",
        f"# (mounted at {mount_path}), where the run directory and relative data paths must be.",
        "#   kubectl apply -f THIS_FILE",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        f"  name: {name}-config",
        *meta_ns,
        "data:",
        f"  {CONFIG_KEY}: {_yaml_str(config_text)}",
        "---",
        "apiVersion: kubeflow.org/v1",
        "kind: PyTorchJob",
        "metadata:",
        f"  name: {name}",
        *meta_ns,
        "spec:",
        f'  nprocPerNode: "{nproc}"',
        "  pytorchReplicaSpecs:",
        *replica("Master", 1),
        *(replica("Worker", nodes - 1) if nodes > 1 else []),
    ]
    return "\n".join(lines) + "\n"
