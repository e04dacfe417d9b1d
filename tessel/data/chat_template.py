"""Chat templates: a conversation rendered to the text a model was fine-tuned on.

A template is Jinja2 text, the model's own (`chat_template` in the `tokenizer_config.json` or
`chat_template.jinja` beside its `tokenizer.json`), one of the built-ins below, or a `.jinja`
file. It is rendered exactly as Hugging Face transformers renders it
(`PreTrainedTokenizerBase.apply_chat_template`): an `ImmutableSandboxedEnvironment` with
`trim_blocks` and `lstrip_blocks`, the loop-controls extension, transformers' `tojson`
filter and the `raise_exception` and `strftime_now` globals, with `messages`,
`add_generation_prompt`, `bos_token` and `eos_token` as variables. The sandbox matters: a
template comes from whoever published the model, and rendering it must not run their code.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from tessel.errors import DataError

BUILTIN_TEMPLATES: dict[str, str] = {
    # ChatML (Qwen, many others): <|im_start|>role\ncontent<|im_end|>\n per message.
    "chatml": (
        "{% for message in messages %}"
        "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
        "{% endfor %}"
        "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    ),
    # Prompt/completion with nothing around it: the prompt text, then the completion ended
    # by the end-of-sequence token (a system message, if any, comes first as plain text).
    "plain": (
        "{% for message in messages %}"
        "{{ message['content'] }}"
        "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}"
        "{% endfor %}"
    ),
}
"""Templates for models without their own (`data.chat_template = "chatml"` or `"plain"`)."""


@dataclass(frozen=True)
class ChatTemplate:
    """A template's source, where it came from, and the special-token strings it sees."""

    source: str
    """The Jinja2 text."""
    origin: str
    """Where it came from, for messages ("chatml", "tokenizer_config.json", a path)."""
    bos_token: str = ""
    eos_token: str = ""

    def render(self, messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        """The text of `messages`; DataError (one line) when the template fails."""
        import jinja2

        try:
            return _compile(self.source).render(
                messages=messages, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token, eos_token=self.eos_token, tools=None, documents=None)
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            # a template's own raise_exception, or one that does not fit these messages
            msg = " ".join(str(exc).split())
            raise DataError(f"chat template ({self.origin}) failed to render: {msg}") from None


def _raise_exception(message: str) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' own filter: Jinja's built-in one escapes HTML characters, which would
    # change the text models were trained on.
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=1)
def _environment() -> Any:
    import jinja2
    import jinja2.ext
    import jinja2.utils
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text in some templates
        # (transformers' assistant-token mask); it renders its body unchanged. tessel finds
        # the assistant spans by rendering prefixes, which works for every template.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    class TemplateDict:
        # as transformers: `dict(...)` without attribute access to the type itself
        def __call__(self, *args: Any, **kwargs: Any) -> dict:
            return dict(*args, **kwargs)

        def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
            return dict.fromkeys(*args, **kwargs)

    class TemplateNamespace(jinja2.utils.Namespace):
        # as transformers: namespaces refuse underscore names (no path to CPython internals)
        def __init__(*args: Any, **kwargs: Any) -> None:
            self, args = args[0], args[1:]
            attrs = dict(*args, **kwargs)
            for name in attrs:
                TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__init__(self, attrs)

        def __setitem__(self, name: str, value: Any) -> None:
            TemplateNamespace._check_name(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check_name(name: Any) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(
                    f"chat templates cannot store underscore names on a namespace ({name!r})")

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    return env


@lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    import jinja2

    try:
        return _environment().from_string(source)
    except jinja2.TemplateError as exc:
        msg = " ".join(str(exc).split())
        raise DataError(f"chat template does not parse: {msg}") from None


def _token_text(value: Any) -> str:
    if isinstance(value, dict):  # {"content": "</s>", ...}, as tokenizer_config.json may write
        value = value.get("content")
    return value if isinstance(value, str) else ""


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: cannot be read as JSON ({exc})") from None
    return data if isinstance(data, dict) else {}


def model_template(directory: Path) -> str | None:
    """The model's own template from the tokenizer files in `directory`, or None.

    `chat_template.jinja` (transformers >= 4.50 writes it) wins over tokenizer_config.json's
    `chat_template`, which is a string or a list of {name, template} (the "default" one is
    taken), as transformers reads them.
    """
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    cfg_file = directory / "tokenizer_config.json"
    if not cfg_file.is_file():
        return None
    value = _read_json(cfg_file).get("chat_template")
    if isinstance(value, list):
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, dict)}
        value = named.get("default")
    return value if isinstance(value, str) and value else None


def special_tokens(directory: Path | None) -> tuple[str, str]:
    """(bos_token, eos_token) strings from `directory`'s tokenizer_config.json, or empty."""
    if directory is None or not (directory / "tokenizer_config.json").is_file():
        return "", ""
    cfg = _read_json(directory / "tokenizer_config.json")
    return _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token"))


def resolve_template(spec: str, tokenizer_dir: Path | None, eos_fallback: str = "") -> ChatTemplate:
    """The template `data.chat_template` names: "auto" (the model's own, found beside its
    tokenizer, else ChatML, said in the origin), a built-in name, or a `.jinja` file path.
    `eos_fallback`: the tokenizer's end-of-document token, for `eos_token` when no
    tokenizer_config.json names one."""
    bos, eos = special_tokens(tokenizer_dir)
    eos = eos or eos_fallback
    if spec == "auto":
        own = model_template(tokenizer_dir) if tokenizer_dir is not None else None
        if own is not None:
            return ChatTemplate(own, f"the model's own, {tokenizer_dir}", bos, eos)
        return ChatTemplate(BUILTIN_TEMPLATES["chatml"], "chatml (the model has none)", bos, eos)
    if spec in BUILTIN_TEMPLATES:
        return ChatTemplate(BUILTIN_TEMPLATES[spec], spec, bos, eos)
    path = Path(spec)
    if not path.is_file():
        raise DataError(f"data.chat_template={spec!r} is neither a built-in template "
                        f"({', '.join(BUILTIN_TEMPLATES)}), \"auto\", nor a .jinja file")
    return ChatTemplate(path.read_text(encoding="utf-8"), str(path), bos, eos)
