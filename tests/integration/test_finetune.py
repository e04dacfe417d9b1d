"""Supervised fine-tuning as a user runs it: `tessel train configs/sft-tiny.toml` (the masked
loss falls), `tessel generate --chat`, and bad fine-tuning inputs refused in one line with
exit code 2 and nothing written."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from test_cli import ROOT, assert_one_line_error, start, tessel, tessel_here

from tessel.observe.metrics import read_metrics

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]


def _bad_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (extra overrides, the words the one error line must hold)."""
    def jsonl(name: str, records: list, raw: str = "") -> str:
        path = tmp / name
        path.write_text("".join(json.dumps(r) + "\n" for r in records) + raw)
        return str(path)

    good = {"messages": CHAT}
    template = tmp / "strict.jinja"
    template.write_text("{% if messages|length > 1 %}{{ raise_exception('only one message, "
                        "please') }}{% endif %}{{ messages[0]['content'] }}")
    no_replies = tmp / "no_replies.jinja"  # renders every turn but the assistant's
    no_replies.write_text("{% for m in messages %}{% if m['role'] != 'assistant' %}"
                          "{{ m['content'] }}\n{% endif %}{% endfor %}")
    constant = tmp / "constant.jinja"
    constant.write_text("Hello!")
    one_step = ["--data.sft_pack=false", "--train.steps=1", "--train.eval_interval=1",
                "--run.sample_tokens=0", "--metrics.tensorboard=false"]
    gz = tmp / "broken.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"messages": []}\n' * 20)[:-12])
    return {
        "no_assistant": ([f"--data.paths=['{jsonl('a.jsonl', [good, {'messages': CHAT[:1]}])}']"],
                         "a.jsonl:2: the conversation has no assistant turn"),
        "unknown_role": ([f"--data.paths=['{jsonl('b.jsonl', [{'messages': [{'role': 'bot', 'content': 'x'}]}])}']"],  # noqa: E501
                         "b.jsonl:1: unknown role 'bot'"),
        "malformed_json": ([f"--data.paths=['{jsonl('c.jsonl', [good], raw='{oops')}']"],
                           "c.jsonl:2: not valid JSON"),
        "template_raises": ([f"--data.paths=['{jsonl('d.jsonl', [good])}']",
                             f"--data.chat_template={template}"],
                            "failed to render: only one message, please"),
        "empty_after_drop": ([f"--data.paths=['{jsonl('e.jsonl', [good])}']",
                              "--data.sft_overlong=drop", "--train.seq_len=8"],
                             "no fine-tuning example is left after dropping the 1 longer"),
        "damaged_gzip": ([f"--data.paths=['{gz}']"], "not a valid gzip file"),
        # nothing to learn: training would run (one sample per example, enough for the
        # batches) on a loss of 0, and validation divide by zero
        "template_without_replies": ([f"--data.paths=['{jsonl('f.jsonl', [good] * 80)}']",
                                      f"--data.chat_template={no_replies}", *one_step],
                                     "nothing to learn: the chat template"),
        "constant_template": ([f"--data.paths=['{jsonl('g.jsonl', [good] * 80)}']",
                               f"--data.chat_template={constant}", *one_step],
                              "nothing to learn: the chat template"),
    }


CASES = ["no_assistant", "unknown_role", "malformed_json", "template_raises", "empty_after_drop",
         "damaged_gzip", "template_without_replies", "constant_template"]


def _args(tmp_path: Path, case: str) -> tuple[list[str], str]:
    extra, needle = _bad_inputs(tmp_path)[case]
    return ["train", str(ROOT / "configs/sft-tiny.toml"), f"--run.dir={tmp_path / 'run'}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.tokenizer=bytes", *extra], needle


def _nothing_written(tmp_path: Path) -> None:
    for d in (tmp_path / "run", tmp_path / "cache"):  # no run, no cache entry, no temporary
        assert not d.exists() or not any(d.iterdir()), sorted(d.iterdir())


def test_bad_fine_tuning_input_from_the_command_line(tmp_path: Path):
    """One case as a user meets it: the real process, its exit code and its stderr."""
    args, needle = _args(tmp_path, "no_assistant")
    assert_one_line_error(tessel(*args), needle)
    _nothing_written(tmp_path)


@pytest.mark.parametrize("case", CASES)
def test_bad_fine_tuning_input_is_one_line_exit_2_and_writes_nothing(tmp_path: Path, case: str,
                                                                     capsys):
    # in-process (`tessel.cli.main`, what the command runs): a process per case costs seconds
    from tessel.cli import main

    args, needle = _args(tmp_path, case)
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("tessel: error: "), err
    assert needle in err[0]
    _nothing_written(tmp_path)


