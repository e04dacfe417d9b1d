"""The on-disk tokenized dataset: `PREFIX.bin` + `PREFIX.idx` + `PREFIX.tokenizer.json`.

- `PREFIX.bin`: every document's token ids back to back, little-endian `uint16` when the
  vocabulary has at most 65,536 ids, else `uint32`. Memory-mapped when read.
- `PREFIX.idx`: an 80-byte header, then the document offsets, then their checksum:

  ```
  offset size  field
  0      8     magic b"TESSELIX"
  8      4     format version (u32, 1)
  12     4     dtype code (u32: 1 = uint16, 2 = uint32)
  16     8     n_docs (u64)
  24     8     n_tokens (u64)
  32     8     vocab_size (u64)
  40     32    tokenizer fingerprint (raw sha256 of the canonical tokenizer JSON)
  72     4     crc32 of PREFIX.bin (checked by `IndexedDataset.verify`, not on open)
  76     4     crc32 of bytes 0-75
  80     8*(n_docs+1)  document offsets (i64, in tokens: first 0, last n_tokens)
  ...    4     crc32 of the offsets' bytes
  ```
- `PREFIX.tokenizer.json`: the tokenizer the data was made with (its fingerprint must match
  the header's), so the data is never read with another.

`IndexedWriter` writes all three under temporary names and publishes them with `os.replace`,
the `.idx` last, after removing any older `.idx`: at every instant the prefix is either a
complete, consistent dataset or has no `.idx` (and is refused). `IndexedDataset` checks
everything that is cheap to check on open (sizes, checksums of the index, monotonic offsets,
the tokenizer) and refuses the data with a one-line `DataError` saying what is wrong.
"""

from __future__ import annotations

import os
import secrets
import struct
import zlib
from pathlib import Path
from types import TracebackType
from typing import IO

import numpy as np

from tessel.data import megatron
from tessel.data.tokenizer import Tokenizer
from tessel.errors import DataError
from tessel.fileio import fsync_dir

MAGIC = b"TESSELIX"
VERSION = 1
_FIELDS = struct.Struct("<8sIIQQQ32sI")  # everything the header checksum covers
_CRC = struct.Struct("<I")
HEADER_SIZE = _FIELDS.size + _CRC.size  # 80: keeps the int64 offsets 8-byte aligned
_DTYPES = {1: np.dtype("<u2"), 2: np.dtype("<u4")}
_CODES = {dt: code for code, dt in _DTYPES.items()}
_OFFSET_DTYPE = np.dtype("<i8")
_CHUNK_TOKENS = 1 << 22  # verify() reads .bin in 8-16 MB pieces: flat memory

