"""Supervised fine-tuning data: conversations -> token ids, a loss mask, packed samples.

Records (JSONL, optionally compressed) are one of:

- chat, OpenAI shape: `{"messages": [{"role": "user", "content": "..."}, ...]}` (content may
  also be a list of `{"type": "text", "text": ...}` parts);
- chat, ShareGPT shape: `{"conversations": [{"from": "human", "value": "..."}, ...]}` (roles
  human/gpt/system, or user/assistant);
- prompt/completion: `{"prompt": "...", "completion": "..."}`, read as a user message and an
  assistant reply.

Each conversation is rendered with the chat template (`tessel.data.chat_template`) and
tokenized as transformers tokenizes `apply_chat_template`'s text (special tokens in the
template are parsed; nothing is added around it: templates write their own BOS). Only the
assistant turns are learned: each one's characters are found by rendering prefixes
(messages[:i], then messages[:i+1]; the difference is exactly what
the model must produce for turn i, its end-of-turn token included, trailing whitespace not),
less the turn's header (the content starts where the same turn rendered with two different
replies parts). This works for any template that renders a conversation prefix by
prefix, with or without a generation prompt; a token counts when it overlaps such a span. A
long conversation finds the same spans from two renderings (`_marked_spans`), checked against
the prefixes of its first turns, so its cost grows with its length, not the square of its
turns. The first token of an example is never learned: it is predicted from the previous
example of the packed sample.

Examples are packed first-fit, in order, into samples of seq_len + 1 tokens; each example is
its own document (the document mask keeps attention inside it) and the padding after the last
one is one more document whose targets are all masked.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import numpy as np

from tessel.data.chat_template import ChatTemplate
from tessel.errors import DataError

ROLES = ("system", "user", "assistant", "tool")
"""The roles a message may have (after ShareGPT's names are mapped)."""
_SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system", "user": "user",
                   "assistant": "assistant", "tool": "tool", "function": "tool"}
_OPEN_BINS = 64
"""Packing looks for room in at most this many most recent samples (first-fit stays linear
in the number of examples; packing efficiency barely changes beyond a few dozen)."""


# ---- records -> messages ------------------------------------------------------------------


def _text(value: Any, where: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, list):  # OpenAI content parts
        parts = [p.get("text") for p in value if isinstance(p, dict) and p.get("type") == "text"]
        if all(isinstance(p, str) for p in parts) and parts:
            return "".join(parts)  # type: ignore[arg-type]
    raise DataError(f"{where}: a message's content is a {type(value).__name__}, not text")


def to_messages(obj: dict[str, Any], where: str) -> list[dict[str, str]]:
    """The conversation of one record as [{"role", "content"}]; DataError naming `where`
    (file:line) for a record of no known shape, an unknown role, or no assistant turn."""
    if "messages" in obj or "conversations" in obj:
        sharegpt = "messages" not in obj
        raw = obj["conversations"] if sharegpt else obj["messages"]
        if not isinstance(raw, list) or not raw:
            raise DataError(f"{where}: {'conversations' if sharegpt else 'messages'} must be a "
                            "non-empty list of messages")
        messages = []
        for m in raw:
            if not isinstance(m, dict):
                raise DataError(f"{where}: a message is a {type(m).__name__}, not an object")
            role = m.get("from") if sharegpt else m.get("role")
            role = _SHAREGPT_ROLES.get(role, role) if sharegpt else role  # type: ignore[arg-type]
            if role not in ROLES:
                raise DataError(f"{where}: unknown role {role!r}; roles are {', '.join(ROLES)}"
                                + (" (ShareGPT: human, gpt, system)" if sharegpt else ""))
            content = m.get("value") if sharegpt else m.get("content")
            messages.append({"role": role, "content": _text(content, where)})
    elif "prompt" in obj and "completion" in obj:
        prompt, completion = obj["prompt"], obj["completion"]
        if not isinstance(prompt, str) or not isinstance(completion, str):
            raise DataError(f"{where}: prompt and completion must be strings")
        messages = [{"role": "user", "content": prompt},
                    {"role": "assistant", "content": completion}]
    else:
        keys = ", ".join(map(repr, list(obj)[:8])) or "none"
        raise DataError(f"{where}: not a fine-tuning record (keys: {keys}); expected "
                        "'messages', 'conversations', or 'prompt' and 'completion'")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: the conversation has no assistant turn, so nothing to learn")
    return messages


