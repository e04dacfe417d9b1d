"""Tokenizers, all through the Hugging Face `tokenizers` library (no hand-written BPE).

Kinds, named by a spec string:

- `bytes`: byte-level, no training, always available: ids 0-255 are the UTF-8 bytes
  themselves, 256 is the end-of-document token.
- a path to a Hugging Face `tokenizer.json` (what `tessel tokenizer train` writes).
- `gpt2-files:VOCAB.json,MERGES.txt`: a GPT-2 style byte-level BPE from its two files.

`train_bpe` trains a byte-level BPE on text. Every tokenizer serialises to one
`tokenizer.json`, saved with each dataset and run, and has a fingerprint (a hash of that
JSON) so data made with one tokenizer is never read with another.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tessel.errors import TesselError

EOD_TOKEN = "<|endoftext|>"
# End-of-text tokens of the tokenizers people bring (GPT-2, Llama 3, Llama 2 / Mistral, ...):
# the first one present ends documents, so imported weights see the token they know.
EOD_ALTERNATIVES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>")


class TokenizerError(TesselError):
    """Unusable tokenizer; one line for the user."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable-character table, the alphabet of every byte-level
    BPE (the `tokenizers` ByteLevel pre-tokenizer uses the same mapping)."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars = printable[:]
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(printable, (chr(c) for c in chars)))


def _byte_level(tok: HFTokenizer) -> HFTokenizer:
    # No prefix space and no offset trimming: decode(encode(text)) == text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


class Tokenizer:
    """A `tokenizers.Tokenizer` plus the id that ends a document."""

    def __init__(self, tok: HFTokenizer, kind: str):
        self.hf = tok
        self.kind = kind
        # Text that happens to spell a special token ("<|endoftext|>" in a document about
        # tokenizers) stays text: only the pipeline inserts real end-of-document ids.
        tok.encode_special_tokens = True
        eod = next((i for i in map(tok.token_to_id, EOD_ALTERNATIVES) if i is not None), None)
        if eod is None:  # a tokenizer.json with no end-of-text token of any known name
            tok.add_special_tokens([EOD_TOKEN])
            eod = tok.token_to_id(EOD_TOKEN)
        self.eod_id: int = eod
        self.vocab_size: int = tok.get_vocab_size(with_added_tokens=True)

    @property
    def name(self) -> str:
        return self.kind

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many documents at once (the library parallelises this itself)."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode([i for i in ids if i != self.eod_id], skip_special_tokens=False)

    def to_json(self) -> str:
        return self.hf.to_str()

    def fingerprint(self) -> str:
        """sha256 of the canonical tokenizer JSON: equal fingerprints, equal tokenization."""
        canonical = json.dumps(json.loads(self.to_json()), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str, kind: str = "json") -> Tokenizer:
        return cls(HFTokenizer.from_str(text), kind)


def byte_tokenizer() -> Tokenizer:
    """Byte-level with no merges: id = byte value, 256 = end of document."""
    vocab = {ch: b for b, ch in _bytes_to_unicode().items()}
    tok = _byte_level(HFTokenizer(models.BPE(vocab=vocab, merges=[])))
    tok.add_special_tokens([EOD_TOKEN])
    return Tokenizer(tok, "bytes")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) on an iterator of documents."""
    if vocab_size < 257 + 1:
        raise TokenizerError(f"vocab size {vocab_size} is too small; a byte-level BPE needs > 257")
    tok = _byte_level(HFTokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_nonempty(texts), trainer=trainer)
    return Tokenizer(tok, "bpe")


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    return (t for t in texts if t)


def load_tokenizer(spec: str | Path) -> Tokenizer:
    """`bytes`, a tokenizer.json path, or `gpt2-files:vocab.json,merges.txt`."""
    spec = str(spec)
    if spec == "bytes":
        return byte_tokenizer()
    if spec.startswith("gpt2-files:"):
        parts = spec.removeprefix("gpt2-files:").split(",")
        if len(parts) != 2:
            raise TokenizerError(
                f"tokenizer {spec!r} must be gpt2-files:VOCAB.json,MERGES.txt"
            )
        vocab, merges = (Path(p) for p in parts)
        for f in (vocab, merges):
            if not f.is_file():
                raise TokenizerError(f"tokenizer file {str(f)!r} does not exist")
        try:
            model = models.BPE.from_file(str(vocab), str(merges))
        except Exception as exc:  # the library raises plain Exceptions for bad files
            raise TokenizerError(f"cannot read GPT-2 tokenizer files {parts}: {exc}") from None
        return Tokenizer(_byte_level(HFTokenizer(model)), "gpt2-files")
    path = Path(spec)
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer {spec!r} is neither 'bytes', 'gpt2-files:VOCAB,MERGES' nor an "
            "existing tokenizer.json"
        )
    try:
        return Tokenizer(HFTokenizer.from_file(str(path)), "json")
    except Exception as exc:
        raise TokenizerError(f"cannot read tokenizer {spec!r}: {exc}") from None