def test_hf_to_tessel_keeps_the_models_chat_template(tmp_path: Path, corpus: Path):
    """`data.chat_template = "auto"` and `generate --chat` find an imported model's own
    template: hf-to-tessel copies tokenizer_config.json beside tokenizer.json."""
    from test_hf import hf_llama, save_hf

    from tessel.cli import main
    from tessel.data.tokenizer import load_tokenizer
    from tessel.generate import chat_template_for

    src = save_hf(hf_llama(), tmp_path / "hf", corpus)
    (src / "tokenizer_config.json").write_text(json.dumps({
        "chat_template": "Q:{{ messages[0]['content'] }}{% if add_generation_prompt %}A:{% endif %}",
        "eos_token": "<|endoftext|>"}))
    out = tmp_path / "out"
    assert main(["convert", "hf-to-tessel", str(src), str(out)]) == 0
    template = chat_template_for(out, None, load_tokenizer(out / "tokenizer.json"))
    assert "the model's own" in template.origin
    assert template.render([{"role": "user", "content": "hi"}], add_generation_prompt=True) == "Q:hiA:"


# A template that uses the tokenizer's bos_token and eos_token strings (which are not its
# end-of-document token), so an export must carry them as well as the template.
TOKENS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'assistant' %}"
                   "Bot: {{ m['content'] }}{{ eos_token }}\n{% else %}"
                   "{{ m['role'] }}: {{ m['content'] }}\n{% endif %}{% endfor %}"
                   "{% if add_generation_prompt %}Bot:{% endif %}")


def _fine_tune(tmp_path: Path, special: tuple[str, ...], tokens: dict[str, str],
               template_text: str) -> tuple[Path, Path, Path]:
    """A 2-step fine-tuning run on the bundled chat set, rendered with `template_text`, on a
    BPE with the `special` tokens whose tokenizer_config.json names `tokens`: (the
    tokenizer's directory, the template file, the run)."""
    from tessel.cli import main
    from tessel.data.tokenizer import train_bpe

    tokdir = tmp_path / "tok"
    tokdir.mkdir()
    texts = (ROOT / "configs/data/sft-tiny.jsonl").read_text().splitlines()
    train_bpe(texts, 400, special_tokens=special).save(tokdir / "tokenizer.json")
    (tokdir / "tokenizer_config.json").write_text(json.dumps(tokens))
    template = tmp_path / "template.jinja"
    template.write_text(template_text)
    run = tmp_path / "run"
    assert main(["train", str(ROOT / "configs/sft-tiny.toml"), f"--run.dir={run}",
                 f"--data.cache_dir={tmp_path / 'cache'}", f"--data.tokenizer={tokdir}/tokenizer.json",
                 f"--data.chat_template={template}", "--data.split=100,0", "--train.steps=2",
                 "--train.eval_interval=0", "--checkpoint.interval=2", "--run.sample_tokens=0",
                 "--metrics.tensorboard=false", "--quiet"]) == 0
    return tokdir, template, run


def test_sft_export_carries_the_chat_template_the_run_trained_with(tmp_path: Path, capsys):
    """`tessel convert tessel-to-hf` of a fine-tuning run writes the template it trained with
    (chat_template.jinja and tokenizer_config.json, with the bos/eos strings the template
    saw): transformers' apply_chat_template on the export renders what training rendered,
    and `tessel generate --chat EXPORT` uses it (not ChatML), replying as the run does."""
    from transformers import AutoTokenizer

    from tessel.cli import main
    from tessel.data.chat_template import resolve_template
    from tessel.data.tokenizer import load_tokenizer
    from tessel.generate import chat_template_for

    tokdir, template, run = _fine_tune(
        tmp_path, ("<|begin_of_text|>", "<|eot_id|>"),
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, TOKENS_TEMPLATE)
    export = tmp_path / "export"
    assert main(["convert", "tessel-to-hf", str(run), str(export)]) == 0
    summary = capsys.readouterr().out
    trained = resolve_template(str(template), tokdir)  # what the run rendered its data with
    conversation = [{"role": "user", "content": "Spell moon."}]
    want = trained.render(conversation, add_generation_prompt=True)
    assert want.startswith("<|begin_of_text|>user: Spell moon.")
    hf = AutoTokenizer.from_pretrained(export)
    assert hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True) == want
    reply = [*conversation, {"role": "assistant", "content": "M-O-O-N"}]
    assert hf.apply_chat_template(reply, tokenize=False) == trained.render(reply)
    tok = load_tokenizer(export / "tokenizer.json")
    used = chat_template_for(export, None, tok)
    assert used.render(conversation, add_generation_prompt=True) == want
    replies = []
    for where in (run, export):
        assert main(["generate", str(where), "--chat", "--prompt", "Spell moon.",
                     "--temperature", "0", "--max-new-tokens", "12"]) == 0
        replies.append(capsys.readouterr().out)
    assert replies[0] == replies[1]
    assert "with its chat template" in summary


