"""Fixed-length samples cut from one split of a packed token stream.

A split is a contiguous range of whole documents (Megatron style), so its tokens are one
contiguous slice of the `.bin` file and a sample never needs more than one read. Sample i
covers tokens [i*seq_len, i*seq_len + seq_len + 1): inputs are the first seq_len, targets the
last seq_len.
"""

from __future__ import annotations

import numpy as np

from tessel.errors import DataError


def split_ranges(n_docs: int, fractions: tuple[float, ...]) -> list[tuple[int, int]]:
    """Document ranges [start, end) for each split fraction; deterministic, covering all
    documents; a non-zero fraction of a corpus with enough documents gets at least one."""
    bounds = [0]
    acc = 0.0
    for f in fractions:
        acc += f
        bounds.append(min(n_docs, int(round(acc * n_docs))))
    bounds[-1] = n_docs
    # Give every requested non-empty split at least one document when there are enough.
    for i in range(1, len(bounds) - 1):
        if fractions[i] > 0 and bounds[i + 1] == bounds[i] and bounds[i] > bounds[i - 1] + 1:
            bounds[i] -= 1
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


class TokenDataset:
    """Samples of `seq_len + 1` tokens from documents [doc_start, doc_end) of a corpus.

    tokens: the whole corpus (a read-only memmap is fine); doc_offsets: int64[n_docs + 1].
    """

    def __init__(
        self,
        tokens: np.ndarray,
        doc_offsets: np.ndarray,
        seq_len: int,
        doc_range: tuple[int, int] | None = None,
        name: str = "dataset",
        fingerprint: str | None = None,
    ):
        """`fingerprint`: what identifies the corpus's content (IndexedDataset.fingerprint),
        recorded by the loader's state so that a resume on other data is refused."""
        first, last = doc_range if doc_range is not None else (0, len(doc_offsets) - 1)
        lo, hi = int(doc_offsets[first]), int(doc_offsets[last])
        self.name = name
        self.fingerprint = fingerprint
        self.tokens = tokens[lo:hi]
        # document starts relative to this split, for the document-boundary mask
        self.doc_starts = np.asarray(doc_offsets[first:last], dtype=np.int64) - lo
        self.seq_len = seq_len
        self.n_tokens = hi - lo
        self.n_docs = last - first
        self.n_samples = (self.n_tokens - 1) // seq_len if self.n_tokens > seq_len else 0

    def sample(self, i: int) -> np.ndarray:
        """Tokens of sample i: (seq_len + 1,) int64."""
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], dtype=np.int64)

    def doc_ids(self, i: int) -> np.ndarray:
        """Document index of each input position of sample i: (seq_len,) int64. Equal ids
        may attend to each other; the model turns this into a block-diagonal causal mask."""
        pos = i * self.seq_len + np.arange(self.seq_len)
        return np.searchsorted(self.doc_starts, pos, side="right").astype(np.int64) - 1

    def require(self, n: int, what: str) -> None:
        if self.n_samples < n:
            raise DataError(
                f"{self.name} has {self.n_tokens} tokens in {self.n_docs} documents, fewer than "
                f"{what} ({n} samples of {self.seq_len + 1} tokens); add data, lower "
                "train.seq_len or train.micro_batch_size, or change data.split"
            )
