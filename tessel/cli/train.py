"""`tessel train`: train a model (the demo without arguments), resume a run, or start N
processes on this machine through torchrun (--nproc)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from tessel.cli.args import Parser, add_config_arguments, parse_config_args, toml_str
from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.config import Config
    from tessel.launch.rendezvous import Rendezvous

EXIT_CODES = """\
exit codes: 0 done (or stopped by SIGTERM/SIGUSR1 with a checkpoint), 2 bad input,
            3 a collective failed or timed out, the rendezvous failed (--rdzv-timeout),
            or the watchdog saw no progress,
            4 paused by an alert (checkpoint written; --resume continues),
            5 stopped by an alert (checkpoint written), 6 spike recovery gave up
            (recovery.max_rollbacks), 7 finished with its final checkpoint, but lm_eval
            scoring failed on the way, 130 interrupted by Ctrl-C (a checkpoint was saved),
            143 stopped by SIGTERM while preparing the data (before training: nothing saved)
"""


def config_keys() -> str:
    """Every config key by section, one line a section (the end of `tessel train --help`)."""
    from tessel.config import Config, table_model

    lines = []
    for section, info in Config.model_fields.items():
        model = table_model(info.annotation)
        head = f"[[{section}]]" if model is not info.annotation else f"[{section}]"
        lines.append(f"  {head} {', '.join(model.model_fields)}")
    return "\n".join(lines) + "\n"


def build_parser() -> Parser:
    p = Parser(
        prog="tessel train", allow_abbrev=False,
        description="Train a model. With no arguments, trains the embedded demo (a small GPT on\n"
                    "this Python's standard-library sources) into runs/demo.",
        epilog=EXIT_CODES + "\nconfig keys (`tessel config --reference` prints them with "
                            "descriptions):\n" + config_keys())
    add_config_arguments(p)
    p.add_argument("--resume", metavar="RUN_DIR",
                   help="continue RUN_DIR from its latest checkpoint, with its config.toml; "
                        "overrides may change e.g. train.steps but not the model or data")
    p.add_argument("--auto-resume", action="store_true",
                   help="continue run.dir from its latest checkpoint if it holds a run, else "
                        "start it (what job scripts and torchrun restarts use)")
    p.add_argument("--force", action="store_true",
                   help="train even if the planner predicts the layout does not fit in GPU memory")
    p.add_argument("--quiet", action="store_true",
                   help="no console output (metrics still go to RUN_DIR/metrics.jsonl)")
    p.add_argument("--nproc", type=int, metavar="N",
                   help="train as N processes on this machine, started through torchrun "
                        "(with --nnodes: this node's processes, default 1)")
    multi = p.add_argument_group(
        "several machines (run the same command on every node; docs/parallelism.md#multi-node)")
    multi.add_argument("--nnodes", metavar="N|MIN:MAX",
                       help="nodes of the run, through torchrun's c10d rendezvous; MIN:MAX is "
                            "elastic: a lost node's survivors restart from the latest "
                            "checkpoint at the smaller world (the global batch and LR schedule "
                            "are kept)")
    multi.add_argument("--rdzv-endpoint", metavar="HOST:PORT",
                       help="the rendezvous: an address of one of the nodes (which hosts it) and "
                            "a free port")
    multi.add_argument("--rdzv-id", metavar="ID",
                       help="the run's name in the rendezvous (default: tessel)")
    multi.add_argument("--max-restarts", type=int, metavar="R",
                       help="restarts of the workers after a failure or a lost node before "
                            "the run gives up (default: 3)")
    multi.add_argument("--rdzv-timeout", type=int, metavar="S",
                       help="seconds to reach the rendezvous and for the nodes to join before "
                            "the command gives up with one line, exit 3 (default: torchrun's, "
                            "60 to reach it, 600 to join)")
    return p


def check_before_launch(cfg: Config, nproc: int) -> None:
    """`--nproc N`: what every worker would refuse at start-up, checked once here, so that bad
    input is one line and exit code 2 rather than N workers' lines and torchrun's traceback:
    the layout (on this machine's device type), alert delivery, TESSEL_FAULT, Muon's forced
    parameters, lm_eval (its layout, every task loaded). What needs a worker's own GPU
    (memory, bf16, fp8) stays with the workers: this process, which waits for torchrun the
    whole run, never starts CUDA."""
    from tessel.observe.alerts import check_alerts
    from tessel.optim.groups import check_muon_force
    from tessel.parallel.check import check_layout
    from tessel.parallel.dims import ParallelDims, resolved
    from tessel.train.device import pick_device
    from tessel.train.faults import check_faults
    from tessel.train.harness_check import check_lm_eval
    from tessel.train.run_dir import RunDir

    dims = ParallelDims.from_config(cfg.parallel, nproc)
    if cfg.parallel.auto:  # each worker chooses the layout
        dims.validate(cfg)
    else:
        # The requested precision: only fp16 matters to the layout, and auto never means it.
        check_layout(resolved(cfg)[0], dims, pick_device(cfg.train.device).type,
                     cfg.train.precision)
    check_alerts(cfg.alerts, cfg.notify)
    check_faults(nproc, cfg.train.steps)
    if not RunDir(cfg.run.dir).holds_run():  # a new run (a resumed one keeps its patterns)
        check_muon_force(cfg)
    check_lm_eval(cfg)


def cmd_train(argv: list[str]) -> int:
    from tessel.launch.local import split_nproc
    from tessel.launch.rendezvous import rendezvous_from, split_launch

    # --nproc and the multi-node options are taken out first: the workers get the other
    # arguments exactly as given.
    nproc, argv = split_nproc(argv)
    taken, argv = split_launch(argv)
    rdzv = rendezvous_from(taken)
    args, overrides = parse_config_args(build_parser(), argv)
    if args.config is not None and args.resume is not None:
        raise TesselError(
            "--resume reads the config saved in the run directory; drop the config file "
            "and pass overrides instead"
        )
    if args.resume is not None and args.auto_resume:
        raise TesselError("--auto-resume and --resume exclude each other; pass one")

    from tessel.checkpoint.hf_models import check_export
    from tessel.checkpoint.init_from import load_config
    from tessel.config import Config, read_saved

    resume = args.resume
    if args.auto_resume:
        # Continue the run if its directory already holds one (a restarted job), else start
        # it. Safe with many ranks: rank 0 writes config.toml only after every rank has
        # passed the trainer's start-up barrier, i.e. after all of them decided here.
        start = load_config(args.config, overrides)
        if (Path(start.run.dir) / "config.toml").is_file():
            resume = start.run.dir
            overrides = [o for o in overrides if not o.removeprefix("--").startswith("run.dir=")]

    if resume is not None:
        if any(o.removeprefix("--").startswith("run.dir=") for o in overrides):
            raise TesselError("--resume RUN_DIR names the run directory; drop --run.dir")
        run_config = Path(resume) / "config.toml"
        if not run_config.is_file():
            raise TesselError(
                f"cannot resume {resume!r}: it is not a tessel run directory (no config.toml)"
            )
        # The run directory is where the run is now (it may have been moved).
        cfg = Config.from_dict(read_saved(run_config),
                               [*overrides, f"--run.dir={toml_str(resume)}"])
        check_export(cfg)  # as load_config does for a new run: before torchrun or the trainer
    else:
        cfg = load_config(args.config, overrides)
    if rdzv is not None:
        return _launch_nodes(cfg, nproc or 1, rdzv, argv)
    if nproc is not None and nproc > 1:
        from tessel.launch.local import run_local

        check_before_launch(cfg, nproc)
        return run_local(nproc, argv)

    from tessel.train import Trainer
    from tessel.train.control import catch_early_signals

    # a scheduler's SIGTERM during start-up still ends in a checkpoint
    restore_signals = catch_early_signals()
    trainer = None
    try:
        trainer = Trainer(cfg, resume=resume is not None, console=not args.quiet,
                          force=args.force, auto_resume=args.auto_resume)
        return trainer.train().exit_code
    finally:
        if trainer is not None:
            trainer.close()
        restore_signals()


def _launch_nodes(cfg: Config, nproc: int, rdzv: Rendezvous, train_args: list[str]) -> int:
    """This node's part of a multi-node run: every node count it may run on checked first
    (one line naming the counts that fit), then torchrun with the c10d rendezvous."""
    from tessel.launch.elastic import check_node_counts, replan
    from tessel.launch.local import launched_by_torchrun, run_torchrun
    from tessel.launch.rendezvous import multinode_command, torchrun_env
    from tessel.parallel.dims import ParallelDims

    if launched_by_torchrun():
        raise TesselError("--nnodes starts torchrun itself; drop the multi-node options when "
                          "launching with torchrun")
    check_node_counts(cfg, nproc, rdzv.nodes.counts())
    world = nproc * rdzv.nodes.high
    check_before_launch(replan(cfg, ParallelDims.from_config(cfg.parallel, world))[0], world)
    return run_torchrun(multinode_command(nproc, rdzv, train_args), torchrun_env(rdzv.nodes))
