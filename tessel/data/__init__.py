"""Tokenizers, corpora and the stateful loader.

The trainer talks to this package through `build_data` (train/val loaders with
`next_batch`, `state_dict`, `load_state_dict`) and `build_tokenizer`; a richer pipeline
(indexed binary datasets, blends) plugs in behind the same seam.
"""

from tessel.data.loader import Data, Loader, build_data
from tessel.data.tokenizer import ByteTokenizer, Tokenizer, build_tokenizer, load_tokenizer

__all__ = ["ByteTokenizer", "Data", "Loader", "Tokenizer", "build_data", "build_tokenizer", "load_tokenizer"]
