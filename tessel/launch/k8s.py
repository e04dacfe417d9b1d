"""The Kubernetes job `tessel launch k8s` prints: a ConfigMap holding the config file and a
Kubeflow job that trains it: a PyTorchJob (kubeflow.org/v1, the Training Operator) or, with
`--kind trainjob`, a TrainJob (trainer.kubeflow.org/v1alpha1, Kubeflow Trainer v2), each
checked against its CRD's own schema in tests/unit/test_launch.py.

Every pod mounts the config (a ConfigMap: the submitting machine's path exists in no pod) and
a PersistentVolumeClaim as its working directory, where the run directory (and relative data
paths) live, so a restarted pod continues the run (`--auto-resume`).

Every value from the user is a YAML double-quoted string, or a line of the container's bash
script quoted for bash and for Kubernetes' own `$(VAR)` expansion; text no YAML line can
carry (control characters, line breaks) is refused (`check_text`).
"""

from __future__ import annotations

import re
import shlex

from tessel.errors import TesselError
from tessel.launch.job_text import MAX_RESTARTS, check_count, check_text, default_name, train_args
from tessel.launch.rendezvous import ELASTIC_ENV, SEPARATE_STORE_EXPORT

_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
CONFIG_DIR = "/etc/tessel"  # where the ConfigMap is mounted
CONFIG_KEY = "config.toml"
KINDS = ("pytorchjob", "trainjob")
TRAINJOB_NODE = "node"  # the replicated job and container of Kubeflow's torch runtimes


def _yaml_str(text: str) -> str:
    r"""TEXT as a YAML double-quoted scalar that YAML readers (PyYAML; go-yaml, which kubectl
    uses) read back exactly: printable ASCII as it is but for '"' and a backslash, every other
    character escaped as \xXX, \uXXXX or \UXXXXXXXX. (A JSON string is valid YAML but
    writes a character beyond U+FFFF, an emoji, as a surrogate pair, which go-yaml refuses.)"""
    out = []
    for c in text:
        code = ord(c)
        if c in '"\\':
            out.append("\\" + c)
        elif 0x20 <= code < 0x7F:
            out.append(c)
        else:
            out.append(f"\\x{code:02x}" if code <= 0xFF else
                       f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}")
    return '"' + "".join(out) + '"'


def _shape(kind: str, nodes: int, min_nodes: int | None, gpus_per_node: int,
           nproc_per_node: int | None) -> tuple[int, bool, int]:
    """The job's shape, checked: (fewest pods, CPU pool?, processes per pod)."""
    if kind not in KINDS:
        raise TesselError(f"--kind {kind!r} must be one of {', '.join(KINDS)}")
    check_count("--nodes", nodes)
    low = nodes if min_nodes is None else min_nodes
    check_count("--nodes", low)
    if low < nodes and kind == "trainjob":
        raise TesselError(f"--nodes {low}:{nodes}: a TrainJob (trainer.kubeflow.org/v1alpha1) has "
                          "no elastic policy (only its runtime's torch elasticPolicy can give a "
                          "node range); use --kind pytorchjob for an elastic job, or a fixed "
                          "--nodes N")
    if gpus_per_node < 0:
        raise TesselError(f"--gpus-per-node must be >= 0 (0: a CPU pool), got {gpus_per_node}")
    cpu = gpus_per_node == 0
    nproc = nproc_per_node if nproc_per_node is not None else (1 if cpu else gpus_per_node)
    check_count("--nproc-per-node", nproc)
    if not cpu and nproc != gpus_per_node:
        raise TesselError(f"--nproc-per-node {nproc} differs from --gpus-per-node "
                          f"{gpus_per_node}; a GPU pod runs one process per GPU")
    return low, cpu, nproc


def _check_text_values(config_path: str, name: str, namespace: str | None, pvc: str,
                       runtime: str, image: str, mount_path: str) -> None:
    """Refuse a name that is no DNS label, an image or mount path no pod can use, and text
    no manifest line can carry."""
    for flag, value in (("--name", name), ("--namespace", namespace), ("--pvc", pvc),
                        ("--runtime", runtime)):
        if value is not None and not _DNS_LABEL.fullmatch(value):
            raise TesselError(f"{flag} {value!r} is not a DNS-1123 label; use at most 63 lower-case "
                              "letters, digits and '-', starting and ending with a letter or digit")
    if not image or any(c.isspace() for c in image):
        raise TesselError(f"--image {image!r} is not an image reference, e.g. --image ghcr.io/org/tessel:1.0")
    check_text("--image", image)
    check_text("the config path", config_path)  # written into the manifest's first comment
    if not mount_path.startswith("/") or mount_path.rstrip("/") in ("", CONFIG_DIR) or \
            any(c.isspace() for c in mount_path):
        raise TesselError(f"--mount-path {mount_path!r} must be an absolute path without spaces, "
                          f"other than / and {CONFIG_DIR}")
    check_text("--mount-path", mount_path)


