"""`tessel report`: one self-contained HTML page of a run."""

from __future__ import annotations

from tessel.cli.args import Parser


def build_parser() -> Parser:
    p = Parser(prog="tessel report", description=(
        "Write RUN_DIR/report.html: one self-contained HTML page (inline SVG, no network\n"
        "needed) with the run's summary figures; plots of loss, learning rate, grad norm,\n"
        "throughput, MFU, memory and step time; its events; its config (secrets redacted)\n"
        "and run.json."))
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory of `tessel train`")
    p.add_argument("--out", metavar="PATH", help="file to write (default: RUN_DIR/report.html)")
    return p


def cmd_report(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    from pathlib import Path

    from tessel.observe.report import write_report

    out = write_report(Path(args.run_dir), Path(args.out) if args.out else None)
    print(f"wrote {out} (open it in a browser; it needs no network)")
    return 0
