"""Supervised fine-tuning data: chat templates rendered as transformers renders them, the
loss mask (exactly the assistant turns and their end token), packing, the cache, and the
loader's resumability over packed samples."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tessel.config import Config
from tessel.data import build_data
from tessel.data.chat_template import BUILTIN_TEMPLATES, ChatTemplate, resolve_template
from tessel.data.loader import Loader
from tessel.data.sft import (
    Example,
    PackStats,
    SFTDataset,
    assistant_spans,
    chat_encoder,
    encode_example,
    fit,
    pack,
    to_messages,
)
from tessel.data.tokenizer import train_bpe
from tessel.errors import DataError

# Meta-Llama-3-8B-Instruct's template, verbatim.
LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
    "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim "
    "+ '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)
# Qwen2.5-Instruct's template without its tool branches (whitespace control, a default system
# message, loop.first).
QWEN = "\n".join([
    "{%- if messages[0]['role'] == 'system' %}",
    "    {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}",
    "{%- else %}",
    "    {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful "
    "assistant.<|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- for message in messages %}",
    '    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or '
    '(message.role == "assistant") %}',
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
    "    {%- endif %}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}",
    "    {{- '<|im_start|>assistant\\n' }}",
    "{%- endif %}",
    "",
])
# A template with transformers' {% generation %} markers and an alternation check.
MARKED = (
    "{% for m in messages %}{% if not loop.first and loop.previtem['role'] == m['role'] %}"
    "{{ raise_exception('roles must alternate') }}{% endif %}"
    "{% if m['role'] == 'assistant' %}{{ 'A: ' }}{% generation %}"
    "{{ m['content'] }}{{ eos_token }}{% endgeneration %}{% else %}"
    "{{ 'Q: ' + m['content'] + '\n' }}{% endif %}{% endfor %}"
)
END = {"llama3": "<|eot_id|>", "qwen": "<|im_end|>", "chatml": "<|im_end|>", "marked": "</s>",
       "plain": "</s>"}
TEMPLATES = {"llama3": LLAMA3, "qwen": QWEN, "chatml": BUILTIN_TEMPLATES["chatml"],
             "marked": MARKED, "plain": BUILTIN_TEMPLATES["plain"]}
SPECIALS = ("<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
            "<|im_start|>", "<|im_end|>", "</s>")
CONVERSATIONS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How can I help?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"},
     {"role": "assistant", "content": "4."}, {"role": "user", "content": "and 3+3?"},
     {"role": "assistant", "content": "6, of course."}],
]


@pytest.fixture(scope="module")
def tok():
    texts = ["Hello there, how can I help? Be brief, of course. 2+2 is 4 and 3+3 is 6"] * 20
    return train_bpe(texts, 400, special_tokens=SPECIALS)


def hf_tokenizer(tok, template: str):
    from tokenizers import Tokenizer as HFTokenizer
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.hf.to_str()),
                                bos_token="<|begin_of_text|>", eos_token="</s>")
    t.chat_template = template
    return t


@pytest.mark.parametrize("name", list(TEMPLATES))
@pytest.mark.parametrize("conv", [0, 1])
def test_rendering_and_ids_equal_transformers_apply_chat_template(tok, name, conv):
    messages = CONVERSATIONS[conv]
    ours = ChatTemplate(TEMPLATES[name], name, "<|begin_of_text|>", "</s>")
    theirs = hf_tokenizer(tok, TEMPLATES[name])
    for gen in (False, True):
        want = theirs.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        assert ours.render(messages, add_generation_prompt=gen) == want
    text, spans = assistant_spans(ours, messages)
    ex = encode_example(text, spans, chat_encoder(tok))
    want_ids = theirs.apply_chat_template(messages, tokenize=True)
    want_ids = want_ids if isinstance(want_ids, list) else want_ids["input_ids"]  # BatchEncoding
    assert ex.ids.tolist() == list(want_ids)


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_learned_tokens_are_exactly_the_assistant_turns_and_their_end_token(tok, name):
    messages = CONVERSATIONS[1]
    template = ChatTemplate(TEMPLATES[name], name, "<|begin_of_text|>", "</s>")
    text, spans = assistant_spans(template, messages)
    ex = encode_example(text, spans, chat_encoder(tok))
    # each run of learned tokens decodes to one assistant reply followed by its end token
    runs, current = [], []
    for i, learned in zip(ex.ids.tolist(), ex.learned.tolist()):
        if learned:
            current.append(i)
        elif current:
            runs.append(current)
            current = []
    if current:
        runs.append(current)
    got = [tok.hf.decode(r, skip_special_tokens=False) for r in runs]
    want = [m["content"] + END[name] for m in messages if m["role"] == "assistant"]
    # a token that straddles the turn's start (" 4" after "A:") is learned with its space
    assert [g.lstrip(" ") for g in got] == want
    assert not ex.learned[0]


# The same templates with transformers' {% generation %} markers around what is learned (the
# reply and its end-of-turn token), for apply_chat_template(return_assistant_tokens_mask=True).
# Each renders exactly as its unmarked original (checked below).
GENERATION = {
    "chatml": (
        "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}"
        "{% else %}{{ message['content'] + '<|im_end|>' + '\n' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
    ),
    "llama3": (
        "{% for message in messages %}{% if loop.index0 == 0 %}{{ bos_token }}{% endif %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
        "{% if message['role'] == 'assistant' %}{% generation %}"
        "{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
        "{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
        "{% if add_generation_prompt %}"
        "{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
    ),
    "qwen": QWEN.replace(
        "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' "
        "+ '\\n' }}",
        "        {%- if message.role == 'assistant' %}\n"
        "            {{- '<|im_start|>assistant\\n' }}{% generation %}"
        "{{- message.content + '<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n"
        "        {%- else %}\n"
        "            {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' "
        "+ '\\n' }}\n"
        "        {%- endif %}"),
    "marked": MARKED,
}
EDGE_REPLIES = ["<think>\nhm\n</think>\n\n4.", "<b>4</b>", "<5", "", "x"]


def edge_conversations() -> list[list[dict[str, str]]]:
    """Ordinary conversations, and replies that start with the end-of-turn marker's first
    character ("<") or are empty, alone and as an earlier turn."""
    out = [*CONVERSATIONS]
    for reply in EDGE_REPLIES:
        out.append([{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": reply}])
        out.append([{"role": "system", "content": "Be brief."},
                    {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": reply},
                    {"role": "user", "content": "and 3+3?"},
                    {"role": "assistant", "content": "6, of course."}])
    return out


@pytest.mark.parametrize("name", list(GENERATION))
def test_learned_tokens_equal_transformers_assistant_tokens_mask(tok, name):
    """The learned flags equal transformers' `return_assistant_tokens_mask` (what TRL's
    assistant_only_loss trains on) token for token, but the first (never learned, see
    `learned_example`), on ordinary conversations and on replies that start with "<" or are
    empty (an empty reply still learns its end-of-turn token: it teaches the model to stop)."""
    ours = ChatTemplate(TEMPLATES[name], name, "<|begin_of_text|>", "</s>")
    theirs = hf_tokenizer(tok, GENERATION[name])
    encoder = chat_encoder(tok)
    for messages in edge_conversations():
        text, spans = assistant_spans(ours, messages)
        assert text == theirs.apply_chat_template(messages, tokenize=False)
        want = theirs.apply_chat_template(messages, return_dict=True,
                                          return_assistant_tokens_mask=True)
        ex = encode_example(text, spans, encoder)
        assert ex.ids.tolist() == list(want["input_ids"])
        assert not ex.learned[0]
        got = ex.learned.astype(int).tolist()
        assert got[1:] == list(want["assistant_masks"])[1:], (messages, text)


def test_record_shapes_and_refusals():
    chat = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    assert to_messages({"messages": chat}, "f:1") == chat
    assert to_messages({"conversations": [{"from": "human", "value": "q"},
                                          {"from": "gpt", "value": "a"}]}, "f:1") == chat
    assert to_messages({"prompt": "q", "completion": "a"}, "f:1") == chat
    parts = [{"role": "user", "content": [{"type": "text", "text": "q"}]},
             {"role": "assistant", "content": "a"}]
    assert to_messages({"messages": parts}, "f:1") == chat
    with pytest.raises(DataError, match="f:3: the conversation has no assistant turn"):
        to_messages({"messages": chat[:1]}, "f:3")
    with pytest.raises(DataError, match="f:4: unknown role 'wizard'"):
        to_messages({"messages": [{"role": "wizard", "content": "x"}, *chat]}, "f:4")
    with pytest.raises(DataError, match="not a fine-tuning record"):
        to_messages({"text": "x"}, "f:5")


def test_template_sandbox_and_errors():
    # a template may not reach Python internals (it comes from whoever published the model)
    evil = ChatTemplate("{{ ''.__class__.__mro__[1].__subclasses__() }}", "evil.jinja")
    with pytest.raises(DataError, match="evil.jinja"):
        evil.render([{"role": "user", "content": "x"}])
    marked = ChatTemplate(MARKED, "marked")
    with pytest.raises(DataError, match="roles must alternate"):
        marked.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])
    with pytest.raises(DataError, match="does not parse"):
        ChatTemplate("{% for %}", "broken").render([])


def test_model_template_found_beside_the_tokenizer(tmp_path: Path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "default", "template": "X{{ eos_token }}"},
                           {"name": "tool_use", "template": "T"}], "eos_token": "</s>"}))
    t = resolve_template("auto", tmp_path)
    assert t.render([]) == "X</s>"
    (tmp_path / "chat_template.jinja").write_text("J")
    assert resolve_template("auto", tmp_path).render([]) == "J"  # as transformers >= 4.50
    assert resolve_template("auto", None).origin.startswith("chatml")
    with pytest.raises(DataError, match="neither a built-in template"):
        resolve_template("nope", None)


def _examples(lengths: list[int], learned_from: int = 2) -> list[Example]:
    out = []
    for k, n in enumerate(lengths):
        ids = np.arange(n, dtype=np.int64) + 10 * k
        learned = np.arange(n) >= learned_from
        out.append(Example(ids, learned))
    return out


def test_packing_documents_padding_and_overlong():
    stats = PackStats()
    kept = fit(_examples([5, 9, 3, 12, 4]), 10, "truncate", stats)
    assert (stats.examples, stats.truncated, stats.dropped) == (5, 1, 0)
    packed = pack(kept, 10, pad_id=0, packed=True, stats=stats)
    # first-fit in order: [5, 3] [9] [10] [4]... the 4 fits nowhere before: a new sample
    assert packed.tokens.shape == (4, 10)
    assert packed.docs[0].tolist() == [0] * 5 + [1] * 3 + [2] * 2  # padding: its own document
    assert packed.learned[0, 8:].sum() == 0  # padding never learned
    assert stats.efficiency == pytest.approx(31 / 40)
    ds = SFTDataset(packed, 9, "t", "fp")
    assert ds.doc_ids(0).tolist() == packed.docs[0, :9].tolist()
    assert ds.loss_mask(0).tolist() == packed.learned[0, 1:].astype(bool).tolist()
    dropped = PackStats()
    assert len(fit(_examples([5, 12]), 10, "drop", dropped)) == 1 and dropped.dropped == 1
    # truncation that leaves nothing to learn drops the example, and so does nothing to learn
    # at all (every sample then has a learned target: evaluation never counts none)
    none_left = PackStats()
    assert fit(_examples([12, 5], learned_from=11), 10, "truncate", none_left) == []
    assert none_left.dropped == 2
    single = pack(_examples([5, 3]), 10, 0, packed=False, stats=PackStats())
    assert single.tokens.shape == (2, 10)


def write_chats(path: Path, n: int = 60) -> Path:
    lines = []
    for i in range(n):
        reply = " ".join(["yes"] * (1 + i % 7))  # uneven learned lengths
        lines.append(json.dumps({"messages": [{"role": "user", "content": f"question {i}"},
                                              {"role": "assistant", "content": reply}]}))
    path.write_text("\n".join(lines) + "\n")
    return path


def sft_config(tmp_path: Path, data: Path, **extra) -> Config:
    return Config.load(None, {"data.source": "sft", "data.paths": [str(data)],
                              "data.tokenizer": "bytes", "data.chat_template": "chatml",
                              "data.cache_dir": str(tmp_path / "cache"), "data.split": "80,20",
                              "train.seq_len": 160, "train.micro_batch_size": 2, **extra})


def test_loader_masks_targets_and_resumes_exactly(tmp_path: Path):
    cfg = sft_config(tmp_path, write_chats(tmp_path / "chats.jsonl"))
    lines: list[str] = []
    data = build_data(cfg, console=lines.append)
    assert any(line.startswith("sft: 48 examples, 0 truncated, 0 dropped, packing efficiency")
               for line in lines)
    assert 0 < data.figures["sft_learned_fraction"] < data.figures["sft_packing_efficiency"] <= 1
    b = data.train.next_batch()
    assert b.doc_ids is not None and (b.targets == -100).any() and (b.targets != -100).any()
    learned = b.targets[b.targets != -100]
    assert set(bytes(learned.tolist()[:3])) <= set(b"yes<|im_end|>")
    for _ in range(3):
        data.train.next_batch()
    state = data.train.state_dict()
    want = [data.train.next_batch() for _ in range(5)]
    again = build_data(cfg, console=lines.append).train
    again.load_state_dict(state)
    for w in want:
        got = again.next_batch()
        assert all((g == x).all() for g, x in zip(got[:3], w[:3]))  # (no reference log-probs)


def test_damaged_cache_is_rebuilt_not_used(tmp_path: Path):
    cfg = sft_config(tmp_path, write_chats(tmp_path / "chats.jsonl"))
    build_data(cfg, console=lambda _: None)
    entry = next((tmp_path / "cache").glob("sft-*"))
    tokens = entry / "train.tokens.npy"
    raw = bytearray(tokens.read_bytes())
    raw[-1] ^= 0xFF
    tokens.write_bytes(bytes(raw))
    lines: list[str] = []
    build_data(cfg, console=lines.append)
    assert any("is damaged (train.tokens.npy does not match its checksum); rebuilding" in line
               for line in lines)
    assert tokens.read_bytes() != bytes(raw)


def test_loader_of_token_datasets_is_unmasked():
    from tessel.data.dataset import TokenDataset

    ds = TokenDataset(np.arange(100), np.array([0, 50, 100]), 9)
    loader = Loader([ds], [1.0], 2, 0, False)
    assert not loader.masked and (loader.next_batch().targets >= 0).all()


def test_a_packed_sample_learns_what_its_examples_learn_separately():
    """The loss sum and gradients of one packed sample (two examples + padding, document mask,
    -100 targets) equal the sums over the examples run alone: the mask keeps them apart.
    RoPE scores depend on relative positions only, so a Llama-shaped model needs no position
    restart for this to hold."""
    import torch

    from tessel.models import build_model
    from tessel.models.loss import token_loss_sum

    cfg = Config.load(None, {"model.preset": "tiny-llama", "model.dropout": 0.0})
    model = build_model(cfg.model, "cpu", seed=0)
    stats = PackStats()
    examples = _examples([20, 15], learned_from=6)
    packed = pack(examples, 49, pad_id=0, packed=True, stats=stats)
    ds = SFTDataset(packed, 48, "t", "fp")
    row = torch.from_numpy(ds.sample(0))
    x, y = row[None, :-1], row[None, 1:].clone()
    y[0, ~torch.from_numpy(ds.loss_mask(0))] = -100
    docs = torch.from_numpy(ds.doc_ids(0))[None]

    def loss_and_grads(fn) -> tuple[float, list[torch.Tensor]]:
        model.zero_grad()
        loss = fn()
        loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters()]

    packed_loss, packed_grads = loss_and_grads(lambda: token_loss_sum(model(x, docs), y))

    def separate() -> torch.Tensor:
        total = torch.zeros(())
        for ex in examples:
            ids = torch.from_numpy(ex.ids)[None]
            target = ids[:, 1:].clone()
            target[0, ~torch.from_numpy(ex.learned[1:])] = -100
            total = total + token_loss_sum(model(ids[:, :-1]), target)
        return total

    alone_loss, alone_grads = loss_and_grads(separate)
    assert packed_loss == pytest.approx(alone_loss, rel=1e-5)
    for a, b in zip(packed_grads, alone_grads):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-6)