def k8s_manifest(
    config_path: str,
    config_text: str,
    overrides: list[str],
    *,
    nodes: int,
    min_nodes: int | None = None,
    image: str,
    pvc: str,
    gpus_per_node: int = 8,
    nproc_per_node: int | None = None,
    mount_path: str = "/workspace",
    name: str | None = None,
    namespace: str | None = None,
    kind: str = "pytorchjob",
    runtime: str = "torch-distributed",
) -> str:
    """A ConfigMap with `config_text` and a job that trains it on `nodes` pods, each with
    `gpus_per_node` GPUs, or, with 0, `nproc_per_node` CPU processes: a Kubeflow PyTorchJob
    (`kind="pytorchjob"`, Training Operator v1) or a Kubeflow Trainer v2 TrainJob
    (`kind="trainjob"`) on the ClusterTrainingRuntime `runtime`. `min_nodes` < `nodes`: an
    elastic PyTorchJob (`elasticPolicy`), between the two pods (TrainJob v1alpha1 has no
    equivalent and is refused)."""
    low, cpu, nproc = _shape(kind, nodes, min_nodes, gpus_per_node, nproc_per_node)
    name = name if name is not None else default_name(config_path)
    _check_text_values(config_path, name, namespace, pvc, runtime, image, mount_path)

    # Kubernetes expands `$(VAR)` and `$$` in args before bash runs them, so a `$` in the
    # user's text is doubled to reach bash unchanged.
    script = train_args(f"{CONFIG_DIR}/{CONFIG_KEY}", overrides,
                        quote=lambda text: shlex.quote(text).replace("$", "$$"))
    # A pod that restarts (or returns to an elastic job) joins a later rendezvous round than
    # the others: it needs the store that every round publishes afresh (see the constant).
    script.append(SEPARATE_STORE_EXPORT)
    span = f"{low}-{nodes}" if low < nodes else str(nodes)
    what = f"{span} x {nproc} CPU processes" if cpu else f"{span} x {gpus_per_node} GPUs"
    # Names are DNS labels, but "yes", "null" or "123" would not be YAML strings unquoted.
    meta_ns = [f"  namespace: {_yaml_str(namespace)}"] if namespace else []
    header = [
        f"# tessel training job for {config_path} ({what}), written by `tessel launch k8s`.",
        f"# The config travels in the ConfigMap; the pods work in PersistentVolumeClaim {pvc}",
        f"# (mounted at {mount_path}), where the run directory and relative data paths must be.",
        "#   kubectl apply -f THIS_FILE",
        "apiVersion: v1",
        "kind: ConfigMap",
        "metadata:",
        f"  name: {_yaml_str(name + '-config')}",
        *meta_ns,
        "data:",
        f"  {CONFIG_KEY}: {_yaml_str(config_text)}",
        "---",
    ]
    volumes = _volumes(name, pvc, mount_path)
    if kind == "trainjob":
        job = _trainjob(name, meta_ns, script, volumes, image=image, nodes=nodes, nproc=nproc,
                        gpus_per_node=gpus_per_node, mount_path=mount_path, runtime=runtime)
    else:
        job = _pytorchjob(name, meta_ns, script, volumes, image=image, nodes=nodes, low=low,
                          nproc=nproc, gpus_per_node=gpus_per_node, mount_path=mount_path)
    return "\n".join(header + job) + "\n"


def _resources(gpus_per_node: int, nproc: int, indent: str) -> list[str]:
    """GPUs as limits (the device plugin's resource), or the CPU pool's cores as requests."""
    if gpus_per_node:
        return [f"{indent}limits:", f"{indent}  nvidia.com/gpu: {gpus_per_node}"]
    return [f"{indent}requests:", f'{indent}  cpu: "{nproc}"']


def _volumes(name: str, pvc: str, mount_path: str) -> tuple[list[str], list[str]]:
    """(volumeMounts, volumes) items, unindented: shared memory, the config, the claim."""
    mounts = [
        "- name: dshm",
        "  mountPath: /dev/shm",
        "- name: config",
        f"  mountPath: {CONFIG_DIR}",
        "  readOnly: true",
        "- name: work",
        f"  mountPath: {_yaml_str(mount_path)}",
    ]
    volumes = [
        "# Shared memory for data-loader workers and NCCL (the default is 64 MiB).",
        "- name: dshm",
        "  emptyDir:",
        "    medium: Memory",
        "- name: config",
        "  configMap:",
        f"    name: {_yaml_str(name + '-config')}",
        "# The run directory lives here: a restarted pod resumes from it.",
        "- name: work",
        "  persistentVolumeClaim:",
        f"    claimName: {_yaml_str(pvc)}",
    ]
    return mounts, volumes


def _indented(lines: list[str], indent: str) -> list[str]:
    return [indent + line for line in lines]


