"""Fine-tuning data for Qwen2.5, Qwen3 and OLMo 2 with each family's own chat template, found
the way a model's directory gives it (tokenizer_config.json beside tokenizer.json,
data.chat_template = "auto"): the tokens tessel learns are exactly the ones transformers'
`apply_chat_template(return_assistant_tokens_mask=True)` marks, on the conversations of
test_sft.py (edge cases included). tessel finds the assistant turns itself; transformers
needs {% generation %} markers, so its copy of each template has them around what is
learned (each reply and its end-of-turn token) and renders the same text."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_sft import edge_conversations
from transformers import AutoTokenizer

from tessel.data.chat_template import resolve_template
from tessel.data.sft import assistant_spans, chat_encoder, encode_example
from tessel.data.tokenizer import load_tokenizer, train_bpe

# Qwen2.5-Instruct's template without its tool branches (a default system message).
QWEN25 = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a "
    "helpful assistant.<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}@@{{- message.content + '<|im_end|>' }}##"
    "{{- '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)
# Qwen3's template without tools and reasoning content (no <think> block in the replies):
# no default system message; the generation prompt of enable_thinking=false.
QWEN3 = (
    "{%- for message in messages %}"
    "{%- if message.role == 'user' or message.role == 'system' %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}@@{{- message.content | trim }}"
    "{{- '<|im_end|>' }}##{{- '\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' }}{%- endif %}"
)
# OLMo-2-1124-7B-Instruct's (Tulu 3's) template, verbatim but for the markers.
OLMO2 = (
    "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'system' %}"
    "{{ '<|system|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'user' %}"
    "{{ '<|user|>\\n' + message['content'] + '\\n' }}{% elif message['role'] == 'assistant' %}"
    "{% if not loop.last %}{{ '<|assistant|>\\n' }}@@{{ message['content'] + eos_token }}##"
    "{{ '\\n' }}{% else %}{{ '<|assistant|>\\n' }}@@{{ message['content'] + eos_token }}##"
    "{% endif %}{% endif %}{% if loop.last and add_generation_prompt %}"
    "{{ '<|assistant|>\\n' }}{% endif %}{% endfor %}"
)
# family -> (template with @@ ## where transformers' markers go, BOS, EOS)
FAMILIES = {"qwen2": (QWEN25, None, "<|im_end|>"), "qwen3": (QWEN3, None, "<|im_end|>"),
            "olmo2": (OLMO2, "<|endoftext|>", "<|endoftext|>")}
SPECIALS = ("<|im_start|>", "<|im_end|>", "<|endoftext|>")


def model_dir(path: Path, family: str) -> Path:
    """A model directory's tokenizer files: a BPE with the family's special tokens, and its
    chat template in tokenizer_config.json (as the Hub's are)."""
    template, bos, eos = FAMILIES[family]
    texts = ["Hello there, how can I help? Be brief, of course. 2+2 is 4 and 3+3 is 6 <b>x"] * 20
    path.mkdir()
    train_bpe(texts, 400, special_tokens=SPECIALS).hf.save(str(path / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": eos,
              "bos_token": bos, "chat_template": template.replace("@@", "").replace("##", "")}
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.mark.parametrize("family", FAMILIES)
def test_learned_tokens_equal_transformers_assistant_mask(family, tmp_path: Path):
    path = model_dir(tmp_path / family, family)
    ours = resolve_template("auto", path)
    assert ours.origin.startswith("the model's own")
    theirs = AutoTokenizer.from_pretrained(path)
    own = theirs.chat_template
    assert own == FAMILIES[family][0].replace("@@", "").replace("##", "")
    theirs.chat_template = FAMILIES[family][0].replace("@@", "{% generation %}").replace(
        "##", "{% endgeneration %}")
    encoder = chat_encoder(load_tokenizer(path / "tokenizer.json"))
    learned_turns = 0
    for messages in edge_conversations():
        text, spans = assistant_spans(ours, messages)
        # the model's own template and the marked copy render what tessel renders
        assert text == theirs.apply_chat_template(messages, tokenize=False, chat_template=own)
        assert text == theirs.apply_chat_template(messages, tokenize=False)
        want = theirs.apply_chat_template(messages, return_dict=True,
                                          return_assistant_tokens_mask=True)
        ex = encode_example(text, spans, encoder)
        assert ex.ids.tolist() == list(want["input_ids"])
        assert not ex.learned[0]  # the first token is never a target
        assert ex.learned.astype(int).tolist()[1:] == list(want["assistant_masks"])[1:], (
            family, messages, text)
        learned_turns += len(spans)
    assert learned_turns >= 15  # every reply of every conversation: the test means something


# Qwen3's published template, less its tool branches: the last turn after the last user
# message gets an (empty) <think> block, earlier ones not.
QWEN3_THINKING = "".join([
    "{%- set ns = namespace(last_query_index=messages|length - 1) %}",
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}",
    "{%- if message.role == 'user' and ns.last_query_index == messages|length - 1 %}",
    "{%- set ns.last_query_index = index %}{%- endif %}{%- endfor %}",
    "{%- for message in messages %}{%- set content = message.content %}",
    "{%- if message.role == 'user' or message.role == 'system' %}",
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}",
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}",
    "{%- if '</think>' in content %}",
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}",
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}",
    "{%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}",
    "{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
    "'\\n</think>\\n\\n' + content.lstrip('\\n') }}",
    "{%- else %}{{- '<|im_start|>' + message.role + '\\n' + content }}{%- endif %}",
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}",
])


