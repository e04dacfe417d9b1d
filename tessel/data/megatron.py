"""Megatron-LM's indexed-dataset index (`PREFIX.idx`, magic `MMIDIDX`), read and written.

Megatron's `PREFIX.bin` is, like tessel's, every document's token ids back to back; only the
index differs. Its layout (megatron/core/datasets/indexed_dataset.py, `_IndexWriter`):

```
offset      size           field
0           9              magic b"MMIDIDX\\x00\\x00"
9           8              version (u64, 1)
17          1              dtype code (u8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                           6 float64, 7 float32, 8 uint16)
18          8              sequence count S (u64)
26          8              document-index count D (u64) = documents + 1
34          4*S            sequence lengths (i32, tokens)
34+4S       8*S            sequence pointers (i64, bytes into PREFIX.bin)
34+12S      8*D            document indices (i64: the first sequence of each document, then S)
[34+12S+8D  S              sequence modes (i8), multimodal datasets only]
```

A document may hold several sequences (sentence splitting); tessel reads a document as all
of its sequences. Megatron keeps no tokenizer beside the files, so the reader needs the one
the data was made with (`data.tokenizer`), and there is no checksum: `tessel` checks the
sizes, the pointers and the document indices on open, and the ids when `data.verify` reads
the token file.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from tessel.errors import DataError

MAGIC = b"MMIDIDX\x00\x00"
_HEAD = struct.Struct("<9sQBQQ")  # magic, version, dtype code, S, D: 34 bytes
_DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 8: np.uint16}
_CODES = {np.dtype(t): code for code, t in _DTYPES.items()}
_FLOAT_CODES = {6: "float64", 7: "float32"}


def is_megatron_index(idx_path: Path) -> bool:
    with open(idx_path, "rb") as f:
        return f.read(len(MAGIC)) == MAGIC


def dtype_for_vocab(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocess_data.py picks (DType.optimal_dtype)."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def read_index(idx_path: Path, bin_size: int) -> tuple[np.dtype, np.ndarray]:
    """(token dtype, document offsets in tokens: int64[n_docs + 1], from 0 to n_tokens) of a
    Megatron index whose token file has `bin_size` bytes. Raises ValueError saying what is
    inconsistent (the caller names the dataset)."""
    size = idx_path.stat().st_size
    with open(idx_path, "rb") as f:
        head = f.read(_HEAD.size)
        if len(head) < _HEAD.size:
            raise ValueError(f"{idx_path.name} is truncated ({len(head)} bytes)")
        magic, version, code, n_seq, n_idx = _HEAD.unpack(head)
        if magic != MAGIC:
            raise ValueError(f"{idx_path.name} is not a Megatron index (bad magic {magic!r})")
        if version != 1:
            raise ValueError(f"{idx_path.name} has Megatron index version {version}; tessel "
                             "reads version 1")
        if code in _FLOAT_CODES:
            raise ValueError(f"{idx_path.name} holds {_FLOAT_CODES[code]} values, not token ids")
        if code not in _DTYPES:
            raise ValueError(f"{idx_path.name} has unknown dtype code {code}")
        dtype = np.dtype(_DTYPES[code])
        plain = _HEAD.size + 12 * n_seq + 8 * n_idx
        if size == plain + n_seq and n_seq:
            raise ValueError(f"{idx_path.name} is a multimodal Megatron index (sequence modes); "
                             "tessel reads text datasets only")
        if size != plain:
            state = "truncated" if size < plain else "longer than its header says"
            raise ValueError(f"{idx_path.name} is {state} ({size} bytes, expected {plain} for "
                             f"{n_seq} sequences and {n_idx} document indices)")
        lengths = np.frombuffer(f.read(4 * n_seq), dtype="<i4").astype(np.int64)
        pointers = np.frombuffer(f.read(8 * n_seq), dtype="<i8")
        doc_index = np.frombuffer(f.read(8 * n_idx), dtype="<i8")
    if (lengths < 0).any():
        raise ValueError(f"{idx_path.name} has negative sequence lengths")
    starts = np.concatenate([[0], np.cumsum(lengths)])  # tokens
    if not np.array_equal(pointers, starts[:-1] * dtype.itemsize):
        raise ValueError(f"{idx_path.name}: the sequences are not stored back to back in the "
                         "token file (pointers disagree with the lengths)")
    if n_idx == 0 or doc_index[0] != 0 or doc_index[-1] != n_seq or (np.diff(doc_index) < 0).any():
        raise ValueError(f"{idx_path.name}: the document indices do not run from 0 to the "
                         f"{n_seq} sequences in order")
    if int(starts[-1]) * dtype.itemsize != bin_size:
        state = "truncated" if int(starts[-1]) * dtype.itemsize > bin_size else \
            "longer than its index says"
        raise ValueError(f"the token file is {state} ({bin_size} bytes, expected "
                         f"{int(starts[-1])} tokens x {dtype.itemsize})")
    return dtype, starts[doc_index]


def index_bytes(dtype: np.dtype, doc_lengths: np.ndarray) -> bytes:
    """The Megatron index of a token file holding documents of `doc_lengths` tokens (one
    sequence per document, as Megatron's preprocess_data.py writes without sentence
    splitting)."""
    dtype = np.dtype(dtype)
    if dtype not in _CODES:
        raise ValueError(f"Megatron indexes have no code for {dtype}")
    lengths = np.asarray(doc_lengths, dtype=np.int64)
    if lengths.size and int(lengths.max()) > np.iinfo(np.int32).max:
        raise ValueError("a document longer than 2^31 tokens does not fit Megatron's index")
    n = lengths.size
    pointers = np.concatenate([[0], np.cumsum(lengths)[:-1]]).astype("<i8") * dtype.itemsize
    doc_index = np.arange(n + 1, dtype="<i8")
    return b"".join([
        _HEAD.pack(MAGIC, 1, _CODES[dtype], n, n + 1),
        lengths.astype("<i4").tobytes(), pointers.astype("<i8").tobytes(), doc_index.tobytes(),
    ])


def refuse_without_tokenizer(prefix: Path) -> DataError:
    return DataError(f"dataset {str(prefix)!r} is a Megatron-LM dataset (MMIDIDX index), which "
                     "keeps no tokenizer beside its files; set data.tokenizer to the tokenizer "
                     "it was made with (a tokenizer.json, or gpt2-files:vocab.json,merges.txt)")
