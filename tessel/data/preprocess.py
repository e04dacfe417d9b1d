"""Raw text -> indexed dataset (`PREFIX.bin/.idx/.tokenizer.json`), streaming.

Documents are read in batches (`iter_documents`), tokenized, and appended to an
`IndexedWriter`; at no point does the corpus, or its tokens, sit in memory.

- `workers=1`: batches are tokenized in this process with `Tokenizer.encode_batch`, which
  the `tokenizers` library already spreads over every core (Rust threads), on a helper
  thread so that reading and writing overlap with it.
- `workers=N>1`: batches go to N single-threaded worker processes (each rebuilds the
  tokenizer from its JSON once), at most 2N batches in flight, results taken in submission
  order. Documents are tokenized independently, so the output is byte-identical whatever the
  worker count or batch size.

A failure (a bad JSONL line, Ctrl-C) aborts the writer: temporary files are removed and an
existing dataset at the prefix is left as it was.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from itertools import chain
from multiprocessing.pool import AsyncResult, Pool
from pathlib import Path
from typing import Any

import numpy as np

from tessel.data.indexed import IndexedWriter, dataset_paths, dtype_for_vocab, normalize_prefix
from tessel.data.readers import InputPath, ReadStats, iter_documents, resolve_inputs
from tessel.data.tokenizer import Tokenizer, load_tokenizer
from tessel.errors import DataError, TesselError

DEFAULT_BATCH_SIZE = 1024
"""Documents per batch: enough for the tokenizer's threads to share out evenly."""
_BATCH_CHARS = {"in_process": 2 << 20, "pool": 1 << 20}
"""A batch also ends at this many characters. The tokenizer's per-token bookkeeping makes a
batch's transient memory tens of times its text, so this, not the corpus, sets the peak.
Workers get smaller batches: each is one task, and the pool needs many tasks in flight to
keep every worker busy; in-process batches are shared out by the tokenizer's own threads."""
_STOP_GRACE_S = 10.0  # a failed run's pool: how long its workers get to finish what was sent


@dataclass
class PreprocessSummary:
    """What `preprocess` did."""

    output_prefix: Path
    files: int
    documents: int
    tokens: int
    input_bytes: int
    """Uncompressed bytes read (JSON syntax included for JSONL inputs)."""
    empty_skipped: int
    invalid_utf8: int
    """Documents in which bytes that are not UTF-8 were replaced."""
    seconds: float
    workers: int

    @property
    def docs_per_s(self) -> float:
        return self.documents / self.seconds if self.seconds > 0 else 0.0

    @property
    def mb_per_s(self) -> float:
        return self.input_bytes / 1e6 / self.seconds if self.seconds > 0 else 0.0

    def line(self) -> str:
        """One line for the console."""
        source = f"{self.files:,} files" if self.files else "records in memory"
        return (f"preprocessed {self.documents:,} documents ({self.input_bytes / 1e6:,.1f} MB in "
                f"{source}) into {self.tokens:,} tokens in {self.seconds:.1f} s "
                f"({self.docs_per_s:,.0f} docs/s, {self.mb_per_s:,.2f} MB/s, {self.workers} "
                f"worker{'s' if self.workers > 1 else ''}); skipped {self.empty_skipped:,} empty, "
                f"replaced invalid UTF-8 in {self.invalid_utf8:,} -> {self.output_prefix}.bin/.idx")


class _Encoder:
    """Texts -> (ids concatenated in the dataset dtype, one length per text)."""

    def __init__(self, tokenizer: Tokenizer, append_eod: bool):
        self.tokenizer = tokenizer
        self.dtype = dtype_for_vocab(tokenizer.vocab_size)
        # Once per document: not when the tokenizer's own template already ends it with eod.
        ends_with_eod = tokenizer.suffix_ids[-1:] == [tokenizer.eod_id]
        self.eod = tokenizer.eod_id if append_eod and not ends_with_eod else None

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.tokenizer.encode_batch(texts)
        if self.eod is not None:
            for doc in ids:
                doc.append(self.eod)
        lengths = np.fromiter(map(len, ids), dtype=np.int64, count=len(ids))
        # numpy arrays, not lists of ints, cross the process boundary: pickling is a memcpy.
        flat = np.fromiter(chain.from_iterable(ids), dtype=self.dtype, count=int(lengths.sum()))
        return flat, lengths


_worker_encoder: _Encoder | None = None  # one per worker process, set by _init_worker


def _init_worker(tokenizer_json: str, eod_token: str, append_eod: bool) -> None:
    global _worker_encoder
    # Ctrl-C reaches the whole process group; the parent handles it (terminating the pool and
    # deleting partial output), so workers must not each print a KeyboardInterrupt traceback.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    _worker_encoder = _Encoder(Tokenizer.from_json(tokenizer_json, "json", eod_token), append_eod)