# ---- messages -> text and assistant spans -------------------------------------------------


EXACT_MESSAGES = 16
"""Conversations up to this many messages find their replies by rendering prefixes (below);
a longer one renders twice in all (`_marked_spans`), checked against the prefixes of its
first messages, so its cost grows with its length, not with the square of its turns."""
_MARK = re.compile("\ue000([0-9]+)\ue001")  # a message's place, in private-use characters


def assistant_spans(template: ChatTemplate, messages: list[dict[str, str]],
                    where: str = "") -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the [start, end) character spans of its assistant
    turns (see the module docstring)."""
    head = max((k for k in range(1, min(len(messages), EXACT_MESSAGES) + 1)
                if messages[k - 1]["role"] == "assistant"), default=0)
    if len(messages) > EXACT_MESSAGES and head:
        marked = _marked_spans(template, messages)
        # the same answer as the prefixes on the first turns, or the template is not one
        # this shortcut reads right: then the prefixes, every one
        if marked is not None and _marked_spans(template, messages[:head]) == \
                _prefix_spans(template, messages[:head], where):
            return marked
    return _prefix_spans(template, messages, where)


def _prefix_spans(template: ChatTemplate, messages: list[dict[str, str]],
                  where: str) -> tuple[str, list[tuple[int, int]]]:
    rendered: dict[int, str] = {}  # prefix length -> text: each prefix rendered once

    def prefix(k: int) -> str:
        if k not in rendered:
            rendered[k] = template.render(messages[:k])
        return rendered[k]

    full = prefix(len(messages))
    spans = []
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        try:
            before = prefix(i)
        except DataError:
            if i:
                raise
            before = ""  # templates that index messages[0] cannot render no messages
        after = prefix(i + 1)
        if not (full.startswith(after) and after.startswith(before)):
            raise DataError(
                f"{where}{': ' if where else ''}the chat template ({template.origin}) does not "
                f"render this conversation prefix by prefix (message {i}), so its assistant "
                "turns cannot be found; use another data.chat_template")
        start = min(max(_content_start(template, messages, i, after), len(before)), len(after))
        end = start + len(after[start:].rstrip())
        if end > start:  # a template may write nothing for a turn: nothing to learn there
            spans.append((start, end))
    return full, spans


def _marked_spans(template: ChatTemplate, messages: list[dict[str, str]]
                  ) -> tuple[str, list[tuple[int, int]]] | None:
    """The spans `_prefix_spans` finds, from two renderings: the conversation, and the same
    with each message's content replaced by a mark of its place. When the template writes
    every content once, in order, unchanged or trimmed (the conversation is the marked
    rendering with the contents put back), a reply starts where its mark was and its turn ends with
    the text after the last reply (its end-of-turn marker), which must follow every reply.
    None when that does not hold (the template changes or tests the contents, or the
    conversation does not end with a reply)."""
    if messages[-1]["role"] != "assistant":
        return None
    try:
        marked = template.render([{**m, "content": f"\ue000{j}\ue001"}
                                  for j, m in enumerate(messages)])
    except DataError:  # a template that tests the contents: the prefixes will say
        return None
    parts = _MARK.split(marked)
    between = parts[0::2]  # the template's own text before, between and after the contents
    if parts[1::2] != [str(j) for j in range(len(messages))] or \
            any("\ue000" in t or "\ue001" in t for t in between):
        return None
    full = template.render(messages)
    tail = between[-1]
    pos, spans = 0, []
    for j, m in enumerate(messages):
        if not full.startswith(between[j], pos):
            return None
        pos += len(between[j])
        # what the template wrote for the content: itself, or trimmed (Llama 3's `| trim`)
        written = next((c for c in (m["content"], m["content"].strip())
                        if full.startswith(c + between[j + 1], pos)), None)
        if written is None:
            return None
        start, pos = pos, pos + len(written)
        if m["role"] != "assistant":
            continue
        if not between[j + 1].startswith(tail):
            return None
        end = start + len(full[start:pos + len(tail)].rstrip())
        if end > start:
            spans.append((start, end))
    return (full, spans) if pos + len(tail) == len(full) else None


_PROBES = ("x", "y")
"""Two replies that differ in their first character (and are left alone by templates that
trim or test the content): the turn renders the same up to where its content starts."""


def _content_start(template: ChatTemplate, messages: list[dict[str, str]], i: int,
                   after: str) -> int:
    """Where the content of assistant turn i starts in `after` (messages[:i+1] rendered):
    the end of the turn's header ("<|im_start|>assistant\n"), which is where the same turn
    rendered with two different replies parts. The empty reply would not do: its rendering
    goes on with the end-of-turn marker, so a reply starting with that marker's first
    character ("<think>" before "<|im_end|>") would lose its first token, and an empty
    reply its end-of-turn token. Never past where the real turn parts from them (a header
    that depends on the content)."""
    try:
        probes = [template.render([*messages[:i], {**messages[i], "content": p}])
                  for p in _PROBES]
    except DataError:  # a template that refuses the probes: the generation prompt says it
        head = template.render(messages[:i], add_generation_prompt=True)
        return len(head) if after.startswith(head) else 0
    return len(os.path.commonprefix([*probes, after]))


@dataclass
class Example:
    """One conversation's token ids and which of them are learned."""

    ids: np.ndarray  # (n,) int64
    learned: np.ndarray  # (n,) bool