def test_qwen3s_thinking_template_is_refused_where_turns_render_differently(tmp_path: Path):
    """Rendered alone, a turn is the last and gets the <think> block; in a longer
    conversation it does not. Its assistant turns cannot be found prefix by prefix: one
    line, never a guessed mask."""
    from tessel.data.chat_template import ChatTemplate
    from tessel.errors import DataError

    template = ChatTemplate(QWEN3_THINKING, "qwen3.jinja", "", "<|im_end|>")
    one_turn = edge_conversations()[0]
    text, spans = assistant_spans(template, one_turn)
    assert "<think>\n\n</think>\n\n" in text and len(spans) == 1
    two_turns = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4."},
                 {"role": "user", "content": "and 3+3?"}, {"role": "assistant", "content": "6."}]
    with pytest.raises(DataError, match="does not render this conversation prefix by prefix"):
        assistant_spans(template, two_turns)


HF_MODELS = {"qwen2": ("Qwen2Config", "Qwen2ForCausalLM"),
             "qwen3": ("Qwen3Config", "Qwen3ForCausalLM"),
             "olmo2": ("Olmo2Config", "Olmo2ForCausalLM")}


@pytest.mark.parametrize("family", FAMILIES)
def test_fine_tuning_the_familys_model_with_its_own_template(family, tmp_path: Path):
    """`tessel train` with data.source = "sft" from a tiny model of the family written as a
    Hub directory is (weights, tokenizer, its template), data.chat_template = "auto": the
    template is the model's own, only reply tokens are learned, and the export written
    during training is the family's class, carries the template and computes tessel's
    logits."""
    import torch
    import transformers

    from tessel.cli import main
    from tessel.generate import load_run_for_inference
    from tessel.observe.metrics import read_metrics

    path = model_dir(tmp_path / "hf", family)
    tok = load_tokenizer(path / "tokenizer.json")
    eos = tok.hf.token_to_id(FAMILIES[family][2])
    config_class, model_class = (getattr(transformers, n) for n in HF_MODELS[family])
    torch.manual_seed(0)
    model_class(config_class(
        vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        tie_word_embeddings=False, eos_token_id=eos, pad_token_id=eos)).save_pretrained(path)
    chats = tmp_path / "chats.jsonl"
    chats.write_text("".join(json.dumps({"messages": m}) + "\n"
                             for m in edge_conversations() * 4))
    run = tmp_path / "run"
    assert main(["train", f"--model.init_from={path}", "--data.source=sft",
                 f"--data.paths=['{chats}']", "--data.chat_template=auto", "--train.seq_len=64",
                 "--train.steps=2", "--train.micro_batch_size=2", "--train.global_batch_size=2",
                 "--train.eval_interval=0", "--train.eval_iters=1", "--data.split=100,0",
                 "--checkpoint.interval=2", "--checkpoint.hf_export_interval=2",
                 f"--run.dir={run}", f"--data.cache_dir={tmp_path / 'cache'}",
                 "--metrics.tensorboard=false", "--run.sample_tokens=0"]) == 0
    record = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r][-1]
    assert 0 < record["sft_learned_fraction"] < 0.5
    export = run / "checkpoints/step_00000002/hf"
    hf = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    assert type(hf) is model_class
    assert AutoTokenizer.from_pretrained(export).chat_template == FAMILIES[family][0].replace(
        "@@", "").replace("##", "")
    ours, _ = load_run_for_inference(run)
    x = torch.randint(0, tok.vocab_size, (2, 40))
    with torch.no_grad():
        theirs = hf(x).logits
        diff = (ours(x)[..., :tok.vocab_size] - theirs).abs().max() / theirs.abs().max()
    assert diff <= 1e-5