FIX = "re-run tessel preprocess to rebuild it"


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The smallest token dtype that holds every id of a `vocab_size` vocabulary."""
    return _DTYPES[1] if vocab_size <= 1 << 16 else _DTYPES[2]


def normalize_prefix(prefix: str | os.PathLike[str]) -> Path:
    """`data/web`, `data/web.bin` and `data/web.idx` all name the dataset `data/web`."""
    text = os.fspath(prefix)
    for suffix in (".bin", ".idx"):
        if text.endswith(suffix):
            return Path(text[: -len(suffix)])
    return Path(text)


def dataset_paths(prefix: str | os.PathLike[str]) -> tuple[Path, Path, Path]:
    """(PREFIX.bin, PREFIX.idx, PREFIX.tokenizer.json)."""
    base = os.fspath(normalize_prefix(prefix))
    return Path(base + ".bin"), Path(base + ".idx"), Path(base + ".tokenizer.json")


class IndexedWriter:
    """Streams documents into a new dataset at `prefix`; nothing is visible until `finalize`.

    ```
    with IndexedWriter("data/web", tok) as w:
        for text in docs:
            w.add_document(tok.encode(text))
    ```
    Leaving the `with` block normally finalizes; leaving it by an exception (or calling
    `abort`) deletes the temporary files and leaves whatever was at `prefix` untouched.
    Memory stays flat: tokens and offsets go straight to (buffered) temporary files.
    """

    def __init__(self, prefix: str | os.PathLike[str], tokenizer: Tokenizer,
                 fmt: str = "tessel"):
        """`fmt`: `tessel`, or `megatron` for a Megatron-LM index (and Megatron's choice of
        token dtype) beside the same kind of token file, which Megatron-core reads."""
        self.prefix = normalize_prefix(prefix)
        self.tokenizer = tokenizer
        self.vocab_size = tokenizer.vocab_size
        if fmt not in ("tessel", "megatron"):
            raise ValueError(f"unknown dataset format {fmt!r}")
        self.fmt = fmt
        self.dtype = (megatron.dtype_for_vocab(self.vocab_size) if fmt == "megatron"
                      else dtype_for_vocab(self.vocab_size))
        self.n_docs = 0
        self.n_tokens = 0
        self._bin_crc = 0
        self._done = False
        if self.prefix.is_dir() or not self.prefix.name:
            raise DataError(f"output prefix {str(prefix)!r} is a directory; name the dataset, "
                            f"e.g. {os.path.join(prefix, 'data')!r}")
        self._made_dirs = _make_parents(self.prefix.parent)
        self._bin, self._bin_tmp = _open_temp(self.prefix, ".bin")
        try:
            self._idx, self._idx_tmp = _open_temp(self.prefix, ".idx")
        except BaseException:
            self._bin.close()
            self._bin_tmp.unlink(missing_ok=True)
            raise
        self._idx.write(bytes(HEADER_SIZE))  # placeholder; the real header is written last
        first = np.zeros(1, _OFFSET_DTYPE).tobytes()
        self._idx.write(first)
        self._off_crc = zlib.crc32(first)

    def add_document(self, ids: list[int] | np.ndarray) -> None:
        """Append one document's token ids."""
        arr = np.asarray(ids)
        if arr.ndim != 1:
            raise DataError(f"a document must be a 1-D sequence of token ids, got shape {arr.shape}")
        self.add_documents(arr, np.array([arr.size], dtype=np.int64))

    def add_documents(self, flat: np.ndarray, lengths: np.ndarray) -> None:
        """Append several documents at once: their ids concatenated, and each one's length."""
        if self._done:
            raise RuntimeError("IndexedWriter is already finalized or aborted")
        lengths = np.asarray(lengths, dtype=np.int64)
        if int(lengths.sum()) != flat.size or (lengths < 0).any():
            raise ValueError("lengths must be >= 0 and sum to the number of ids")
        if flat.size and (int(flat.min()) < 0 or int(flat.max()) >= self.vocab_size):
            bad = int(flat.max()) if int(flat.max()) >= self.vocab_size else int(flat.min())
            raise DataError(f"token id {bad} is outside the tokenizer's vocabulary of "
                            f"{self.vocab_size}; the tokenizer is inconsistent")
        data = flat.astype(self.dtype, copy=False).tobytes()
        self._bin.write(data)
        self._bin_crc = zlib.crc32(data, self._bin_crc)
        offsets = (self.n_tokens + np.cumsum(lengths)).astype(_OFFSET_DTYPE).tobytes()
        self._idx.write(offsets)
        self._off_crc = zlib.crc32(offsets, self._off_crc)
        self.n_docs += lengths.size
        self.n_tokens += flat.size

    def finalize(self) -> Path:
        """Write the header, flush and fsync everything, publish; returns the prefix."""
        if self._done:
            raise RuntimeError("IndexedWriter is already finalized or aborted")
        self._done = True
        tok_tmp: Path | None = None
        try:
            if self.fmt == "megatron":
                self._write_megatron_index()
            else:
                self._write_tessel_header()
            for f in (self._bin, self._idx):
                f.flush()
                os.fsync(f.fileno())
                f.close()
            tok_file, tok_tmp = _open_temp(self.prefix, ".tokenizer.json")
            with tok_file:
                tok_file.write(self.tokenizer.to_json().encode("utf-8"))
                tok_file.flush()
                os.fsync(tok_file.fileno())
            self._publish(tok_tmp)
        except BaseException:
            self._cleanup(tok_tmp)
            raise
        return self.prefix

    def _write_tessel_header(self) -> None:
        self._idx.write(_CRC.pack(self._off_crc))
        fingerprint = bytes.fromhex(self.tokenizer.fingerprint())
        fields = _FIELDS.pack(MAGIC, VERSION, _CODES[self.dtype], self.n_docs, self.n_tokens,
                              self.vocab_size, fingerprint, self._bin_crc)
        self._idx.seek(0)
        self._idx.write(fields + _CRC.pack(zlib.crc32(fields)))

    def _write_megatron_index(self) -> None:
        """The offsets streamed to the temporary index become Megatron's index (written in
        their place: lengths, byte pointers and document indices)."""
        self._idx.flush()
        offsets = np.fromfile(self._idx_tmp, dtype=_OFFSET_DTYPE, offset=HEADER_SIZE)
        self._idx.seek(0)
        self._idx.truncate()
        self._idx.write(megatron.index_bytes(self.dtype, np.diff(offsets)))

    def _publish(self, tok_tmp: Path) -> None:
        bin_path, idx_path, tok_path = dataset_paths(self.prefix)
        # An older .idx next to the new .bin could look valid: remove it first, so a crash
        # between the renames leaves a prefix with no .idx, which is refused.
        idx_path.unlink(missing_ok=True)
        fsync_dir(self.prefix.parent)
        os.replace(self._bin_tmp, bin_path)
        os.replace(tok_tmp, tok_path)
        fsync_dir(self.prefix.parent)
        os.replace(self._idx_tmp, idx_path)  # the commit point
        fsync_dir(self.prefix.parent)

    def abort(self) -> None:
        """Discard everything written; the prefix is left as it was."""
        if not self._done:
            self._done = True
            self._cleanup(None)

    def _cleanup(self, extra: Path | None) -> None:
        for f in (self._bin, self._idx):
            f.close()
        for path in (self._bin_tmp, self._idx_tmp, extra):
            if path is not None:
                path.unlink(missing_ok=True)
        for d in self._made_dirs:  # deepest first; only those this writer created, if empty
            try:
                d.rmdir()
            except OSError:
                break

    def __enter__(self) -> IndexedWriter:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            self.abort()
        elif not self._done:
            self.finalize()


