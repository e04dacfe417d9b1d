"""OpenAI tiktoken encodings (`cl100k_base`, `o200k_base`, ...) from a local `.tiktoken` file,
as a Hugging Face `tokenizers` byte-level BPE that gives the same ids.

A `.tiktoken` file is one line per token, `BASE64(token bytes) RANK`, the rank being the id;
it holds no pre-tokenization pattern and no special tokens, so those come from the encoding's
name (the table below, copied from tiktoken's `tiktoken_ext/openai_public.py`). The file is
parsed as data (nothing in it is executed) and checked: every line well formed, ranks unique
and contiguous from 0, and all 256 single bytes present (a byte-level BPE needs them); a
damaged file is refused naming its line.

The conversion is the one `transformers` uses for Llama 3 and tiktoken-based models: vocab
= ranks (bytes mapped to GPT-2's printable alphabet), merges = every split of a token into
two known tokens ordered by the merged token's rank, and `ignore_merges`, because tiktoken
takes a whole pre-tokenized piece that is itself a token without merging.

Specs (`load_tokenizer`): `tiktoken:PATH` (the encoding named by the file's stem, e.g.
`cl100k_base.tiktoken`), `tiktoken:NAME=PATH` (any file name), `tiktoken:NAME` (the file
tiktoken itself cached: `$TIKTOKEN_CACHE_DIR`, `$DATA_GYM_CACHE_DIR` or
`$TMPDIR/data-gym-cache`, under the sha1 of the file's download address; never downloaded).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from tessel.data.byte_level import bytes_to_unicode
from tessel.errors import TokenizerError

_R50K = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_CL100K = (r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++"""
           r"""[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s""")
_O200K = "|".join([
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])
_URL = "https://openaipublic.blob.core.windows.net/encodings/{}.tiktoken"


@dataclass(frozen=True)
class Encoding:
    """What a `.tiktoken` file lacks: the pre-tokenization regex and the special tokens."""

    pattern: str
    specials: dict[str, int]


ENCODINGS: dict[str, Encoding] = {
    "r50k_base": Encoding(_R50K, {"<|endoftext|>": 50256}),
    "p50k_base": Encoding(_R50K, {"<|endoftext|>": 50256}),
    "cl100k_base": Encoding(_CL100K, {
        "<|endoftext|>": 100257, "<|fim_prefix|>": 100258, "<|fim_middle|>": 100259,
        "<|fim_suffix|>": 100260, "<|endofprompt|>": 100276}),
    "o200k_base": Encoding(_O200K, {"<|endoftext|>": 199999, "<|endofprompt|>": 200018}),
}


def _cached_file(name: str) -> Path:
    """Where tiktoken's own `load_tiktoken_bpe` caches the encoding's file."""
    cache = (os.environ.get("TIKTOKEN_CACHE_DIR") or os.environ.get("DATA_GYM_CACHE_DIR")
             or os.path.join(tempfile.gettempdir(), "data-gym-cache"))
    return Path(cache) / hashlib.sha1(_URL.format(name).encode()).hexdigest()


def resolve(spec: str) -> tuple[str, Path]:
    """(encoding name, file) for the part of a spec after `tiktoken:`."""
    known = ", ".join(ENCODINGS)
    if "=" in spec:
        name, _, raw = spec.partition("=")
        path = Path(raw)
    elif spec in ENCODINGS:
        name, path = spec, _cached_file(spec)
        if not path.is_file():
            raise TokenizerError(
                f"tokenizer 'tiktoken:{spec}': no cached {spec} file at {str(path)!r} (tessel "
                f"never downloads); give the file: tiktoken:{spec}=PATH/TO/{spec}.tiktoken")
    else:
        path = Path(spec)
        name = path.name.removesuffix(".tiktoken")
    if name not in ENCODINGS:
        raise TokenizerError(f"tokenizer 'tiktoken:{spec}': unknown encoding {name!r} (known: "
                            f"{known}); name it: tiktoken:NAME=PATH")
    if not path.is_file():
        raise TokenizerError(f"tokenizer file {str(path)!r} does not exist")
    return name, path


def read_ranks(path: Path) -> dict[bytes, int]:
    """The token -> rank table of a `.tiktoken` file, checked (see the module docstring)."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            parts = line.split()
            try:
                if len(parts) != 2:
                    raise ValueError
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
            except (ValueError, binascii.Error):
                raise TokenizerError(f"{path}:{n}: not a tiktoken line (BASE64 RANK); the file "
                                    "is damaged or not a .tiktoken file") from None
            if token in ranks or not token:
                raise TokenizerError(f"{path}:{n}: token {token!r} is empty or listed twice; "
                                    "the file is damaged")
            ranks[token] = rank
    _check_ranks(path, ranks)
    return ranks


def _check_ranks(path: Path, ranks: dict[bytes, int]) -> None:
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise TokenizerError(f"{path}: ranks are not 0..{len(ranks) - 1}, each once; the file is "
                            "damaged")
    missing = [b for b in range(256) if bytes([b]) not in ranks]
    if missing:
        raise TokenizerError(f"{path}: byte {missing[0]} has no token (a byte-level BPE needs all "
                            "256); the file is damaged")


def to_hf(ranks: dict[bytes, int], encoding: Encoding) -> HFTokenizer:
    """The `tokenizers` BPE equal to tiktoken's `Encoding(ranks, pattern, specials)`."""
    table = bytes_to_unicode()
    vocab = {"".join(table[b] for b in token): rank for token, rank in ranks.items()}
    merges: list[tuple[int, int, int, str, str]] = []
    for token, rank in vocab.items():
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in vocab and right in vocab:
                merges.append((rank, vocab[left], vocab[right], left, right))
    merges.sort()
    taken = set(ranks.values())
    clash = [t for t, i in encoding.specials.items() if i in taken]
    if clash:
        raise TokenizerError(f"special token {clash[0]} has id {encoding.specials[clash[0]]}, "
                            "which the file gives a regular token; this file is not that "
                            "encoding's (name the right one: tiktoken:NAME=PATH)")
    vocab.update(encoding.specials)
    tok = HFTokenizer(models.BPE(vocab=vocab, merges=[(m[3], m[4]) for m in merges],
                                 ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_onig(encoding.pattern)), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()
    # Already in the vocabulary at their own ids: registering them only makes them special.
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in encoding.specials])
    return tok


def _onig(pattern: str) -> str:
    """tiktoken's regex (Rust fancy-regex) in the dialect of `tokenizers` (Oniguruma, Ruby
    syntax), where `{1,3}+` is not possessive but "one or more runs of 1-3": "12345" would
    be one piece instead of "123", "45". A possessive `{1,3}` ending an alternative matches
    what a greedy one does, so the `+` is dropped."""
    return pattern.replace("{1,3}+", "{1,3}")


def load(spec: str) -> HFTokenizer:
    """`tiktoken:...` spec (without the prefix) -> a `tokenizers.Tokenizer`."""
    name, path = resolve(spec)
    return to_hf(read_ranks(path), ENCODINGS[name])