def _encode_in_worker(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _worker_encoder is not None, "worker not initialised"
    return _worker_encoder(texts)


def _batches(docs: Iterable[str], batch_size: int, max_chars: int) -> Iterator[list[str]]:
    batch: list[str] = []
    chars = 0
    for doc in docs:
        batch.append(doc)
        chars += len(doc)
        if len(batch) >= batch_size or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


@contextmanager
def _pool(workers: int, tokenizer: Tokenizer, append_eod: bool) -> Iterator[Pool]:
    """A pool of single-threaded tokenizer processes."""
    # fork on Linux: workers inherit the loaded modules instead of re-importing tessel (and
    # torch) each; elsewhere the platform default (spawn), as fork is unsafe on macOS.
    ctx = mp.get_context("fork" if sys.platform.startswith("linux") else None)
    # Set while the workers start, so they inherit it: each worker then encodes on one thread
    # (N workers already use N cores), and `tokenizers` does not warn about forking after its
    # thread pool was used in this process.
    saved = os.environ.get("TOKENIZERS_PARALLELISM")
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    try:
        pool = ctx.Pool(workers, _init_worker,
                        (tokenizer.to_json(), tokenizer.eod_token, append_eod))
    finally:
        if saved is None:
            del os.environ["TOKENIZERS_PARALLELISM"]
        else:
            os.environ["TOKENIZERS_PARALLELISM"] = saved
    try:
        yield pool
    except BaseException:
        # Pool.terminate() right away can hang for good: its task thread may be writing a
        # batch into the pipe to the workers it has just killed, and CPython's
        # _terminate_pool joins that thread (seen in the test suite after a refused input).
        # So the workers first take and finish what was sent (at most 2 x workers batches:
        # _encoded's window), for up to _STOP_GRACE_S, and are then stopped.
        pool.close()
        joiner = threading.Thread(target=pool.join, daemon=True)
        joiner.start()
        joiner.join(_STOP_GRACE_S)
        raise
    finally:
        pool.terminate()


def _encoded(batches: Iterator[list[str]], tokenizer: Tokenizer, append_eod: bool,
             pool: Pool | None, workers: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Encoded batches, in input order: in this process, or on `pool`'s `workers`."""
    if pool is None:
        yield from _encoded_in_thread(batches, _Encoder(tokenizer, append_eod))
        return
    # Not Pool.imap: its feeder thread drains the input iterator as fast as it can (memory
    # grows with the corpus when reading outpaces tokenizing) and a reader error would be
    # raised in that thread. Here the reading stays in this thread, at most 2N batches ahead.
    pending: deque[AsyncResult[Any]] = deque()
    for batch in batches:
        pending.append(pool.apply_async(_encode_in_worker, (batch,)))
        if len(pending) >= 2 * workers:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _encoded_in_thread(batches: Iterator[list[str]], encode: _Encoder,
                       ahead: int = 1) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """`map(encode, batches)`, with the encoding on a helper thread: `encode_batch` releases
    the GIL, so this thread reads batch k+1 (and the caller writes batch k-1) while the
    tokenizer's threads work on batch k. (Two batches encoding at once measured no better.)"""
    executor = ThreadPoolExecutor(ahead, thread_name_prefix="tessel-encode")
    try:
        pending: deque[Future[tuple[np.ndarray, np.ndarray]]] = deque()
        for batch in batches:
            pending.append(executor.submit(encode, batch))
            if len(pending) > ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        executor.shutdown(wait=True, cancel_futures=True)


def _progress_enabled(progress: bool) -> bool:
    ci = os.environ.get("CI", "").strip().lower() in ("1", "true", "yes")
    return progress and not ci and sys.stderr.isatty()


class _Progress:
    """A live line on stderr: documents, MB, docs/s, MB/s (rich; a no-op when disabled)."""

    def __init__(self, enabled: bool):
        self.bar: Any = None
        if enabled:
            from rich.console import Console
            from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

            self.bar = Progress(SpinnerColumn(), TextColumn("{task.description}"),
                                TimeElapsedColumn(), console=Console(stderr=True), transient=True)
            self.task = self.bar.add_task("starting")

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()

    def update(self, stats: ReadStats, tokens: int, seconds: float) -> None:
        if self.bar is None:
            return
        s = max(seconds, 1e-9)
        self.bar.update(self.task, description=(
            f"{stats.documents:,} docs  {stats.bytes_read / 1e6:,.1f} MB  {tokens:,} tokens  "
            f"{stats.documents / s:,.0f} docs/s  {stats.bytes_read / 1e6 / s:,.2f} MB/s"))


def _check_output(inputs: InputPath | Sequence[InputPath], prefix: Path, force: bool) -> None:
    """Never overwrite an input (`--input X.bin --output X` turned the input into token
    ids), nor an existing dataset unless asked to."""
    sources = {p.resolve() for p in resolve_inputs(inputs)}
    for out in dataset_paths(prefix):
        if out.resolve() in sources:
            raise DataError(f"--output {str(prefix)!r} would overwrite the input {str(out)!r}; "
                            "choose another output prefix")
    check_output_free(prefix, force)


def check_output_free(prefix: Path, force: bool) -> None:
    """Refuse to replace an existing dataset at `prefix` unless `force`."""
    existing = [str(p) for p in dataset_paths(prefix) if p.exists()]
    if existing and not force:
        raise DataError(f"{existing[0]!r} already exists; choose another output prefix, or pass "
                        "--force (preprocess(..., force=True)) to replace that dataset")


def preprocess(
    inputs: InputPath | Sequence[InputPath],
    tokenizer: Tokenizer | str,
    output_prefix: str | os.PathLike[str],
    json_key: str = "text",
    workers: int = 1,
    append_eod: bool = False,
    batch_size: int = DEFAULT_BATCH_SIZE,
    progress: bool = True,
    force: bool = False,
    fmt: str = "tessel",
) -> PreprocessSummary:
    """Tokenize every document of `inputs` into the indexed dataset `output_prefix`.

    `inputs` are files, directories or glob patterns (see `tessel.data.readers`); `tokenizer`
    a `Tokenizer` or a spec for `load_tokenizer`. `append_eod` ends each document with the
    tokenizer's end-of-document id. `progress` shows a live line on stderr (never under
    CI=true or when stderr is not a terminal); nothing else is printed: the caller prints
    `summary.line()` if it wants to. Bad input raises `DataError` (`TesselError`) and leaves
    no new files at the prefix. An existing dataset at the prefix is replaced only with
    `force`; an output that is one of the inputs is refused always. `fmt="megatron"` writes
    a Megatron-LM index (Megatron-core's IndexedDataset reads the dataset) instead of tessel's.
    """
    check_settings(workers, batch_size)
    tok = load_tokenizer(tokenizer) if isinstance(tokenizer, str) else tokenizer
    prefix = normalize_prefix(output_prefix)
    _check_output(inputs, prefix, force)
    stats = ReadStats()
    docs = iter_documents(inputs, json_key, stats)  # resolves inputs now: errors before writing
    return encode_documents(docs, stats, tok, prefix, workers=workers, append_eod=append_eod,
                            batch_size=batch_size, progress=progress, fmt=fmt)


def check_settings(workers: int, batch_size: int) -> None:
    if workers < 1:
        raise TesselError(f"workers must be >= 1, got {workers}")
    if batch_size < 1:
        raise TesselError(f"batch_size must be >= 1, got {batch_size}")


def encode_documents(docs: Iterator[str], stats: ReadStats, tok: Tokenizer, prefix: Path, *,
                     workers: int = 1, append_eod: bool = False,
                     batch_size: int = DEFAULT_BATCH_SIZE, progress: bool = True,
                     fmt: str = "tessel") -> PreprocessSummary:
    """Tokenize `docs` (whose reader fills `stats`) into the dataset `prefix`: the part of
    `preprocess` after reading, shared with in-memory records (`tessel.data.records`)."""
    start = time.perf_counter()
    batches = _batches(docs, batch_size, _BATCH_CHARS["in_process" if workers == 1 else "pool"])
    with ExitStack() as stack:  # on failure, in reverse: bar cleared, files deleted, pool stopped
        # The pool first: forking before the writer's files and the bar's thread exist.
        pool = stack.enter_context(_pool(workers, tok, append_eod)) if workers > 1 else None
        writer = stack.enter_context(IndexedWriter(prefix, tok, fmt))
        bar = stack.enter_context(_Progress(_progress_enabled(progress)))
        for flat, lengths in _encoded(batches, tok, append_eod, pool, workers):
            writer.add_documents(flat, lengths)
            bar.update(stats, writer.n_tokens, time.perf_counter() - start)
        if writer.n_docs == 0:
            raise DataError(f"inputs hold no documents ({stats.files} files, "
                            f"{stats.empty_skipped} empty documents); nothing to preprocess")
    return PreprocessSummary(prefix, stats.files, writer.n_docs, writer.n_tokens, stats.bytes_read,
                             stats.empty_skipped, stats.invalid_utf8, time.perf_counter() - start,
                             workers)