def _make_parents(directory: Path) -> list[Path]:
    """mkdir -p; returns the directories it created, deepest first."""
    missing = []
    d = directory.absolute()
    while not d.exists():
        missing.append(d)
        d = d.parent
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _open_temp(prefix: Path, suffix: str) -> tuple[IO[bytes], Path]:
    """A new hidden file next to `prefix`, so os.replace onto the final name is an atomic
    rename within one filesystem. Created like any output file (0o666 less the umask),
    unlike tempfile.mkstemp's owner-only 0o600."""
    while True:
        path = prefix.parent / f".{prefix.name}{suffix}.{secrets.token_hex(4)}.tmp"
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
        except FileExistsError:
            continue
        return os.fdopen(fd, "wb", buffering=1 << 20), path


class IndexedDataset:
    """A dataset made by `IndexedWriter` (`tessel preprocess`), validated and memory-mapped.

    `tokens` is the read-only 1-D memmap of every id; document `i` is
    `tokens[doc_offsets[i]:doc_offsets[i + 1]]`. Opening raises a one-line `DataError` for
    missing files, a foreign or newer format, checksum mismatches in the index, a truncated
    `.bin`, offsets that are not monotonic, or a tokenizer file that is not the one the data
    was made with.
    """

    def __init__(self, prefix: str | os.PathLike[str], tokenizer: Tokenizer | None = None):
        """`tokenizer`: for a Megatron-LM dataset (which keeps none), the one it was made
        with; tessel's own datasets use theirs and ignore it."""
        self.prefix = normalize_prefix(prefix)
        self.bin_path, self.idx_path, self.tokenizer_path = dataset_paths(self.prefix)
        self.format = "tessel"
        for path, what in ((self.idx_path, "index"), (self.bin_path, "token")):
            if not path.is_file():
                raise self._error(f"the {what} file {str(path)!r} is missing; make the dataset "
                                  "with tessel preprocess")
        if megatron.is_megatron_index(self.idx_path):
            self._open_megatron(tokenizer)
            return
        if not self.tokenizer_path.is_file():
            raise self._error(f"the tokenizer file {str(self.tokenizer_path)!r} is missing; "
                              "make the dataset with tessel preprocess")
        with open(self.idx_path, "rb") as f:
            self._read_header(f.read(HEADER_SIZE))
            self.doc_offsets = self._read_offsets(f)
        self._check_offsets()
        self.tokens = self._map_tokens()
        self._tokenizer = self._load_tokenizer()

    def _open_megatron(self, tokenizer: Tokenizer | None) -> None:
        if tokenizer is None and self.tokenizer_path.is_file():
            tokenizer = self._load_tokenizer(check=False)  # written by --format megatron
        if tokenizer is None:
            raise megatron.refuse_without_tokenizer(self.prefix)
        try:
            self.dtype, self.doc_offsets = megatron.read_index(self.idx_path,
                                                               self.bin_path.stat().st_size)
        except ValueError as exc:
            raise self._error(f"{exc}; rebuild it (Megatron's preprocess_data.py, or tessel "
                              "preprocess --format megatron)") from None
        self.format = "megatron"
        self.n_docs = len(self.doc_offsets) - 1
        self.n_tokens = int(self.doc_offsets[-1])
        self.vocab_size = tokenizer.vocab_size
        self.tokenizer_fingerprint = tokenizer.fingerprint()
        self._bin_crc = None  # Megatron keeps no checksum; the index's stands for the content
        self._index_crc = zlib.crc32(self.idx_path.read_bytes())
        self.tokens = self._map_tokens()
        self._tokenizer = tokenizer

    def _error(self, what: str) -> DataError:
        return DataError(f"dataset {str(self.prefix)!r}: {what}")

    def _read_header(self, head: bytes) -> None:
        if len(head) < HEADER_SIZE:
            raise self._error(f"{self.idx_path.name} is truncated ({len(head)} bytes); {FIX}")
        magic, version, code, n_docs, n_tokens, vocab, fingerprint, bin_crc = \
            _FIELDS.unpack(head[: _FIELDS.size])
        if magic != MAGIC:
            raise self._error(f"{self.idx_path.name} is not a tessel index (bad magic {magic!r}); "
                              "make it with tessel preprocess")
        if version != VERSION:
            raise self._error(f"{self.idx_path.name} has format version {version}, this tessel "
                              f"reads version {VERSION}; use a matching tessel or {FIX}")
        (stored,) = _CRC.unpack(head[_FIELDS.size:])
        if zlib.crc32(head[: _FIELDS.size]) != stored:
            raise self._error(f"{self.idx_path.name} header checksum mismatch (corrupted); {FIX}")
        if code not in _DTYPES:
            raise self._error(f"{self.idx_path.name} has unknown dtype code {code}; {FIX}")
        self.dtype: np.dtype = _DTYPES[code]
        self.n_docs: int = n_docs
        self.n_tokens: int = n_tokens
        self.vocab_size: int = vocab
        self.tokenizer_fingerprint: str = fingerprint.hex()
        self._bin_crc: int | None = bin_crc

    def _read_offsets(self, f: IO[bytes]) -> np.ndarray:
        expected = HEADER_SIZE + _OFFSET_DTYPE.itemsize * (self.n_docs + 1) + _CRC.size
        actual = self.idx_path.stat().st_size
        if actual != expected:
            state = "truncated" if actual < expected else "longer than its header says"
            raise self._error(f"{self.idx_path.name} is {state} ({actual} bytes, expected "
                              f"{expected}); {FIX}")
        raw = f.read(_OFFSET_DTYPE.itemsize * (self.n_docs + 1))
        (stored,) = _CRC.unpack(f.read(_CRC.size))
        if zlib.crc32(raw) != stored:
            raise self._error(f"{self.idx_path.name} offsets checksum mismatch (corrupted); {FIX}")
        return np.frombuffer(raw, dtype=_OFFSET_DTYPE).astype(np.int64)

    def _check_offsets(self) -> None:
        off = self.doc_offsets
        if off[0] != 0 or off[-1] != self.n_tokens or (np.diff(off) < 0).any():
            raise self._error(f"{self.idx_path.name} document offsets are not monotonic from 0 "
                              f"to n_tokens={self.n_tokens}; {FIX}")
        expected = self.n_tokens * self.dtype.itemsize
        actual = self.bin_path.stat().st_size
        if actual != expected:
            state = "truncated" if actual < expected else "longer than its index says"
            raise self._error(f"{self.bin_path.name} is {state} ({actual} bytes, expected "
                              f"{self.n_tokens} tokens x {self.dtype.itemsize} = {expected}); {FIX}")

    def _map_tokens(self) -> np.ndarray:
        if self.n_tokens == 0:  # mmap cannot map an empty file
            empty = np.zeros(0, dtype=self.dtype)
            empty.setflags(write=False)
            return empty
        return np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))

    def _load_tokenizer(self, check: bool = True) -> Tokenizer:
        try:
            tok = Tokenizer.from_json(self.tokenizer_path.read_text(encoding="utf-8"))
        except Exception as exc:  # the tokenizers library raises plain Exceptions
            raise self._error(f"cannot read {self.tokenizer_path.name} ({exc}); {FIX}") from None
        if check and tok.fingerprint() != self.tokenizer_fingerprint:
            raise self._error(
                f"{self.tokenizer_path.name} (fingerprint {tok.fingerprint()[:12]}) is not the "
                f"tokenizer the data was made with ({self.tokenizer_fingerprint[:12]}); restore "
                f"it or {FIX}")
        return tok

    def __len__(self) -> int:
        return self.n_docs

    def __repr__(self) -> str:
        return (f"IndexedDataset({str(self.prefix)!r}, n_docs={self.n_docs}, "
                f"n_tokens={self.n_tokens}, dtype={self.dtype.name}, vocab_size={self.vocab_size})")

    @property
    def doc_lengths(self) -> np.ndarray:
        """Tokens per document (int64[n_docs])."""
        return np.diff(self.doc_offsets)

    def document(self, i: int) -> np.ndarray:
        """Document `i`'s token ids (a read-only view into the memmap)."""
        if not -self.n_docs <= i < self.n_docs:
            raise IndexError(f"document {i} out of range for {self.n_docs} documents")
        i %= self.n_docs
        return self.tokens[self.doc_offsets[i]: self.doc_offsets[i + 1]]

    def tokenizer(self) -> Tokenizer:
        """The tokenizer the data was made with (from PREFIX.tokenizer.json)."""
        return self._tokenizer

    @property
    def fingerprint(self) -> str:
        """What identifies this dataset's content (sizes and the checksum written with it):
        a checkpoint records it, so a resume on changed data is refused."""
        if self._bin_crc is None:  # Megatron: no checksum of the tokens; the index's
            return f"{self.n_docs}:{self.n_tokens}:megatron-index-{self._index_crc:08x}"
        return f"{self.n_docs}:{self.n_tokens}:{self._bin_crc:08x}"

    def verify(self) -> None:
        """Check `.bin`'s contents against the checksum in the header (Megatron datasets have
        none), and every id against the vocabulary (reads the whole file); `DataError` if
        either is wrong."""
        crc, top, low = 0, -1, 0
        for start in range(0, self.n_tokens, _CHUNK_TOKENS):
            chunk = self.tokens[start: start + _CHUNK_TOKENS]
            crc = zlib.crc32(chunk.tobytes(), crc)
            if len(chunk):
                top, low = max(top, int(chunk.max())), min(low, int(chunk.min()))
        if self._bin_crc is not None and crc != self._bin_crc:
            raise self._error(f"{self.bin_path.name} checksum mismatch (its contents are "
                              f"corrupted); {FIX}")
        self._check_ids(top, low)  # (negative ids: Megatron's signed dtypes only)

    def check_sampled_ids(self, samples: int = 64) -> None:
        """The cheap check for datasets too large to read whole at every start: the ids of
        `samples` evenly spread chunks of 64 Ki tokens must be inside the vocabulary."""
        width = 1 << 16
        starts = np.linspace(0, max(self.n_tokens - width, 0), num=samples, dtype=np.int64)
        chunks = [self.tokens[a: a + width] for a in np.unique(starts) if a < self.n_tokens]
        top = max((int(c.max()) for c in chunks), default=-1)
        low = min((int(c.min()) for c in chunks), default=0)
        self._check_ids(top, low)

    def _check_ids(self, top: int, low: int = 0) -> None:
        if low < 0:  # Megatron's signed dtypes
            raise self._error(f"{self.bin_path.name} holds token id {low} (negative: corrupted)")
        if top >= self.vocab_size:
            raise self._error(f"{self.bin_path.name} holds token id {top}, outside its "
                              f"{self.vocab_size}-token vocabulary (corrupted); {FIX}")
