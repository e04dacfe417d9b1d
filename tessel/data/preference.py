"""Preference data (train.objective = "dpo"): records -> prompt, chosen and rejected token ids,
as TRL's DPOTrainer (trl 1.16) makes them, then pairs of rows the model reads in one batch.

Records are the forms TRL reads:

- `{"prompt", "chosen", "rejected"}` as text (three strings), or as conversations (three
  lists of messages: the prompt's turns, then each reply's);
- `{"chosen", "rejected"}` with an implicit prompt: the longest shared beginning (messages
  for conversations, characters for text, less a space before the split) is the prompt, as
  TRL's `extract_prompt` finds it. A record whose prompt is text while its replies are
  conversations (or the reverse) is read the same way, as TRL's `maybe_extract_prompt`.

Tokens, as TRL's `tokenize_fn`: a conversation renders `prompt` with the generation prompt,
and `prompt + chosen`, `prompt + rejected` without, each tokenized with the template's special
tokens parsed and nothing added; text appends the end-of-sequence token to each reply that
lacks it and tokenizes `prompt`, `prompt + chosen`, `prompt + rejected` as the tokenizer does
(with its own special tokens). The reply starts where the three part (the common prefix), so
a template that renders the prompt differently alone costs the prompt's tail, never the
replies'. Each row is `prompt + reply` cut to its first train.seq_len + 1 tokens (TRL's
max_length, truncation_mode "keep_start"); its reply's tokens are the learned ones.

What TRL trains on but tessel leaves out, each counted in the start-up line: pairs whose
chosen equals rejected (no preference to learn), pairs with an empty reply, and pairs whose
prompt fills the sequence (TRL drops these too). No pair left is one error.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from tessel.data.chat_template import ChatTemplate
from tessel.data.sft import to_messages
from tessel.errors import DataError


@dataclass
class PreferenceRecord:
    """One record's prompt and replies: text (str) or conversations (lists of messages)."""

    prompt: Any
    chosen: Any
    rejected: Any
    chat: bool


def _is_chat(value: Any) -> bool:
    return isinstance(value, list) and bool(value) and isinstance(value[0], dict)


def extract_prompt(chosen: Any, rejected: Any) -> tuple[Any, Any, Any]:
    """TRL's `extract_prompt`: (prompt, chosen, rejected) with the prompt the longest shared
    beginning of the two, less a space before the split (text)."""
    idx = 0
    for idx in range(min(len(chosen), len(rejected))):
        if chosen[idx] != rejected[idx]:
            if chosen[idx - 1] == " ":  # remove space before the prompt
                idx -= 1
            break
    return chosen[:idx], chosen[idx:], rejected[idx:]


def to_record(obj: dict[str, Any], where: str) -> PreferenceRecord:
    """The preference record `obj` (file:line `where`); DataError for one of no known shape,
    of mixed text and conversations, or with a malformed message."""
    if "chosen" not in obj or "rejected" not in obj:
        keys = ", ".join(map(repr, list(obj)[:8])) or "none"
        raise DataError(f"{where}: not a preference record (keys: {keys}); expected 'chosen' "
                        "and 'rejected', and 'prompt' unless it is their shared beginning")
    chosen, rejected = obj["chosen"], obj["rejected"]
    chat = _is_chat(chosen)
    if chat != _is_chat(rejected) or not (chat or isinstance(chosen, str)) or \
            not (_is_chat(rejected) or isinstance(rejected, str)):
        raise DataError(f"{where}: chosen and rejected must both be text or both be lists of "
                        "messages")
    prompt = obj.get("prompt")
    if prompt is None or _is_chat(prompt) != chat or \
            (not chat and not isinstance(prompt, str)):
        prompt, chosen, rejected = extract_prompt(chosen, rejected)
    if chat:
        prompt = _messages(prompt, where, "prompt")
        chosen = _messages(chosen, where, "chosen")
        rejected = _messages(rejected, where, "rejected")
    return PreferenceRecord(prompt, chosen, rejected, chat)


def _messages(value: Any, where: str, what: str) -> list[dict[str, str]]:
    """Messages checked as fine-tuning checks them (roles, text content)."""
    if not isinstance(value, list):
        raise DataError(f"{where}: {what} must be a list of messages")
    if not value:
        return []
    return to_messages({"messages": value + [{"role": "assistant", "content": ""}]},
                       f"{where} ({what})")[:-1]


def _empty(reply: Any) -> bool:
    if isinstance(reply, str):
        return not reply.strip()
    return not reply or all(not m["content"].strip() for m in reply)


@dataclass
class PairCounts:
    """What reading the pairs did, for the start-up line and the metrics."""

    records: int = 0
    pairs: int = 0
    identical: int = 0
    """Chosen equals rejected: left out (TRL keeps them; they teach no preference)."""
    empty: int = 0
    """A reply with no text: left out (TRL would learn its end-of-turn token alone)."""
    long_prompt: int = 0
    """The prompt fills train.seq_len + 1 tokens: left out (as TRL drops them)."""
    truncated: int = 0
    """Rows cut to train.seq_len + 1 tokens (TRL's keep_start)."""

    def dropped(self) -> int:
        return self.identical + self.empty + self.long_prompt

    def note(self) -> str:
        """The counted notes, or ""."""
        parts = [f"{n:,} {what}" for n, what in (
            (self.identical, "with chosen equal to rejected"),
            (self.empty, "with an empty reply"),
            (self.long_prompt, "with a prompt filling the sequence")) if n]
        return f"; left out: {', '.join(parts)}" if parts else ""


