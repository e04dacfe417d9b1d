"""The data commands: `tessel tokenizer train`, `tessel preprocess`, `tessel data inspect`.

Each returns an exit code; bad input raises `TesselError` (one line on stderr, exit 2, via
`tessel.cli.main`) before anything is written, and never leaves half-written outputs.
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from tessel.cli.args import Parser
from tessel.errors import TesselError
from tessel.fileio import write_text_atomic

if TYPE_CHECKING:
    from tessel.data.indexed import IndexedDataset

_INPUT_HELP = ("text files (one document each), .jsonl/.json (one object per line), Parquet, "
               "Arrow, Hugging Face save_to_disk directories; text and JSONL also gzip/zstd/"
               "bzip2/xz-compressed (recognised by content); directories (recursive) or globs")
_SAMPLE_CHARS = 200


def tokenizer_parser() -> Parser:
    p = Parser(prog="tessel tokenizer", description="Train tokenizers.")
    sub = p.add_subparsers(dest="action", required=True, metavar="{train}")
    t = sub.add_parser("train", help="train a byte-level BPE (GPT-2 style) on text",
                       description="Train a byte-level BPE (GPT-2 style) and save it as tokenizer.json.")
    t.add_argument("--input", nargs="+", required=True, metavar="PATH", help=_INPUT_HELP)
    t.add_argument("--json-key", default="text", metavar="KEY",
                   help="JSONL/Parquet/Arrow field holding the text")
    t.add_argument("--vocab-size", type=int, required=True, metavar="N", help="ids in the vocabulary (> 257)")
    t.add_argument("--min-frequency", type=int, default=2, metavar="N",
                   help="least count of a merged pair")
    t.add_argument("--output", required=True, metavar="TOKENIZER.json", help="file to write")
    return p


def cmd_tokenizer(argv: list[str]) -> int:
    """`tessel tokenizer train`: train a byte-level BPE and save it as a tokenizer.json."""
    args = tokenizer_parser().parse_args(argv)
    if args.min_frequency < 1:
        raise TesselError("--min-frequency must be >= 1")
    output = Path(args.output)
    if output.is_dir():
        raise TesselError(f"--output {args.output!r} is a directory; name a file, e.g. "
                          f"{os.path.join(args.output, 'tokenizer.json')!r}")

    from tessel.data.readers import ReadStats, iter_documents
    from tessel.data.tokenizer import train_bpe

    stats = ReadStats()
    docs = iter_documents(args.input, args.json_key, stats)
    start = time.perf_counter()
    tok = train_bpe(docs, args.vocab_size, min_frequency=args.min_frequency)
    if stats.documents == 0:
        raise TesselError(f"inputs hold no documents ({stats.files} files, {stats.empty_skipped} "
                          "empty); nothing to train on")
    write_text_atomic(output, tok.to_json())
    print(f"trained a {tok.vocab_size:,}-id byte-level BPE on {stats.documents:,} documents "
          f"({stats.bytes_read / 1e6:,.1f} MB) in {time.perf_counter() - start:.1f} s -> "
          f"{output} (fingerprint {tok.fingerprint()[:12]})")
    return 0


def preprocess_parser() -> Parser:
    p = Parser(prog="tessel preprocess",
               description="Tokenize raw text into an indexed dataset: PREFIX.bin (token ids),\n"
                           "PREFIX.idx (document index) and PREFIX.tokenizer.json.")
    p.add_argument("--input", nargs="+", required=True, metavar="PATH", help=_INPUT_HELP)
    p.add_argument("--json-key", default="text", metavar="KEY",
                   help="JSONL/Parquet/Arrow field holding the text")
    p.add_argument("--tokenizer", default="bytes", metavar="SPEC",
                   help="bytes (default), a tokenizer.json, gpt2-files:VOCAB.json,MERGES.txt, "
                        "or tiktoken:[NAME=]FILE.tiktoken (cl100k_base, o200k_base, ...)")
    p.add_argument("--eod-token", default="auto", metavar="TOKEN",
                   help="the token --append-eod ends documents with (default: the tokenizer's "
                        "<|endoftext|>, <|end_of_text|>, </s>, ...; added when it has none)")
    p.add_argument("--output", required=True, metavar="PREFIX",
                   help="output prefix, e.g. data/web -> data/web.bin, data/web.idx")
    p.add_argument("--workers", type=int, default=1, metavar="N",
                   help="tokenizer processes (default 1: the tokenizer already uses every core)")
    p.add_argument("--append-eod", action="store_true",
                   help="end every document with the end-of-document token")
    p.add_argument("--quiet", action="store_true", help="no progress and no summary")
    p.add_argument("--force", action="store_true",
                   help="replace an existing dataset at the output prefix")
    p.add_argument("--format", choices=("tessel", "megatron"), default="tessel",
                   help="index format: tessel (default; checksummed) or megatron (MMIDIDX, "
                        "read by Megatron-LM and by tessel)")
    return p


def cmd_preprocess(argv: list[str]) -> int:
    """`tessel preprocess`: tokenize raw text into an indexed dataset PREFIX.bin/.idx."""
    args = preprocess_parser().parse_args(argv)
    if args.workers < 1:
        raise TesselError(f"--workers must be >= 1, got {args.workers}")

    from tessel.data.preprocess import preprocess
    from tessel.data.tokenizer import load_tokenizer

    tok = load_tokenizer(args.tokenizer, args.eod_token)
    summary = preprocess(args.input, tok, args.output, json_key=args.json_key,
                         workers=args.workers, append_eod=args.append_eod,
                         progress=not args.quiet, force=args.force, fmt=args.format)
    if not args.quiet:
        print(summary.line())
    return 0


def data_parser() -> Parser:
    p = Parser(prog="tessel data", description="Look at indexed datasets.")
    sub = p.add_subparsers(dest="action", required=True, metavar="{inspect}")
    i = sub.add_parser("inspect", help="sizes, tokenizer and a decoded sample of a dataset",
                       description="Print a dataset's sizes, tokenizer and a decoded sample.")
    i.add_argument("prefix", metavar="PREFIX", help="dataset prefix (PREFIX.bin/.idx)")
    i.add_argument("--verify", action="store_true",
                   help="also check PREFIX.bin's checksum and ids (reads the whole file)")
    i.add_argument("--tokenizer", metavar="SPEC",
                   help="for a Megatron-LM dataset (which keeps none): the tokenizer it was "
                        "made with (a tokenizer.json, gpt2-files:VOCAB.json,MERGES.txt or "
                        "tiktoken:[NAME=]FILE)")
    return p


def cmd_data(argv: list[str]) -> int:
    """`tessel data inspect`: describe an indexed dataset."""
    args = data_parser().parse_args(argv)

    from tessel.data.indexed import IndexedDataset
    from tessel.data.tokenizer import load_tokenizer

    ds = IndexedDataset(args.prefix, load_tokenizer(args.tokenizer) if args.tokenizer else None)
    if args.verify:
        ds.verify()
    print(inspect_text(ds, verified=args.verify))
    return 0


def inspect_text(ds: IndexedDataset, verified: bool = False) -> str:
    """The `tessel data inspect` report for an open dataset."""
    lengths = ds.doc_lengths
    mean = float(lengths.mean()) if ds.n_docs else 0.0
    longest = int(lengths.max()) if ds.n_docs else 0
    tok = ds.tokenizer()
    rows = [
        ("dataset", str(ds.prefix)),
        ("documents", f"{ds.n_docs:,}"),
        ("tokens", f"{ds.n_tokens:,}"),
        ("dtype", f"{ds.dtype.name} ({ds.bin_path.stat().st_size / 1e6:,.1f} MB)"),
        ("format", "tessel" if ds.format == "tessel" else "Megatron-LM (MMIDIDX index)"),
        ("vocab size", f"{ds.vocab_size:,}"),
        ("tokenizer", f"{ds.tokenizer_fingerprint[:12]} (eod id {tok.eod_id}; {tok.template()} "
                      "when preprocessing)"),
        ("doc length", f"mean {mean:,.1f}, max {longest:,} tokens"),
    ]
    if verified:
        rows.append(("checksum", "ok" if ds.format == "tessel" else
                     "none in the Megatron format; every id is inside the vocabulary"))
    lines = [f"{name:<11} {value}" for name, value in rows]
    if ds.n_docs:
        # Enough ids for 200 characters (a token is at least one byte), decoded, cut to length.
        sample = tok.decode(ds.document(0)[: 4 * _SAMPLE_CHARS].tolist())[:_SAMPLE_CHARS]
        lines.append(f"sample      document 0, first {len(sample)} characters:")
        lines.extend("  | " + line for line in sample.splitlines() or [""])
    return "\n".join(lines)
