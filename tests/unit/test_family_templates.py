"""Mistral's and Gemma 3's own chat templates: tessel renders what transformers'
`apply_chat_template` renders, and learns exactly the tokens of its
`return_assistant_tokens_mask` (the templates with {% generation %} markers around the
reply and its end-of-turn token) on the conversations of test_sft, edge cases included."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_sft import edge_conversations, tok  # noqa: F401 (tok: the shared tokenizer fixture)
from tokenizers import Tokenizer as HFTokenizer
from transformers import PreTrainedTokenizerFast

from tessel.data.chat_template import ChatTemplate
from tessel.data.sft import assistant_spans, chat_encoder, encode_example
from tessel.errors import DataError

CHAT = Path(__file__).parents[1] / "data/chat"
# google/gemma-3-*-it's template, verbatim but for its image branch (text models only).
GEMMA3 = (CHAT / "gemma3.jinja").read_text()
GEMMA3_MARKED = GEMMA3.replace(
    """    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\\n' }}""",
    """    {%- if role == 'model' -%}{% generation %}{{- message['content'] | trim -}}
    {{ '<end_of_turn>' }}{% endgeneration %}{{ '\\n' }}
    {%- else -%}{{- message['content'] | trim -}}
    {{ '<end_of_turn>\\n' }}{%- endif -%}""")
# mistralai/Mistral-7B-Instruct-v0.3's template without its tool branches (the system message
# goes before the last user message only, as there).
MISTRAL = (CHAT / "mistral.jinja").read_text()
MISTRAL_MARKED = MISTRAL.replace(
    """        {{- " " + message["content"]|trim + eos_token}}""",
    """        {{- " " }}{% generation %}{{- message["content"]|trim + eos_token}}{% endgeneration %}""")
FAMILIES = {"gemma3": (GEMMA3, GEMMA3_MARKED), "mistral": (MISTRAL, MISTRAL_MARKED)}


def hf_tokenizer(tok, template: str) -> PreTrainedTokenizerFast:  # noqa: ANN001, F811
    t = PreTrainedTokenizerFast(tokenizer_object=HFTokenizer.from_str(tok.hf.to_str()),
                                bos_token="<|begin_of_text|>", eos_token="</s>")
    t.chat_template = template
    return t


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_templates_render_and_learn_as_transformers_marks(tok, family):  # noqa: F811
    template, marked = FAMILIES[family]
    ours = ChatTemplate(template, family, "<|begin_of_text|>", "</s>")
    plain, theirs = hf_tokenizer(tok, template), hf_tokenizer(tok, marked)
    encoder = chat_encoder(tok)
    for messages in edge_conversations():
        if family == "mistral" and messages[0]["role"] == "system":
            # Mistral's template writes the system message before the last user message
            # only when that message ends the conversation: a prefix renders what the whole
            # does not, so its assistant turns cannot be found; refused in one line.
            with pytest.raises(DataError, match="does not render this conversation prefix"):
                assistant_spans(ours, messages)
            continue
        text, spans = assistant_spans(ours, messages)
        assert text == plain.apply_chat_template(messages, tokenize=False)
        assert text == theirs.apply_chat_template(messages, tokenize=False)  # same rendering
        for gen in (False, True):
            assert ours.render(messages, add_generation_prompt=gen) == \
                plain.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
        want = theirs.apply_chat_template(messages, return_dict=True,
                                          return_assistant_tokens_mask=True)
        ex = encode_example(text, spans, encoder)
        assert ex.ids.tolist() == list(want["input_ids"])
        assert not ex.learned[0]
        assert ex.learned.astype(int).tolist()[1:] == list(want["assistant_masks"])[1:], text
