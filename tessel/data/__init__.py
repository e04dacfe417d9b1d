"""Tokenizers, preprocessing to indexed binary datasets, blends and the stateful loader.

The trainer talks to this package through `build_data` (train/val loaders with
`next_batch`, `state_dict`, `load_state_dict`, and the data's tokenizer).
"""

from tessel.data.loader import Batch, Loader
from tessel.data.sources import Data, build_data
from tessel.data.tokenizer import Tokenizer, byte_tokenizer, load_tokenizer, train_bpe

__all__ = [
    "Batch", "Data", "Loader", "Tokenizer", "build_data", "byte_tokenizer", "load_tokenizer",
    "train_bpe",
]
