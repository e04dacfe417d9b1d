"""Tokenizers, all through the Hugging Face `tokenizers` library (no hand-written BPE).

Kinds, named by a spec string:

- `bytes`: byte-level, no training, always available: ids 0-255 are the UTF-8 bytes
  themselves, 256 is the end-of-document token.
- a path to a Hugging Face `tokenizer.json` (what `tessel tokenizer train` writes).
- `gpt2-files:VOCAB.json,MERGES.txt`: a GPT-2 style byte-level BPE from its two files.
- `tiktoken:[NAME=]FILE` or `tiktoken:NAME`: an OpenAI tiktoken encoding (cl100k_base,
  o200k_base, ...) from a local `.tiktoken` file (`tessel.data.tiktoken_file`).

A tokenizer.json's post-processor applies to every document, as in `transformers`
(`AutoTokenizer(text)`): Llama 3's template adds BOS; GPT-2's adds nothing.

`train_bpe` trains a byte-level BPE on text. Every tokenizer serialises to one
`tokenizer.json`, saved with each dataset and run, and has a fingerprint (a hash of that
JSON) so data made with one tokenizer is never read with another.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from tessel.data.byte_level import bytes_to_unicode
from tessel.errors import TokenizerError

EOD_TOKEN = "<|endoftext|>"
# End-of-text tokens of the tokenizers people bring (GPT-2, Llama 3, Llama 2 / Mistral, ...):
# the first one present ends documents, so imported weights see the token they know.
EOD_ALTERNATIVES = (EOD_TOKEN, "<|end_of_text|>", "</s>", "<eos>", "<|im_end|>",
                    "<｜end▁of▁sentence｜>", "<|end|>", "<end_of_turn>")


def _byte_level(tok: HFTokenizer) -> HFTokenizer:
    # No prefix space and no offset trimming: decode(encode(text)) == text exactly.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    return tok


class Tokenizer:
    """A `tokenizers.Tokenizer`, the id that ends a document, and what its post-processor adds.

    Every document is encoded as `transformers`' `AutoTokenizer(text)` encodes it: the
    tokenizer.json's post-processor applies, so a Llama-3-style template puts its BOS token
    before each document (GPT-2's adds nothing). `eod_token` names the token that ends
    documents; by default the first of `EOD_ALTERNATIVES` present, and when there is none,
    `<|endoftext|>` is added (one id past the vocabulary).
    """

    def __init__(self, tok: HFTokenizer, kind: str, eod_token: str = "auto"):
        self.hf = tok
        self.kind = kind
        # Text that happens to spell a special token ("<|endoftext|>" in a document about
        # tokenizers) stays text: only the pipeline inserts real end-of-document ids.
        tok.encode_special_tokens = True
        # A tokenizer.json may carry truncation/padding settings (for a classifier's 512
        # tokens, say): a document must never be cut or padded silently.
        tok.no_truncation()
        tok.no_padding()
        # What is saved and fingerprinted: the tokenizer before an end-of-document token is
        # added below, which every load re-derives the same way (saving the added token
        # would make a dataset's tokenizer differ from the one that made it).
        self.source = tok.to_str()
        self.eod_token = eod_token
        if eod_token != "auto":
            eod = tok.token_to_id(eod_token)
            if eod is None:
                raise TokenizerError(
                    f"data.eod_token={eod_token!r} is not a token of this tokenizer; name one it "
                    "has (its EOS or pad token), or set \"auto\"")
        else:
            eod = next((i for i in map(tok.token_to_id, EOD_ALTERNATIVES) if i is not None), None)
        if eod is None:  # a tokenizer.json with no end-of-text token of any known name
            tok.add_special_tokens([EOD_TOKEN])
            eod = tok.token_to_id(EOD_TOKEN)
        self.eod_id: int = eod
        # max id + 1, not the token count: tiktoken encodings leave unused ids between their
        # regular and special tokens, and every id must fit the model's embedding.
        self.vocab_size: int = max(tok.get_vocab(with_added_tokens=True).values()) + 1
        self.prefix_ids, self.suffix_ids = _template(tok)

    @property
    def name(self) -> str:
        return self.kind

    def encode(self, text: str) -> list[int]:
        """One document's ids, with what the post-processor adds (BOS for Llama 3)."""
        return self.hf.encode(text, add_special_tokens=True).ids

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Encode many documents at once (the library parallelises this itself)."""
        return [e.ids for e in self.hf.encode_batch(texts, add_special_tokens=True)]

    def decode(self, ids: list[int]) -> str:
        """Text of `ids`, without the end-of-document and template (BOS) tokens."""
        drop = {self.eod_id, *self.prefix_ids, *self.suffix_ids}
        return self.hf.decode([i for i in ids if i not in drop], skip_special_tokens=False)

    def template(self) -> str:
        """What encoding adds around each document, in words (for `tessel data inspect`)."""
        name = lambda ids: " ".join(str(self.hf.id_to_token(i)) for i in ids)  # noqa: E731
        parts = [f"{name(self.prefix_ids)} before"] if self.prefix_ids else []
        parts += [f"{name(self.suffix_ids)} after"] if self.suffix_ids else []
        return ("adds " + " and ".join(parts) + " each document") if parts else "adds nothing"

    def with_eod(self, eod_token: str) -> Tokenizer:
        """This tokenizer with documents ended by `eod_token` (itself for "auto")."""
        if eod_token in ("auto", self.eod_token):
            return self
        return Tokenizer.from_json(self.to_json(), self.kind, eod_token)

    def to_json(self) -> str:
        """The tokenizer as saved with datasets and runs (see `source`)."""
        return self.source

    def hf_json(self) -> str:
        """The tokenizer with the end-of-document token it may have had added, for Hugging
        Face exports (their eos_token_id names it)."""
        return self.hf.to_str()

    def fingerprint(self) -> str:
        """sha256 of the canonical tokenizer JSON: equal fingerprints, equal tokenization."""
        canonical = json.dumps(json.loads(self.to_json()), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.to_json())

    @classmethod
    def from_json(cls, text: str, kind: str = "json", eod_token: str = "auto") -> Tokenizer:
        return cls(HFTokenizer.from_str(text), kind, eod_token)


def _template(tok: HFTokenizer) -> tuple[list[int], list[int]]:
    """The ids the post-processor puts before and after a document's own."""
    bare = tok.encode("a", add_special_tokens=False).ids
    full = tok.encode("a", add_special_tokens=True).ids
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    raise TokenizerError("the tokenizer's post-processor changes a document's own ids (not "
                         "only adding tokens around them); tessel cannot use it")


def byte_tokenizer() -> Tokenizer:
    """Byte-level with no merges: id = byte value, 256 = end of document."""
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    tok = _byte_level(HFTokenizer(models.BPE(vocab=vocab, merges=[])))
    tok.add_special_tokens([EOD_TOKEN])
    return Tokenizer(tok, "bytes")


def train_bpe(texts: Iterable[str], vocab_size: int, min_frequency: int = 2,
              special_tokens: tuple[str, ...] = (),
              waiting: Callable[[], None] | None = None) -> Tokenizer:
    """Train a byte-level BPE (GPT-2 style) on an iterator of documents; `special_tokens`
    (a chat template's markers, say) are added after the end-of-document token.

    The library trains in native code, where no signal handler runs: it trains in a thread of
    its own while this one waits, awake, so SIGTERM while preparing data and Ctrl-C stop the
    command at once rather than at the end of the training (the thread, abandoned, writes
    nothing and ends with the process). `waiting()` is called about every 0.2 s meanwhile
    (progress lines)."""
    if vocab_size < 257 + 1:
        raise TokenizerError(f"vocab size {vocab_size} is too small; a byte-level BPE needs > 257")
    tok = _byte_level(HFTokenizer(models.BPE()))
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=min_frequency,
        special_tokens=[EOD_TOKEN, *special_tokens],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    failed: list[BaseException] = []

    def train() -> None:
        try:
            tok.train_from_iterator(_nonempty(texts), trainer=trainer)
        except BaseException as exc:  # noqa: BLE001 (raised again in the caller's thread)
            failed.append(exc)

    thread = threading.Thread(target=train, name="tessel-bpe-training", daemon=True)
    thread.start()
    while thread.is_alive():
        thread.join(0.2)
        if waiting is not None:
            waiting()
    if failed:
        raise failed[0]
    return Tokenizer(tok, "bpe")


def _nonempty(texts: Iterable[str]) -> Iterator[str]:
    return (t for t in texts if t)


def load_tokenizer(spec: str | Path, eod_token: str = "auto") -> Tokenizer:
    """`bytes`, a tokenizer.json path, `gpt2-files:vocab.json,merges.txt` or `tiktoken:...`;
    documents end with `eod_token` (see `Tokenizer`)."""
    if str(spec) == "bytes":
        return byte_tokenizer().with_eod(eod_token)
    return Tokenizer(*_load(str(spec)), eod_token)


def _load(spec: str) -> tuple[HFTokenizer, str]:
    if spec.startswith("tiktoken:"):
        from tessel.data import tiktoken_file

        return tiktoken_file.load(spec.removeprefix("tiktoken:")), "tiktoken"
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
        return _byte_level(HFTokenizer(model)), "gpt2-files"
    path = Path(spec)
    if not path.is_file():
        raise TokenizerError(
            f"tokenizer {spec!r} is neither 'bytes', 'gpt2-files:VOCAB,MERGES', "
            "'tiktoken:[NAME=]FILE' nor an existing tokenizer.json"
        )
    try:
        hf = HFTokenizer.from_file(str(path))
    except Exception as exc:
        raise TokenizerError(f"cannot read tokenizer {spec!r}: {exc}") from None
    return hf, "json"
