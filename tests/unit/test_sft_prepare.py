"""Preparing fine-tuning data as a whole: its cost grows with the conversations' length (not
with the square of their turns), it says how far it got, its total rendering time and
rendered size are bounded, its refusals say what is wrong for the settings in use, and it
leaves nothing in the cache when it fails or is killed."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_chat_template_limits import GEMMA, MISTRAL
from test_sft import TEMPLATES

from tessel.config import Config
from tessel.data import build_data, sft, sft_prepare
from tessel.data.chat_template import BUILTIN_TEMPLATES, ChatTemplate
from tessel.errors import DataError

CHATML = BUILTIN_TEMPLATES["chatml"]
CHAT = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello"}]


SETTINGS = {"data.source": "sft", "data.tokenizer": "bytes", "model.vocab_size": 320,
            "data.chat_template": "chatml", "data.split": "100,0", "train.seq_len": 64,
            "train.micro_batch_size": 1}


def _config(tmp_path: Path, data: Path, **extra) -> Config:
    where = {"data.paths": [str(data)], "data.cache_dir": str(tmp_path / "cache")}
    return Config.load(None, {**SETTINGS, **where, **extra})


def _records(path: Path, conversations: list[list[dict]]) -> Path:
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in conversations))
    return path


def _cache_is_empty(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    assert not cache.exists() or not list(cache.iterdir()), sorted(cache.iterdir())


def _turns(n: int, replies: tuple[str, ...] = ("fine", "", " spaced ", "<think>a</think>ok")
           ) -> list[dict]:
    return [m for i in range(n) for m in (
        {"role": "user", "content": f"question {i}" + (" " if i % 3 == 0 else "")},
        {"role": "assistant", "content": replies[i % len(replies)]})]


def test_a_prompt_longer_than_a_sample_says_so_not_to_set_what_is_set(tmp_path: Path):
    """With data.sft_overlong = "truncate" (the default), a prompt that fills the sample
    leaves nothing to learn; the line told the user to set "truncate", which was set."""
    data = _records(tmp_path / "long.jsonl", [[{"role": "user", "content": "x" * 300},
                                               {"role": "assistant", "content": "yes"}]] * 3)
    with pytest.raises(DataError) as err:
        build_data(_config(tmp_path, data, **{"train.seq_len": 32}), console=lambda _: None)
    line = str(err.value)
    assert "set data.sft_overlong" not in line, line
    assert ("the 3 longer than train.seq_len + 1 = 33 tokens have no reply to learn within "
            "their first 33 tokens (the prompt fills the sample)") in line
    assert "raise train.seq_len or shorten the prompts" in line
    with pytest.raises(DataError, match=r'dropping the 3 longer .*\(data.sft_overlong = "drop"\); '
                                        r'raise train.seq_len or set data.sft_overlong'):
        build_data(_config(tmp_path, data, **{"train.seq_len": 32, "data.sft_overlong": "drop"}),
                   console=lambda _: None)
    _cache_is_empty(tmp_path)


@pytest.mark.parametrize("name", ["llama3", "qwen", "chatml", "marked", "plain", "gemma",
                                  "mistral"])
def test_long_conversations_learn_what_rendering_every_prefix_learns(name, monkeypatch):
    """A long conversation is rendered twice in all, not once per prefix; what it learns is
    what the prefixes find (whitespace a template trims, empty replies, replies starting
    with "<", a conversation ending on a user turn)."""
    source = {**TEMPLATES, "gemma": GEMMA, "mistral": MISTRAL}[name]
    template = ChatTemplate(source, name, "<s>", "</s>")
    conversations = [_turns(20), _turns(9) + [{"role": "user", "content": "and?"}],
                     [{"role": "assistant", "content": "first"}, *_turns(12)]]
    fast = []
    for c in conversations:
        try:
            fast.append(sft.assistant_spans(template, c))
        except DataError as exc:  # (gemma and mistral refuse the last one: roles alternate)
            fast.append(str(exc))
    monkeypatch.setattr(sft, "EXACT_MESSAGES", 10**6)
    for c, got in zip(conversations, fast):
        try:
            assert got == sft.assistant_spans(template, c)
        except DataError as exc:
            assert got == str(exc)


def test_a_conversation_of_many_turns_costs_its_length_not_its_square(monkeypatch):
    """3,000 turn pairs rendered every prefix (and two probes per turn): 36 million messages
    rendered, 68 s."""
    rendered = [0]
    plain = ChatTemplate.render

    def counting(self, messages, add_generation_prompt=False):
        rendered[0] += len(messages)
        return plain(self, messages, add_generation_prompt)

    monkeypatch.setattr(ChatTemplate, "render", counting)
    messages = _turns(3000)
    text, spans = sft.assistant_spans(ChatTemplate(CHATML, "chatml", "", "<|im_end|>"), messages)
    assert len(spans) == 3000  # (an empty reply learns its end-of-turn token)
    assert text.endswith("<|im_end|>\n")
    assert rendered[0] < 3 * len(messages), rendered[0]


def test_preparation_says_how_far_it_got(tmp_path: Path, monkeypatch):
    """It said "preparing" once and nothing more for as long as it took (23 minutes for a
    slow template over the bundled set)."""
    from tessel.data.sft_build import ensure_sft

    monkeypatch.setattr(sft_prepare, "PROGRESS_SECONDS", 0.0)  # a line at every step
    data = _records(tmp_path / "chats.jsonl", [CHAT] * 40)
    cfg = _config(tmp_path, data, **{"data.tokenizer": "auto"})
    lines: list[str] = []
    ensure_sft(cfg.data, 64, 320, tmp_path / "cache", console=lambda _: None,
               progress=lines.append)
    assert lines[0].startswith("tessel: preparing fine-tuning data: 1 conversations rendered ("), lines
    assert any(line.startswith("tessel: preparing fine-tuning data: 40 conversations rendered")
               for line in lines)
    assert any("training a tokenizer on 40 conversations" in line for line in lines)
    assert lines[-1].startswith("tessel: preparing fine-tuning data: 40 of 40 conversations "
                                "tokenized ("), lines[-1]


def test_the_total_rendering_time_is_bounded(tmp_path: Path, monkeypatch):
    """Every rendering within its 5 s, the whole was unbounded: a template taking 1 s a
    rendering took 23 minutes over 400 conversations."""
    monkeypatch.setattr(sft_prepare, "TOTAL_SECONDS", 0.2)
    monkeypatch.setattr(sft_prepare, "SECONDS_PER_MESSAGE", 0.0)
    template = tmp_path / "slow.jinja"
    template.write_text("{% for i in range(300) %}{% for j in range(100) %}{% endfor %}{% endfor %}"
                        + CHATML)
    data = _records(tmp_path / "chats.jsonl", [CHAT] * 400)
    with pytest.raises(DataError, match=r"the chat template \(.*slow.jinja\) took [\d.]+ s to render "
                                        r"the first [\d,]+ conversations .* use a faster "
                                        r"data.chat_template"):
        build_data(_config(tmp_path, data, **{"data.chat_template": str(template)}),
                   console=lambda _: None)
    _cache_is_empty(tmp_path)


def test_the_total_rendered_size_is_bounded(tmp_path: Path, monkeypatch):
    """Each rendering under its size limit, 400 of them held 1.6 GB: the tokenizer aborted
    (exit 134) and left an empty temporary directory in the cache."""
    monkeypatch.setattr(sft_prepare, "TOTAL_CHARS", 100_000)
    template = tmp_path / "big.jinja"
    template.write_text("{{ 'x' * 20000 }}" + CHATML)  # far within one rendering's limit
    data = _records(tmp_path / "chats.jsonl", [CHAT] * 400)
    with pytest.raises(DataError) as err:
        build_data(_config(tmp_path, data, **{"data.chat_template": str(template)}),
                   console=lambda _: None)
    assert "big.jinja) wrote" in str(err.value) and "characters for the first" in str(err.value)
    assert "use a data.chat_template that writes the conversations, not more" in str(err.value)
    _cache_is_empty(tmp_path)


def test_a_process_killed_while_preparing_leaves_nothing_in_the_cache(tmp_path: Path):
    """The entry's temporary directory was made before rendering began: a process killed
    (by the kernel's OOM killer, an abort) while rendering left it behind."""
    template = tmp_path / "slow.jinja"
    template.write_text("{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}"
                        + CHATML)
    data = _records(tmp_path / "chats.jsonl", [CHAT] * 2000)
    script = ("import sys; from tessel.config import Config; from tessel.data import build_data; "
              "build_data(Config.load(None, {k: v for k, v in __import__('json').loads("
              "sys.argv[1]).items()}))")
    overrides = {**SETTINGS, "data.paths": [str(data)], "data.chat_template": str(template),
                 "data.cache_dir": str(tmp_path / "cache")}
    proc = subprocess.Popen([sys.executable, "-u", "-c", script, json.dumps(overrides)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # the "preparing" line: rendering has begun
        assert line.startswith("tessel: preparing fine-tuning data"), (line, proc.stderr.read())
        time.sleep(0.5)
        assert proc.poll() is None, proc.communicate()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate()
    _cache_is_empty(tmp_path)
