"""`tessel launch slurm|k8s CONFIG.toml ...`: print a job file that trains CONFIG on a
cluster (an sbatch script, or a Kubeflow PyTorchJob or TrainJob); the user submits it."""

from __future__ import annotations

import sys
from pathlib import Path

from tessel.cli.args import Parser, add_config_arguments, parse_config_args
from tessel.errors import TesselError

ABOUT = ("Print a job file that trains CONFIG.toml (with any --section.key=value overrides,\n"
         "checked now) with torchrun on every node; it resumes the run when its run\n"
         "directory already holds one.")


def build_parser() -> Parser:
    p = Parser(prog="tessel launch",
               description="Print a job file that trains CONFIG.toml on a cluster; submit it yourself.")
    targets = p.add_subparsers(dest="target", required=True, metavar="{slurm,k8s}")
    slurm = targets.add_parser("slurm", help="an sbatch script (one torchrun per node)",
                               description=ABOUT)
    k8s = targets.add_parser("k8s", help="a Kubeflow PyTorchJob (kubeflow.org/v1) or Trainer v2 "
                                         "TrainJob manifest",
                             description=ABOUT)
    for target in (slurm, k8s):
        add_config_arguments(target, "the TOML recipe the job trains (required)")
        target.add_argument("--nodes", required=True, metavar="N|MIN:MAX",
                            help="machines (pods) to train on; MIN:MAX is elastic: the run "
                                 "continues on the nodes it has, between MIN and MAX, keeping "
                                 "its global batch (Slurm: --nodes=MIN-MAX at every start; "
                                 "k8s: a PyTorchJob elasticPolicy)")
        target.add_argument("--gpus-per-node", type=int, default=8, metavar="G",
                            help="GPUs (one process each) per node or pod (default: 8); "
                                 "0 for CPU machines")
        target.add_argument("--nproc-per-node", type=int, metavar="P",
                            help="CPU machines: training processes per node or pod (default: 1)")
    k8s.add_argument("--pvc", required=True, metavar="CLAIM",
                     help="an existing PersistentVolumeClaim every pod mounts as its working "
                          "directory: the run directory lives there (restarted pods resume)")
    k8s.add_argument("--mount-path", default="/workspace", metavar="DIR",
                     help="where the claim is mounted (default: /workspace)")
    slurm.add_argument("--cpus-per-task", type=int, metavar="C",
                       help="cores per node for the job (default for CPU jobs: one per process; "
                            "GPU jobs: the cluster's default)")
    slurm.add_argument("--partition", metavar="P", help="SLURM partition")
    slurm.add_argument("--time", metavar="HH:MM:SS", help="time limit (or D-HH:MM:SS)")
    slurm.add_argument("--signal-grace", type=int, default=120, metavar="S",
                       help="seconds before the time limit when the job saves and requeues "
                            "itself (default: 120; at least one step plus one checkpoint save)")
    slurm.add_argument("--job-name", metavar="NAME", help="default: tessel-<config file name>")
    slurm.add_argument("--account", metavar="A", help="account to charge")
    slurm.add_argument("--port", type=int,
                       help="rendezvous port on the first node (default: 20000 + job id mod 40000)")
    slurm.add_argument("--python", metavar="PATH",
                       help="the Python that runs tessel on the nodes (default: this one, "
                            f"{sys.executable}; TESSEL_PYTHON overrides it at submission)")
    slurm.add_argument("--output-dir", default="logs", metavar="DIR",
                       help="where SLURM writes the job's log (created now; default: logs)")
    k8s.add_argument("--image", required=True, help="container image with tessel installed")
    k8s.add_argument("--name", help="job name, a DNS-1123 label (default: tessel-<config file name>)")
    k8s.add_argument("--namespace", metavar="NS", help="default: kubectl's current namespace")
    k8s.add_argument("--kind", choices=("pytorchjob", "trainjob"), default="pytorchjob",
                     help="pytorchjob: Kubeflow Training Operator v1 (default); trainjob: "
                          "Kubeflow Trainer v2 (trainer.kubeflow.org/v1alpha1)")
    k8s.add_argument("--runtime", default="torch-distributed", metavar="NAME",
                     help="--kind trainjob: the ClusterTrainingRuntime to run on (default: "
                          "torch-distributed)")
    return p


def cmd_launch(argv: list[str]) -> int:
    args, overrides = parse_config_args(build_parser(), argv)
    prog = f"tessel launch {args.target}"
    if args.config is None:
        raise TesselError(f"{prog} needs a config file, e.g. {prog} configs/gpt2-124m.toml --nodes 2")

    from tessel.checkpoint.init_from import load_config
    from tessel.launch import slurm
    from tessel.launch.elastic import check_node_counts
    from tessel.launch.rendezvous import NodeRange
    from tessel.parallel.dims import ParallelDims
    from tessel.train.harness_check import check_lm_eval_layout

    cfg = load_config(args.config, overrides)  # what `tessel train` would load: fail now
    span = NodeRange.parse(args.nodes, "--nodes")
    if args.target == "slurm":
        text = slurm.slurm_script(
            args.config, overrides, nodes=span.high, min_nodes=span.low,
            gpus_per_node=args.gpus_per_node,
            nproc_per_node=args.nproc_per_node, cpus_per_task=args.cpus_per_task,
            partition=args.partition, time=args.time, job_name=args.job_name,
            account=args.account, port=args.port, python=args.python,
            grace_s=args.signal_grace, output_dir=args.output_dir)
    else:
        from tessel.launch.k8s import k8s_manifest

        try:
            config_text = Path(args.config).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise TesselError(f"cannot read {args.config!r} for the ConfigMap: {exc}") from None
        text = k8s_manifest(
            args.config, config_text, overrides, nodes=span.high, min_nodes=span.low,
            image=args.image,
            pvc=args.pvc, gpus_per_node=args.gpus_per_node, nproc_per_node=args.nproc_per_node,
            mount_path=args.mount_path, name=args.name, namespace=args.namespace,
            kind=args.kind, runtime=args.runtime)
    # ... and the layout against the job's world size (after the builders checked the counts),
    # every world size an elastic job may have.
    per_node = args.gpus_per_node or args.nproc_per_node or 1
    if span.elastic:
        check_node_counts(cfg, per_node, span.counts(), "--nodes")
    else:
        ParallelDims.from_config(cfg.parallel, span.high * per_node).validate(cfg)
    check_lm_eval_layout(cfg)  # (its tasks are the cluster's files: checked by the job)
    if args.target == "slurm":
        # SLURM opens the log before the script runs: a missing directory fails the job
        # with no output anywhere, so it is made now, where the job will be submitted.
        try:
            Path(args.output_dir).mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise TesselError(f"cannot create the log directory {args.output_dir!r}: "
                              f"{exc.strerror or exc}; pass --output-dir DIR") from None
    print(text, end="")
    return 0