# Uses eos_token and pad_token, both named by the tokenizer's tokenizer_config.json: "</s>" is
# no token of the BPE (it reads it as pieces), "<pad>" is one.
PAD_TEMPLATE = ("{% for m in messages %}{{ m['role'] }}{{ pad_token }}{{ m['content'] }}"
                "{% if m['role'] == 'assistant' %}{{ eos_token }}{% endif %}{{ '\\n' }}"
                "{% endfor %}{% if add_generation_prompt %}assistant{{ pad_token }}{% endif %}")


def test_an_export_renders_the_special_tokens_its_training_rendered(tmp_path: Path, capsys):
    """An init_from model whose eos_token is "</s>" (no token of its tokenizer) trained on
    "...</s>" text, but the export wrote eos_token "<|endoftext|>", so transformers rendered
    none of the conversations as trained; and templates using pad_token (or unk_token, ...)
    rendered it empty in tessel (round 3, item 10). tessel passes every special token
    transformers passes, and the export sets the one that is no token in its template:
    apply_chat_template gives the text and the ids training did, adding no token."""
    from transformers import AutoTokenizer

    from tessel.cli import main
    from tessel.data.chat_template import resolve_template
    from tessel.data.sft import chat_encoder
    from tessel.data.tokenizer import load_tokenizer
    from tessel.generate import chat_template_for

    tokdir, template, run = _fine_tune(
        tmp_path, ("<pad>",), {"eos_token": "</s>", "pad_token": "<pad>", "unk_token": "<unk>"},
        PAD_TEMPLATE)
    trained = resolve_template(str(template), tokdir)  # what the run rendered its data with
    reply = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    assert trained.render(reply) == "user<pad>hi\nassistant<pad>hello</s>\n"
    export = tmp_path / "export"
    assert main(["convert", "tessel-to-hf", str(run), str(export)]) == 0
    assert "with its chat template" in capsys.readouterr().out
    hf = AutoTokenizer.from_pretrained(export)
    tok = load_tokenizer(export / "tokenizer.json")
    assert len(hf) == tok.vocab_size  # no token added past the model's vocabulary
    encoder = chat_encoder(tok)
    for conversation, prompt in ((reply[:1], True), (reply, False)):
        want = trained.render(conversation, add_generation_prompt=prompt)
        assert hf.apply_chat_template(conversation, tokenize=False,
                                      add_generation_prompt=prompt) == want
        ids = hf.apply_chat_template(conversation, add_generation_prompt=prompt)
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        assert list(ids) == encoder.encode(want, add_special_tokens=False).ids
        # tessel generate --chat on the export renders it the same way
        assert chat_template_for(export, None, tok).render(
            conversation, add_generation_prompt=prompt) == want

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _tiny_hf_chat_model(path: Path) -> Path:
    """A random transformers Llama with a ChatML template and a byte-level BPE trained on the
    bundled chat set (its end-of-turn token a single id), as a user's HF directory holds."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        (ROOT / "configs/data/sft-tiny.jsonl").read_text().splitlines(),
        trainers.BpeTrainer(vocab_size=320, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                            special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=176,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=256, tie_word_embeddings=False,
        eos_token_id=tok.token_to_id("<|im_end|>"))).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>"}))
    return path


@pytest.mark.budget(80)  # seconds on the reference machine: measured, +~40%
@pytest.mark.slow
def test_sft_from_a_hugging_face_model_to_a_hugging_face_model(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch):
    """The issue's end-to-end example in one config: a Hugging Face Llama (written here) is
    fine-tuned on the bundled chat set with its own chat template and exported; the masked
    loss falls, transformers loads the export and answers a held-out question greedily with
    tessel's reply, in the template's shape (a reply that ends its turn by itself). The
    commands run in this process (`tessel_here`: what the entry point runs, less a ~5 s
    start-up), from the repository root as the config's relative data path expects."""
    from transformers import AutoTokenizer, LlamaForCausalLM

    from tessel.data.tokenizer import load_tokenizer

    src = _tiny_hf_chat_model(tmp_path / "hf")
    run = tmp_path / "run"
    monkeypatch.chdir(ROOT)
    proc = tessel_here("train", "configs/sft-tiny.toml", f"--model.init_from={src}",
                       "--data.chat_template=auto", f"--run.dir={run}",
                       f"--data.cache_dir={tmp_path / 'cache'}", "--train.steps=60",
                       "--train.eval_interval=0", "--checkpoint.interval=60",
                       "--checkpoint.hf_export_interval=60", "--metrics.tensorboard=false",
                       "--run.sample_tokens=0")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "the model's own" in proc.stdout  # the template came from the HF directory
    # the one start-up line with the counts
    assert "sft: 360 examples, 0 truncated, 0 dropped, packing efficiency" in proc.stdout
    recs = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    first, last = recs[0], recs[-1]
    # the loss over the learned (assistant) tokens only
    assert last["step"] == 60 and last["loss"] < 0.5 * first["loss"], (first["loss"], last["loss"])
    assert 0.8 < last["sft_packing_efficiency"] <= 1 and 0 < last["sft_learned_fraction"] < 0.5

    # the export written during training (checkpoint.hf_export_interval) carries the template
    export = next(run.glob("checkpoints/step_*60/hf"))
    model = LlamaForCausalLM.from_pretrained(export).eval()
    tok = AutoTokenizer.from_pretrained(export)
    assert tok.chat_template == CHATML
    question = "Which letter comes after q?"  # one of the set's question families
    ids = tok.apply_chat_template([{"role": "user", "content": question}],
                                  add_generation_prompt=True, return_tensors="pt")
    ids = ids["input_ids"] if hasattr(ids, "keys") else ids
    end = tok.convert_tokens_to_ids("<|im_end|>")
    out = model.generate(ids, max_new_tokens=24, do_sample=False, eos_token_id=end,
                         pad_token_id=end)[0, ids.shape[1]:].tolist()
    assert end in out, tok.decode(out)  # it ends its turn by itself
    hf_reply = tok.decode(out[:out.index(end)])
    chat = tessel_here("generate", str(run), "--chat", "--prompt", question,
                       "--max-new-tokens", "24", "--temperature", "0")
    assert chat.returncode == 0, chat.stderr
    assert "<|im_start|>" not in chat.stdout  # the reply alone, not the rendered prompt
    assert chat.stdout.strip() == hf_reply.strip(), (chat.stdout, hf_reply)
    assert hf_reply.startswith("After "), hf_reply  # the answers' shape: "After q comes r."
    # and `tessel generate --chat` on the export renders with it too
    from tessel.generate import chat_template_for

    assert chat_template_for(export, None, load_tokenizer(export / "tokenizer.json")).source == CHATML


