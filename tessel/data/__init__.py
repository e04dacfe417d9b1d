"""Tokenizers, preprocessing to indexed binary datasets, blends and the stateful loader.

Users preprocess files (`preprocess`) or records in memory, a `datasets.Dataset` or any
iterable of dicts/strings (`preprocess_records`, `cached_records`). The trainer talks to
this package through `build_data` (train/val loaders with
`next_batch`, `state_dict`, `load_state_dict`, and the data's tokenizer).
"""

from tessel.data.loader import Batch, Loader
from tessel.data.preprocess import PreprocessSummary, preprocess
from tessel.data.records import cached_records, preprocess_records
from tessel.data.sources import Data, build_data
from tessel.data.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer, train_bpe

__all__ = [
    "Batch", "Data", "Loader", "PreprocessSummary", "Tokenizer", "build_data", "byte_tokenizer",
    "cached_records", "load_tokenizer", "preprocess", "preprocess_records", "train_bpe",
]