def chat_encoder(tokenizer: Any) -> Any:
    """A copy of a tessel `Tokenizer`'s Hugging Face tokenizer that encodes rendered chats as
    transformers does: the special tokens a template writes are parsed as such (tessel's
    own `encode` keeps them text, for pretraining documents); use it with
    add_special_tokens=False (templates write their own BOS)."""
    from tokenizers import Tokenizer as HFTokenizer

    hf = HFTokenizer.from_str(tokenizer.hf.to_str())
    hf.encode_special_tokens = False
    return hf


def encode_example(text: str, spans: list[tuple[int, int]], hf_tokenizer: Any) -> Example:
    """Token ids of `text` (special tokens parsed, nothing added) and the learned flag of
    each (see `learned_example`)."""
    return learned_example(hf_tokenizer.encode(text, add_special_tokens=False), spans)


def learned_example(encoding: Any, spans: list[tuple[int, int]]) -> Example:
    """An encoded conversation's ids and the learned flag of each token: it overlaps one of
    `spans` (a token that straddles a turn's start, " 4" after "A:", carries the reply's
    first character, so it is learned)."""
    ids = np.asarray(encoding.ids, dtype=np.int64)
    offsets = np.asarray(encoding.offsets, dtype=np.int64).reshape(-1, 2)
    starts, ends = offsets[:, 0], np.maximum(offsets[:, 1], offsets[:, 0] + 1)
    learned = np.zeros(len(ids), dtype=bool)
    for s, e in spans:
        learned |= (starts < e) & (ends > s)
    if len(learned):
        learned[0] = False  # predicted from the previous example: never learned
    return Example(ids, learned)


# ---- packing ------------------------------------------------------------------------------


@dataclass
class PackStats:
    """What packing did, for the start-up line and the metrics."""

    examples: int = 0
    truncated: int = 0
    dropped: int = 0
    """All dropped examples; why, in the three counts below (what the error says when none is
    left depends on it)."""
    dropped_unlearned: int = 0
    """Nothing to learn at all (the template writes nothing of the replies)."""
    dropped_long: int = 0
    """Longer than a sample, with data.sft_overlong = "drop"."""
    dropped_cut: int = 0
    """Truncated to a sample with nothing learned left in it (the prompt fills the sample)."""
    samples: int = 0
    tokens: int = 0
    """Non-padding tokens in the samples."""
    learned: int = 0
    """Learned target positions."""
    capacity: int = 0
    """Token slots in the samples (samples x (seq_len + 1))."""
    targets: int = 0
    """Target positions in the samples (samples x seq_len)."""

    @property
    def efficiency(self) -> float:
        """Fraction of token slots holding a real token (not padding)."""
        return self.tokens / self.capacity if self.capacity else 0.0

    @property
    def learned_fraction(self) -> float:
        """Fraction of target positions that count in the loss."""
        return self.learned / self.targets if self.targets else 0.0


@dataclass
class Packed:
    """Samples of seq_len + 1 tokens: ids, learned flags, document index per position."""

    tokens: np.ndarray  # (N, L) int32/int64
    learned: np.ndarray  # (N, L) uint8
    docs: np.ndarray  # (N, L) int32

    def arrays(self) -> dict[str, np.ndarray]:
        return {"tokens": self.tokens, "learned": self.learned, "docs": self.docs}