def _hostile_inputs(tmp: Path) -> dict[str, tuple[list[str], str]]:
    """name -> (extra overrides, the words of the one error line): chat templates that were
    tracebacks, and a model directory whose tokenizer_config.json chat_template is a number
    (it was "the model has none", and ChatML was used)."""
    from tessel.data.tokenizer import load_tokenizer

    def jinja(name: str, text: str | bytes) -> str:
        path = tmp / f"{name}.jinja"
        path.write_bytes(text if isinstance(text, bytes) else text.encode())
        return f"--data.chat_template={path}"

    model = tmp / "model"
    model.mkdir()
    load_tokenizer("bytes").save(model / "tokenizer.json")
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": 7}))
    return {
        "overflow": ([jinja("range", "{{ range(10**9) }}")], "OverflowError: Range too big"),
        "zero": ([jinja("zero", "{{ 1/0 }}")], "ZeroDivisionError: division by zero"),
        "recursion": ([jinja("macro", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}")],
                      "recursed too deeply"),
        "latin1": ([jinja("latin1", "{{ messages }} caf\xe9".encode("latin-1"))],
                   "latin1.jinja: a chat template must be UTF-8 text"),
        "malformed": ([f"--data.tokenizer={model / 'tokenizer.json'}", "--data.chat_template=auto"],
                      "tokenizer_config.json: chat_template is malformed: 7 is neither text"),
    }


@pytest.mark.parametrize("case", ["overflow", "zero", "recursion", "latin1", "malformed"])
def test_a_hostile_or_malformed_chat_template_is_one_line_exit_2(tmp_path: Path, case: str,
                                                                 capsys):
    from tessel.cli import main

    extra, needle = _hostile_inputs(tmp_path)[case]
    args = ["train", str(ROOT / "configs/sft-tiny.toml"), f"--run.dir={tmp_path / 'run'}",
            f"--data.cache_dir={tmp_path / 'cache'}", "--data.tokenizer=bytes", *extra]
    code = main(args)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("tessel: error: "), err
    assert needle in err[0], err[0]
    _nothing_written(tmp_path)


def test_sigterm_ends_data_preparation_at_once(tmp_path: Path, monkeypatch):
    """A slow chat template kept `tessel train` preparing data for as long as it took:
    SIGTERM was deferred to the first step boundary, so only SIGKILL stopped it. (Ctrl-C:
    tests/unit/test_chat_template_limits.py.)"""
    template = tmp_path / "slow.jinja"
    # ~0.01-0.05 s a rendering, far within the limits: 2,000 records take minutes
    template.write_text("{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}"
                        + CHATML)
    data = tmp_path / "chats.jsonl"
    data.write_text("".join(json.dumps({"messages": CHAT}) + "\n" for _ in range(2000)))
    cache = tmp_path / "cache"
    monkeypatch.setenv("PYTHONUNBUFFERED", "1")  # the "preparing" line, as it is printed
    proc = start("train", str(ROOT / "configs/sft-tiny.toml"), f"--run.dir={tmp_path / 'run'}",
                 f"--data.cache_dir={cache}", "--data.tokenizer=bytes",
                 f"--data.paths=['{data}']", f"--data.chat_template={template}")
    while "preparing fine-tuning data" not in (line := proc.stdout.readline()):
        assert line, proc.communicate()  # (the process ended)
    time.sleep(0.5)
    proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("still preparing 30 s after the signal") from None
    assert proc.returncode == 143, err
    assert err.strip().splitlines() == [
        "tessel: stopped by SIGTERM while preparing the data, before training (nothing to "
        "save; what was half prepared is discarded)"], err
    assert not list(cache.glob("*")) and not list((tmp_path / "run").glob("*"))


# `tessel train`, with a progress line every 0.2 s (the command's own is every 10 s)
# SIGINT at Python's default, as in a command started from a terminal: a shell starts its
# background jobs (`pytest ... &` in a script, say) with SIGINT ignored, and a child inherits
# that, so Ctrl-C could not reach it (the interrupt test failed only in such sessions).
_TRAIN = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler); "
          "from tessel.data import sft_prepare; sft_prepare.PROGRESS_SECONDS = 0.2; "
          "from tessel.cli import run; run()")