def common_prefix(a: list[int], b: list[int]) -> int:
    """Leading ids `a` and `b` share (TRL's common_prefix_length)."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def encode_record(rec: PreferenceRecord, template: ChatTemplate | None, hf: Any, eos: str
                  ) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of `rec` as TRL's tokenize_fn (module
    docstring); `hf`: a tokenizers.Tokenizer with the special tokens parsed."""
    if rec.chat:
        assert template is not None
        texts = [template.render(rec.prompt, add_generation_prompt=True),
                 template.render(rec.prompt + rec.chosen), template.render(rec.prompt + rec.rejected)]
        ids = [e.ids for e in hf.encode_batch(texts, add_special_tokens=False)]
    else:
        chosen = rec.chosen if rec.chosen.endswith(eos) else rec.chosen + eos
        rejected = rec.rejected if rec.rejected.endswith(eos) else rec.rejected + eos
        texts = [rec.prompt, rec.prompt + chosen, rec.prompt + rejected]
        ids = [e.ids for e in hf.encode_batch(texts, add_special_tokens=True)]
    prompt, with_chosen, with_rejected = ids
    n = min(common_prefix(prompt, with_chosen), common_prefix(prompt, with_rejected))
    return prompt[:n], with_chosen[n:], with_rejected[n:]


@dataclass
class Pairs:
    """Pairs as rows of `length` tokens: tokens (N, 2, L) and learned (N, 2, L), [:, 0] the
    chosen row, [:, 1] the rejected one; padding (`pad_id`) is never learned."""

    tokens: np.ndarray
    learned: np.ndarray

    def arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "learned": self.learned}


def build_pairs(encoded: list[tuple[list[int], list[int], list[int]]], length: int,
                pad_id: int, counts: PairCounts) -> Pairs:
    """Rows of at most `length` tokens (keep_start); pairs whose prompt fills them are
    counted in `counts.long_prompt` and left out."""
    kept = []
    for prompt, chosen, rejected in encoded:
        if len(prompt) >= length:
            counts.long_prompt += 1
            continue
        counts.truncated += sum(len(prompt) + len(r) > length for r in (chosen, rejected))
        kept.append((prompt, chosen, rejected))
    dtype = np.int32 if pad_id < 2**31 else np.int64
    tokens = np.full((len(kept), 2, length), pad_id, dtype=dtype)
    learned = np.zeros((len(kept), 2, length), dtype=np.uint8)
    for i, (prompt, chosen, rejected) in enumerate(kept):
        for j, reply in enumerate((chosen, rejected)):
            row = (prompt + reply)[:length]
            tokens[i, j, :len(row)] = row
            learned[i, j, len(prompt):len(row)] = 1
    counts.pairs += len(kept)
    return Pairs(tokens, learned)


def drop_reason(rec: PreferenceRecord) -> str | None:
    """Why `rec` is left out ("identical", "empty"), or None."""
    if rec.chosen == rec.rejected:
        return "identical"
    if _empty(rec.chosen) or _empty(rec.rejected):
        return "empty"
    return None


def texts_of(rec: PreferenceRecord, template: ChatTemplate | None) -> list[str]:
    """The texts a tokenizer trained for the data (data.tokenizer = "auto") learns from."""
    if not rec.chat:
        return [rec.prompt + rec.chosen, rec.rejected]
    assert template is not None
    return [template.render(rec.prompt + rec.chosen), template.render(rec.prompt + rec.rejected)]


class PreferenceDataset:
    """Preference pairs the pair loader reads: `pair(i)` is its two rows and their learned
    flags; `ref` (N, 2) the reference model's log-probabilities, once computed."""

    def __init__(self, pairs: Pairs, name: str, fingerprint: str):
        self.pairs = pairs
        self.name = name
        self.fingerprint = fingerprint
        self.n_samples = int(pairs.tokens.shape[0])
        self.length = int(pairs.tokens.shape[2])
        self.ref: np.ndarray | None = None

    def pair(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """Tokens (2, L) int64 and learned flags (2, L) bool of pair i."""
        return (np.asarray(self.pairs.tokens[i], dtype=np.int64),
                np.asarray(self.pairs.learned[i], dtype=bool))

    def require(self, n: int, what: str) -> None:
        if self.n_samples < n:
            raise DataError(
                f"{self.name} has {self.n_samples} preference pairs, fewer than {what} ({n}); "
                "add records, lower train.micro_batch_size, or change data.split")


__all__ = ["PairCounts", "Pairs", "PreferenceDataset", "PreferenceRecord", "build_pairs",
           "common_prefix", "encode_record", "extract_prompt", "to_record"]


def read_pairs(files: list[Any], template: ChatTemplate | None, hf: Any, eos: str, length: int,
               read: Any = None) -> tuple[Pairs, PairCounts]:
    """Every preference record of the JSONL `files` as pairs of rows of `length` tokens,
    with the counts of what was left out (module docstring); DataError (exit 2) for a
    malformed record, naming its file:line, and when no pair is left."""
    from tessel.data.readers import iter_json_records

    counts, encoded = PairCounts(), []
    for where, obj in iter_json_records(files, read):
        counts.records += 1
        rec = to_record(obj, where)
        reason = drop_reason(rec)
        if reason is not None:
            setattr(counts, reason, getattr(counts, reason) + 1)  # identical, empty
            continue
        encoded.append(encode_record(rec, template, hf, eos))
    pairs = build_pairs(encoded, length, hf.token_to_id(eos) or 0, counts)
    if not counts.pairs:
        raise DataError(f"no preference pair is left of the {counts.records:,} records"
                        f"{counts.note().replace('; left out:', ' (left out:')}"
                        f"{')' if counts.dropped() else ''}; fix the records or raise "
                        "train.seq_len")
    return pairs, counts