def _pytorchjob(name: str, meta_ns: list[str], script: list[str],
                volumes: tuple[list[str], list[str]], *, image: str, nodes: int, low: int,
                nproc: int, gpus_per_node: int, mount_path: str) -> list[str]:
    """A kubeflow.org/v1 PyTorchJob: one Master and nodes - 1 Workers (a one-node job has no
    Worker spec, as the operator accepts). The operator sets MASTER_ADDR and MASTER_PORT.

    Elastic (low < nodes): Workers only, `nodes` of them, and an `elasticPolicy` (c10d,
    minReplicas low, maxReplicas nodes): the operator gives torchrun its node range and
    rendezvous through the PET_* variables (PET_NNODES=low:nodes, PET_RDZV_ENDPOINT on the
    first Worker), and the workers re-plan the batch split for the world they find."""
    if low < nodes:
        command = [*script, f"export {ELASTIC_ENV}={low}:{nodes}",
                   f"exec torchrun --nproc-per-node {nproc} --max-restarts {MAX_RESTARTS} "
                   '-m tessel train "${TRAIN[@]}"']
    else:
        command = [*script, (
            f"exec torchrun --nnodes {nodes} --nproc-per-node {nproc} --rdzv-id {name} "
            '--rdzv-backend c10d --rdzv-endpoint "$MASTER_ADDR:$MASTER_PORT" '
            f'--max-restarts {MAX_RESTARTS} -m tessel train "${{TRAIN[@]}}"')]

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
            *_indented(command, "                  "),
            "              resources:",
            *_resources(gpus_per_node, nproc, "                "),
            "              volumeMounts:",
            *_indented(volumes[0], "                "),
            "          volumes:",
            *_indented(volumes[1], "            "),
        ]

    if low < nodes:
        policy = ["  # A lost pod's survivors restart from the latest checkpoint on fewer pods;",
                  "  # docs/parallelism.md#elastic-world-size says what returning pods do.",
                  "  elasticPolicy:", "    rdzvBackend: c10d", f"    minReplicas: {low}",
                  f"    maxReplicas: {nodes}", f"    maxRestarts: {MAX_RESTARTS}"]
        replicas = replica("Worker", nodes)
    else:
        policy = []
        replicas = [*replica("Master", 1), *(replica("Worker", nodes - 1) if nodes > 1 else [])]
    return [
        "apiVersion: kubeflow.org/v1",
        "kind: PyTorchJob",
        "metadata:",
        f"  name: {_yaml_str(name)}",
        *meta_ns,
        "spec:",
        f'  nprocPerNode: "{nproc}"',
        *policy,
        "  pytorchReplicaSpecs:",
        *replicas,
    ]


def _trainjob(name: str, meta_ns: list[str], script: list[str],
              volumes: tuple[list[str], list[str]], *, image: str, nodes: int, nproc: int,
              gpus_per_node: int, mount_path: str, runtime: str) -> list[str]:
    """A Kubeflow Trainer v2 TrainJob (trainer.kubeflow.org/v1alpha1) on a torch runtime:
    the runtime's torch plugin sets PET_NNODES, PET_NPROC_PER_NODE, PET_NODE_RANK,
    PET_MASTER_ADDR and PET_MASTER_PORT, which torchrun reads as its defaults. The volumes
    reach the runtime's `node` pods through a runtime patch, which cannot set a working
    directory: the script changes into the claim itself."""
    command = [f"cd {shlex.quote(mount_path).replace('$', '$$')}", *script,
               f'exec torchrun --max-restarts {MAX_RESTARTS} -m tessel train "${{TRAIN[@]}}"']
    return [
        "apiVersion: trainer.kubeflow.org/v1alpha1",
        "kind: TrainJob",
        "metadata:",
        f"  name: {_yaml_str(name)}",
        *meta_ns,
        "spec:",
        "  runtimeRef:",
        f"    name: {_yaml_str(runtime)}",
        "  trainer:",
        f"    image: {_yaml_str(image)}",
        f"    numNodes: {nodes}",
        f"    numProcPerNode: {nproc}",
        '    command: ["bash", "-c"]',
        "    args:",
        "      - |-",
        *_indented(command, "        "),
        "    resourcesPerNode:",
        *_resources(gpus_per_node, nproc, "      "),
        "  runtimePatches:",
        "    - manager: tessel.launch",
        "      trainingRuntimeSpec:",
        "        template:",
        "          spec:",
        "            replicatedJobs:",
        f"              - name: {TRAINJOB_NODE}  # the runtime's training nodes",
        "                template:",
        "                  spec:",
        "                    template:",
        "                      spec:",
        "                        containers:",
        f"                          - name: {TRAINJOB_NODE}",
        "                            volumeMounts:",
        *_indented(volumes[0], "                              "),
        "                        volumes:",
        *_indented(volumes[1], "                          "),
    ]