@pytest.mark.parametrize("signum, code, line", [
    (signal.SIGTERM, 143, "tessel: stopped by SIGTERM while preparing the data, before training "
                          "(nothing to save; what was half prepared is discarded)"),
    (signal.SIGINT, 130, "tessel: interrupted")])
def test_a_signal_stops_tokenizer_training_at_once(tmp_path: Path, signum, code, line):
    """The BPE trained in the main thread, in native code, which runs no signal handler:
    SIGTERM and Ctrl-C waited for the training to end (27-41 s on 17 MB), although the docs
    say the command stops at once."""
    import random
    import sys

    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz0123456789"
    words = ["".join(rng.choices(letters, k=rng.randint(3, 12))) for _ in range(1_000_000)]
    data = tmp_path / "chats.jsonl"
    with data.open("w") as f:  # ~7 MB of distinct words: 40 s or more of training on one core
        for _ in range(8000):
            f.write(json.dumps({"prompt": "q", "completion": " ".join(rng.choices(words, k=100))})
                    + "\n")
    cache = tmp_path / "cache"
    proc = subprocess.Popen(
        [sys.executable, "-c", _TRAIN, "train", str(ROOT / "configs/sft-tiny.toml"),
         f"--run.dir={tmp_path / 'run'}", f"--data.cache_dir={cache}", "--data.tokenizer=auto",
         "--model.vocab_size=60000", f"--data.paths=['{data}']"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CI": "true", "RAYON_NUM_THREADS": "1"})
    lines = []
    while "training a tokenizer" not in (progress := proc.stderr.readline()):
        assert progress, proc.communicate()  # (the process ended)
        lines.append(progress)
    proc.send_signal(signum)
    try:  # far less than the training would take (the process's exit alone takes seconds)
        _, err = proc.communicate(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate()
        raise AssertionError("still training the tokenizer 15 s after the signal") from None
    assert proc.returncode == code, err
    assert err.strip().splitlines()[-1] == line, err
    assert all(p.startswith("tessel: preparing fine-tuning data: ")
               for p in err.strip().splitlines()[:-1]), err
    assert not list(cache.glob("*")) and not list((tmp_path / "run").glob("*"))
