"""`tessel checkpoint consolidate`: one safetensors file of a (sharded) checkpoint's model."""

from __future__ import annotations

from tessel.cli.args import Parser


def build_parser() -> Parser:
    p = Parser(prog="tessel checkpoint", description="Work with checkpoints.")
    sub = p.add_subparsers(dest="action", required=True, metavar="{consolidate}")
    c = sub.add_parser(
        "consolidate", help="write the full model of a (sharded) checkpoint as one safetensors file",
        description="Gather the model tensors of a checkpoint saved under any parallel layout\n"
                    "into one safetensors file. A LoRA run's checkpoint (adapters only) is "
                    "written\nas its base (model.init_from) with the adapters merged; its "
                    "adapters alone:\n`tessel convert tessel-to-hf RUN OUT --peft`.")
    c.add_argument("path", metavar="RUN_DIR|CHECKPOINT",
                   help="a checkpoint directory, or a run directory (its latest checkpoint)")
    c.add_argument("--output", metavar="FILE", help="file to write (default: RUN_DIR/model.safetensors)")
    return p


def cmd_checkpoint(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    from pathlib import Path

    from tessel.checkpoint.consolidate import consolidate, resolve_checkpoint
    from tessel.train.run_dir import RunDir

    ckpt = resolve_checkpoint(Path(args.path))
    run = RunDir(ckpt.parent.parent)
    output = Path(args.output) if args.output else run.path / "model.safetensors"
    if output.resolve().parent == run.path.resolve() and run.config.is_file():
        run.lock()  # writing into a run directory: no training process may write it now
    n, size, note = consolidate(ckpt, output)
    print(f"wrote {output}: {n} tensors, {size / 2**20:.1f} MiB, from {ckpt}"
          + (f"; {note}" if note else ""))
    return 0