def fit(examples: list[Example], length: int, overlong: str,
        stats: PackStats) -> list[Example]:
    """Examples cut to `length` tokens ("truncate") or left out ("drop") when longer; an
    example with nothing to learn (after truncation, or at all: a template that writes
    nothing for its replies) is dropped, so every sample has a learned target. Counts into
    `stats`."""
    kept = []
    for ex in examples:
        stats.examples += 1
        if not ex.learned.any():
            stats.dropped += 1
            stats.dropped_unlearned += 1
            continue
        if len(ex.ids) > length:
            if overlong == "drop":
                stats.dropped += 1
                stats.dropped_long += 1
                continue
            ex = Example(ex.ids[:length], ex.learned[:length])
            if not ex.learned.any():
                stats.dropped += 1
                stats.dropped_cut += 1
                continue
            stats.truncated += 1
        kept.append(ex)
    return kept


def pack(examples: list[Example], length: int, pad_id: int, packed: bool,
         stats: PackStats) -> Packed:
    """`examples` (each at most `length` tokens) into samples of `length` tokens: first-fit
    among the most recent samples when `packed`, else one example per sample."""
    bins: list[list[int]] = []
    room: list[int] = []
    for k, ex in enumerate(examples):
        n = len(ex.ids)
        target = -1
        if packed:
            for b in range(max(0, len(bins) - _OPEN_BINS), len(bins)):
                if room[b] >= n:
                    target = b
                    break
        if target < 0:
            bins.append([])
            room.append(length)
            target = len(bins) - 1
        bins[target].append(k)
        room[target] -= n
    dtype = np.int32 if pad_id < 2**31 else np.int64
    tokens = np.full((len(bins), length), pad_id, dtype=dtype)
    learned = np.zeros((len(bins), length), dtype=np.uint8)
    docs = np.zeros((len(bins), length), dtype=np.int32)
    for b, members in enumerate(bins):
        pos = 0
        for d, k in enumerate(members):
            ex = examples[k]
            n = len(ex.ids)
            tokens[b, pos:pos + n] = ex.ids
            learned[b, pos:pos + n] = ex.learned
            docs[b, pos:pos + n] = d
            pos += n
        docs[b, pos:] = len(members)  # the padding is a document of its own
        stats.tokens += pos
    stats.samples += len(bins)
    stats.capacity += len(bins) * length
    stats.targets += len(bins) * (length - 1)
    stats.learned += int(learned[:, 1:].sum())
    return Packed(tokens, learned, docs)


# ---- the dataset the loader reads ---------------------------------------------------------


class SFTDataset:
    """Packed fine-tuning samples, read by `tessel.data.loader.Loader` as it reads a
    `TokenDataset` (n_samples, sample, doc_ids), plus `loss_mask`."""

    def __init__(self, packed: Packed, seq_len: int, name: str, fingerprint: str):
        if packed.tokens.shape[1:] != (seq_len + 1,):
            raise DataError(f"{name}: samples of {packed.tokens.shape[1:]} tokens, not "
                            f"train.seq_len + 1 = {seq_len + 1}")
        self.packed = packed
        self.seq_len = seq_len
        self.name = name
        self.fingerprint = fingerprint
        self.n_samples = int(packed.tokens.shape[0])

    def sample(self, i: int) -> np.ndarray:
        """Tokens of sample i: (seq_len + 1,) int64."""
        return np.asarray(self.packed.tokens[i], dtype=np.int64)

    def doc_ids(self, i: int) -> np.ndarray:
        """Document index of each input position of sample i: (seq_len,) int64."""
        return np.asarray(self.packed.docs[i, : self.seq_len], dtype=np.int64)

    def loss_mask(self, i: int) -> np.ndarray:
        """Whether each target of sample i counts in the loss: (seq_len,) bool."""
        return np.asarray(self.packed.learned[i, 1:], dtype=bool)

    def learned_targets(self) -> np.ndarray:
        """The learned target ids of every sample, flattened (the unigram baseline)."""
        return np.asarray(self.packed.tokens[:, 1:][self.packed.learned[:, 1:] != 0])

    def require(self, n: int, what: str) -> None:
        if self.n_samples < n:
            raise DataError(
                f"{self.name} has {self.n_samples} packed samples of {self.seq_len + 1} tokens, "
                f"fewer than {what} ({n}); add records, lower train.seq_len or "
                "train.micro_batch_size, or change data.split")
