"""Preprocessing throughput against the tokenizer alone, and preprocessing's peak memory,
for two corpus sizes, side by side in one run.

Commands (the defaults take about 3 minutes on two idle CPU cores; a 2 GB .jsonl.zst corpus
with `--sizes-mb 200 2000 --compress zst --shard-mb 256 --baseline-mb 200`, about 25):

    .venv/bin/python benchmarks/preprocess.py --sizes-mb 20 80 --workers 1 2

Method
- corpus: this Python's standard-library sources (sorted, one document per file, cycled until
  the size is reached), written as JSONL shards of at most 16 MB to a temporary directory:
  the common Megatron-style input. MB are of document text (UTF-8), the same bytes for both
  sides; JSON syntax is not counted.
- tokenizer: by default a byte-level BPE (`--vocab-size`, 8192) trained with `train_bpe` on
  the first ~2 MB of documents; or any `--tokenizer SPEC` that `load_tokenizer` accepts.
- tokenizer alone: in a fresh child process, every document is first read into memory
  (untimed), then `Tokenizer.encode_batch` is timed twice: over the same batches preprocess
  forms in-process (1024 documents / 2M characters), and in one call over all documents
  (no per-batch barrier, but GBs of the library's per-token objects at once). The faster of
  the two is the baseline: the tokenizer with all its threads and no I/O, no conversion to
  arrays, no writing.
- preprocess: in a fresh child process, `preprocess(corpus_dir, tok, prefix, workers=W,
  progress=False)` is timed end to end (reading and JSON parsing, tokenizing, converting,
  writing and fsyncing .bin/.idx/.tokenizer.json). Its token count must equal the baseline's.
- ratio = preprocess MB/s / tokenizer-alone MB/s (target >= 0.8), from the median time over
  `--rounds` rounds (each round runs the baseline, then each worker count).
- memory: peak RSS of the preprocess child (`getrusage(RUSAGE_SELF).ru_maxrss`, once done),
  its growth over the RSS it had before calling `preprocess` (imports and tokenizer already
  loaded; from /proc/self/statm), and the largest worker's peak (`RUSAGE_CHILDREN`; forked
  workers start as copies of the parent, so they include its imports). Flat memory means
  the growth does not scale with the corpus size.

Never run as a timed test in CI.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

_SHARD_BYTES = 16 << 20
_ONE_CALL_MAX_BYTES = 256e6


def _stdlib_texts() -> list[str]:
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(p for p in root.rglob("*.py") if "site-packages" not in p.parts and p.is_file())
    texts = [p.read_bytes().decode("utf-8", errors="replace") for p in files]
    return [t for t in texts if t]


def _open_shard(directory: Path, shard: int, compress: str) -> Any:
    if compress == "zst":
        import zstandard

        raw = open(directory / f"shard-{shard:03d}.jsonl.zst", "wb")
        return io.TextIOWrapper(zstandard.ZstdCompressor(level=3).stream_writer(raw),
                                encoding="utf-8")
    return open(directory / f"shard-{shard:03d}.jsonl", "w", encoding="utf-8")


def make_corpus(directory: Path, megabytes: float, texts: list[str], compress: str = "none",
                shard_bytes_max: int = _SHARD_BYTES) -> dict[str, int]:
    """JSONL shards (zstd-compressed with `compress="zst"`, as the Pile and SlimPajama ship)
    holding ~`megabytes` MB of document text; returns docs, text bytes and bytes on disk."""
    directory.mkdir(parents=True, exist_ok=True)
    target = int(megabytes * 1e6)
    docs = text_bytes = shard = shard_bytes = 0
    out = _open_shard(directory, shard, compress)
    try:
        while text_bytes < target:
            text = texts[docs % len(texts)]
            line = json.dumps({"text": text}) + "\n"
            if shard_bytes and shard_bytes + len(line) > shard_bytes_max:
                out.close()
                shard, shard_bytes = shard + 1, 0
                out = _open_shard(directory, shard, compress)
            out.write(line)
            shard_bytes += len(line)
            docs += 1
            text_bytes += len(text.encode("utf-8"))
    finally:
        out.close()
    disk = sum(f.stat().st_size for f in directory.iterdir())
    return {"docs": docs, "text_bytes": text_bytes, "disk_bytes": disk}


def _rss_now_mb() -> float | None:
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE") / 1e6


def _maxrss_mb(who: int) -> float:
    kb = resource.getrusage(who).ru_maxrss
    return kb / 1e6 if sys.platform == "darwin" else kb / 1e3  # bytes on macOS, KiB elsewhere


def child_tokenizer(corpus: Path, tokenizer: str, limit_mb: float) -> dict[str, Any]:
    from tessel.data.preprocess import _BATCH_CHARS, DEFAULT_BATCH_SIZE, _batches
    from tessel.data.readers import iter_documents
    from tessel.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    docs, size = [], 0
    for doc in iter_documents([corpus]):  # the first `limit_mb` MB (all, by default)
        if limit_mb and size >= limit_mb * 1e6:
            break
        docs.append(doc)
        size += len(doc.encode("utf-8"))
    batches = list(_batches(docs, DEFAULT_BATCH_SIZE, _BATCH_CHARS["in_process"]))
    start = time.perf_counter()
    tokens = sum(len(ids) for batch in batches for ids in tok.encode_batch(batch))
    batched = time.perf_counter() - start
    one_call = float("inf")
    if size <= _ONE_CALL_MAX_BYTES:  # one call over GBs holds tens of GB of token objects
        start = time.perf_counter()
        ids = tok.encode_batch(docs)
        one_call = time.perf_counter() - start
        if sum(map(len, ids)) != tokens:
            raise SystemExit("batched and one-call encodings differ")
    return {"seconds": min(batched, one_call), "batched_s": batched, "one_call_s": one_call,
            "tokens": tokens, "docs": len(docs), "text_bytes": size}


def child_preprocess(corpus: Path, tokenizer: str, workers: int, out: Path) -> dict[str, Any]:
    from tessel.data.preprocess import preprocess
    from tessel.data.tokenizer import load_tokenizer

    tok = load_tokenizer(tokenizer)
    rss_before = _rss_now_mb()
    start = time.perf_counter()
    summary = preprocess([corpus], tok, out, workers=workers, progress=False)
    seconds = time.perf_counter() - start
    peak = _maxrss_mb(resource.RUSAGE_SELF)
    return {"seconds": seconds, "tokens": summary.tokens, "docs": summary.documents,
            "peak_rss_mb": peak, "rss_before_mb": rss_before,
            "rss_growth_mb": None if rss_before is None else peak - rss_before,
            "worker_peak_rss_mb": _maxrss_mb(resource.RUSAGE_CHILDREN) if workers > 1 else None}


def _run_child(*args: str) -> dict[str, Any]:
    env = {**os.environ, "CI": "true"}
    proc = subprocess.run([sys.executable, __file__, "--child", *args], capture_output=True,
                          text=True, env=env)
    if proc.returncode != 0:
        raise SystemExit(f"child {args} failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _prepare_tokenizer(args: argparse.Namespace, work: Path, texts: list[str]) -> tuple[str, str]:
    from tessel.data.tokenizer import train_bpe

    if args.tokenizer:
        return args.tokenizer, args.tokenizer
    sample, size = [], 0
    for t in texts:
        sample.append(t)
        size += len(t)
        if size > 2_000_000:
            break
    path = work / "tokenizer.json"
    train_bpe(sample, args.vocab_size).save(path)
    return str(path), f"byte-level BPE, {args.vocab_size} ids, trained on {size / 1e6:.1f} MB"


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    import tokenizers

    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="tessel-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    texts = _stdlib_texts()
    tok_spec, tok_desc = _prepare_tokenizer(args, work, texts)
    print(f"machine: {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
          f"tokenizers {tokenizers.__version__}; tokenizer: {tok_desc}; work dir {work}")
    rows = []
    for size in args.sizes_mb:
        corpus = work / f"corpus-{size:g}mb-{args.compress}"
        start = time.perf_counter()
        info = make_corpus(corpus, size, texts, args.compress, int(args.shard_mb * 1e6))
        print(f"corpus {size:g} MB: {info['docs']:,} documents, {info['disk_bytes'] / 1e6:,.1f} MB "
              f"on disk ({args.compress}), written in {time.perf_counter() - start:.0f} s", flush=True)
        mb = info["text_bytes"] / 1e6
        whole = not args.baseline_mb or args.baseline_mb >= mb
        times: dict[str, list[float]] = {}
        results: dict[str, dict[str, Any]] = {}
        for _ in range(args.rounds):
            base = _run_child("tokenizer", str(corpus), tok_spec, str(args.baseline_mb or 0))
            base_mb = base["text_bytes"] / 1e6
            for key in ("seconds", "batched_s", "one_call_s"):
                times.setdefault(key, []).append(base[key])
            for w in args.workers:
                res = _run_child("preprocess", str(corpus), tok_spec, str(w), str(work / f"out-{size:g}-{w}"))
                print(f"  {size:g} MB, {w} worker(s): {res['seconds']:.0f} s, peak RSS "
                      f"{res['peak_rss_mb']:.0f} MB", flush=True)
                if whole and (res["tokens"], res["docs"]) != (base["tokens"], base["docs"]):
                    raise SystemExit(f"preprocess made {res['tokens']} tokens / {res['docs']} docs, the "
                                     f"tokenizer alone {base['tokens']} / {base['docs']}")
                times.setdefault(f"w{w}", []).append(res["seconds"])
                results[f"w{w}"] = res  # memory: the last round's (they agree to ~1 MB)
        base_rate = base_mb / statistics.median(times["seconds"])
        for w in args.workers:
            res, pre_s = results[f"w{w}"], statistics.median(times[f"w{w}"])
            rows.append({
                "corpus_mb": round(mb, 1), "disk_mb": round(info["disk_bytes"] / 1e6, 1),
                "compress": args.compress, "baseline_mb": round(base_mb, 1),
                "docs": info["docs"], "tokens": res["tokens"], "workers": w,
                "tokenizer_mb_s": base_rate, "preprocess_mb_s": mb / pre_s,
                "ratio": mb / pre_s / base_rate,
                "tokenizer_batched_mb_s": base_mb / statistics.median(times["batched_s"]),
                "tokenizer_one_call_mb_s": base_mb / statistics.median(times["one_call_s"]),
                "peak_rss_mb": res["peak_rss_mb"], "rss_growth_mb": res["rss_growth_mb"],
                "worker_peak_rss_mb": res["worker_peak_rss_mb"], "rounds": args.rounds,
            })
    if not args.keep and not args.workdir:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return rows


def _fmt(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict[str, Any]]) -> None:
    head = (f"{'corpus MB':>9} {'on disk':>8} {'docs':>9} {'tokens':>13} {'workers':>7} "
            f"{'tok batched':>11} "
            f"{'tok 1-call':>10} {'tok-alone MB/s':>14} "
            f"{'preprocess MB/s':>15} {'ratio':>6} {'peak RSS MB':>11} {'RSS growth MB':>13} "
            f"{'worker peak MB':>14}")
    print(head)
    for r in rows:
        print(f"{r['corpus_mb']:>9.1f} {r['disk_mb']:>8.1f} {r['docs']:>9,} {r['tokens']:>13,} "
              f"{r['workers']:>7} "
              f"{r['tokenizer_batched_mb_s']:>11.2f} {r['tokenizer_one_call_mb_s']:>10.2f} "
              f"{r['tokenizer_mb_s']:>14.2f} {r['preprocess_mb_s']:>15.2f} {r['ratio']:>6.2f} "
              f"{_fmt(r['peak_rss_mb'], '>11.0f')} {_fmt(r['rss_growth_mb'], '>13.0f')} "
              f"{_fmt(r['worker_peak_rss_mb'], '>14.0f')}")
    print("MB/s of document text (UTF-8); tok-alone = the faster of encode_batch batched / in one call; "
          "ratio = preprocess / tok-alone (target >= 0.8)")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        mode, rest = sys.argv[2], sys.argv[3:]
        if mode == "tokenizer":
            out = child_tokenizer(Path(rest[0]), rest[1], float(rest[2]))
        else:
            out = child_preprocess(Path(rest[0]), rest[1], int(rest[2]), Path(rest[3]))
        print(json.dumps(out))
        return
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes-mb", type=float, nargs="+", default=[20, 80], help="corpus sizes")
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="worker counts to run")
    p.add_argument("--tokenizer", default=None, help="a load_tokenizer spec (default: train a BPE)")
    p.add_argument("--vocab-size", type=int, default=8192, help="vocabulary of the trained BPE")
    p.add_argument("--rounds", type=int, default=1, help="repeat and take median times")
    p.add_argument("--compress", choices=("none", "zst"), default="none",
                   help="write the corpus as .jsonl (default) or .jsonl.zst shards")
    p.add_argument("--shard-mb", type=float, default=_SHARD_BYTES / 1e6,
                   help="uncompressed MB per shard (default 16)")
    p.add_argument("--baseline-mb", type=float, default=0,
                   help="time the tokenizer alone on the first N MB only (0: all; it holds them "
                        "in memory, so use ~200 for GB-sized corpora)")
    p.add_argument("--workdir", default=None, help="where corpora and outputs go (default: temp)")
    p.add_argument("--keep", action="store_true", help="keep the temporary directory")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    args = p.parse_args()
    rows = run(args)
    print_table(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


if __name__ == "__main__":
    main()
