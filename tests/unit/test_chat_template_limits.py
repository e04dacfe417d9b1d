"""Chat templates are someone else's files: one that loops forever, builds gigabytes or fails
in any way is refused in one line naming it (`tessel.data.template_sandbox`), while real
templates render exactly as transformers renders them; and a model's tokenizer_config.json
`chat_template` is read as transformers reads it, a malformed one refused, not replaced.

The limits are set low here (`tight`, `quick`), so that a template that goes past them is
stopped in a fraction of a second, and each is sized so that, were it not stopped, it would
still end within seconds and a few tens of MB, failing the test instead of hanging or
exhausting the machine."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tessel.data.chat_template import BUILTIN_TEMPLATES, ChatTemplate, resolve_template
from tessel.errors import DataError

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
# Gemma's and Mistral-7B-Instruct-v0.1's templates, verbatim: roles checked with
# raise_exception, `| trim`, loop.index0, bos/eos tokens.
GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not "
    "supported') }}{% endif %}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if (message['role'] == 'assistant') %}"
    "{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}"
    "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}"
)
MISTRAL = (
    "{{ bos_token }}{% for message in messages %}{% if (message['role'] == 'user') != "
    "(loop.index0 % 2 == 0) %}{{ raise_exception('Conversation roles must alternate "
    "user/assistant/user/assistant/...') }}{% endif %}{% if message['role'] == 'user' %}"
    "{{ '[INST] ' + message['content'] + ' [/INST]' }}{% elif message['role'] == 'assistant' %}"
    "{{ message['content'] + eos_token}}{% else %}{{ raise_exception('Only user and assistant "
    "roles are supported!') }}{% endif %}{% endfor %}"
)
# A template that also uses what the limits meter: namespace, tojson, macros, loop.last,
# a recursive loop, str.format, filters on lists.
BUSY = (
    "{% set ns = namespace(n=0, sys='') %}{% macro turn(m) %}<{{ m.role }}>{{ m.content }}"
    "</{{ m.role }}>{% endmacro %}{% for m in messages %}{% set ns.n = ns.n + 1 %}"
    "{{ turn(m) }}{% if loop.last %}{{ '[{}|{}]'.format(ns.n, messages|map(attribute='role')"
    "|join(',')) }}{{ messages[-1:]|tojson(indent=2) }}{% endif %}{% endfor %}"
    "{% for x in [[1, [2]], 3] recursive %}{% if x is iterable %}{{ loop(x) }}{% else %}{{ x }}"
    "{% endif %}{% endfor %}{{ ('%s:%d' % ('n', 5)) ~ ('ab' * 3) ~ 2 ** 10 }}"
)


def transformers_render(template: str, messages: list, gen: bool = False) -> str:
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    t = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>")),
                                bos_token="<s>", eos_token="</s>")
    return t.apply_chat_template(messages, chat_template=template, tokenize=False,
                                 add_generation_prompt=gen)


@pytest.fixture
def tight(monkeypatch):
    """Low limits: 20,000 characters per rendering (budget 320,000; 40,000 loop iterations)."""
    import tessel.data.template_meter as meter

    monkeypatch.setattr(meter, "MIN_TEXT", 20_000)


@pytest.fixture
def quick(monkeypatch):
    """A low time limit: 0.05 s per rendering (the loops below need seconds)."""
    import tessel.data.template_meter as meter

    monkeypatch.setattr(meter, "RENDER_SECONDS", 0.05)


def refused(source: str, messages: list = CHAT) -> str:
    """The one-line error of rendering `source`."""
    with pytest.raises(DataError) as info:
        ChatTemplate(source, "hostile.jinja", "<s>", "</s>").render(messages)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("chat template (hostile.jinja) "), msg
    return msg


@pytest.mark.parametrize("name", ["gemma", "mistral", "busy", "chatml"])
def test_real_templates_render_as_transformers_within_the_limits(name):
    source = {"gemma": GEMMA, "mistral": MISTRAL, "busy": BUSY,
              "chatml": BUILTIN_TEMPLATES["chatml"]}[name]
    template = ChatTemplate(source, name, "<s>", "</s>")
    conv = [m for i in range(3) for m in ({"role": "user", "content": f"  question {i} "},
                                          {"role": "assistant", "content": f"answer {i}"})]
    for gen in (False, True):
        assert template.render(conv, gen) == transformers_render(source, conv, gen)


def test_a_long_conversation_gets_limits_as_long_as_it_is(tight):
    """A conversation past the size floor (20,000 characters here, 4 Mi by default) is not
    refused: its limits grow with it (8x its text), and it renders as transformers does."""
    conv = [{"role": "user", "content": "word " * 20_000},
            {"role": "assistant", "content": "reply " * 20_000}]
    for source in (MISTRAL, BUILTIN_TEMPLATES["chatml"], BUSY):
        got = ChatTemplate(source, "long", "<s>", "</s>").render(conv)
        assert len(got) > 200_000 and got == transformers_render(source, conv)


@pytest.mark.parametrize("source", [
    # nested loops: 9 million iterations, seconds without a limit, with nothing written
    "{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}",
    "{% set r = range(3000)|list %}{% for i in r %}{% for j in r %}{% endfor %}{% endfor %}",
    # ... collected in a block that is never printed
    "{% set x %}{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}{% endfor %}"
    "{% endset %}",
    # ... or in a recursive loop
    "{% for x in range(3000) recursive %}{% if loop.depth < 2 %}{{ loop(range(3000)) }}"
    "{% endif %}{% endfor %}",
])
def test_a_template_that_loops_too_long_is_stopped(quick, source):
    assert "took longer than 0.05 s" in refused(source)


def test_a_template_that_loops_too_often_is_stopped(tight):
    msg = refused("{% for i in range(300) %}{% for j in range(300) %}{% endfor %}{% endfor %}")
    assert "looped more than 40,000 times" in msg


def test_the_limits_hold_outside_the_main_thread(quick):
    """No signals: rendering in a worker thread (a data loader, a server) is bounded too."""
    errors: list[BaseException] = []

    def work() -> None:
        try:
            ChatTemplate("{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}"
                         "{% endfor %}", "t").render(CHAT)
        except DataError as exc:
            errors.append(exc)

    worker = threading.Thread(target=work)
    worker.start()
    worker.join()
    assert len(errors) == 1 and "took longer" in str(errors[0])


@pytest.mark.parametrize(("source", "needle"), [
    ("{{ 'x' * 10**7 }}", "a repetition ('*')"),
    ("{{ ['x'] * 10**7 }}", "a repetition ('*')"),
    ("{{ 'x'|center(10**7) }}", "centered text"),
    ("{{ 'x'.ljust(10**7) }}", "the ljust() result"),
    ("{{ '%010000000d' % 1 }}", "'%' formatting"),
    ("{{ '{:>10000000}'.format(1) }}", "a formatted field"),
    ("{{ ('ab' * 5000)|replace('', 'xy' * 50) }}", "replaced text"),
    ("{{ (1).to_bytes(10**7, 'big') }}", "the to_bytes() result"),
    # the references are cheap, their text is not
    ("{% set s = 'x' * 10000 %}{{ [s] * 1000 }}", "a printed value"),
    ("{% set s = 'x' * 10000 %}{{ ([s] * 1000)|join }}", "joined text"),
    ("{% set s = 'x' * 10000 %}{{ ''.join([s] * 1000) }}", "the join() result"),
    ("{% set s = 'x' * 10000 %}{{ ([s] * 1000)|tojson }}", "the tojson output"),
    ("{% set s = 'x' * 10000 %}{{ ([s] * 1000)|upper }}", "the upper filter"),
    ("{% set s = 'x' * 10000 %}{{ '%s' % ([s] * 1000,) }}", "'%' formatting"),
    ("{% set s = 'x' * 10000 %}{% for i in range(1000) %}{{ s }}{% endfor %}",
     "the rendered text"),
    ("{% set s = 'x' * 10000 %}{% set b %}{% for i in range(1000) %}{{ s }}{% endfor %}"
     "{% endset %}", "the rendered text"),
    # doubling (to 32 MB, if nothing stopped it)
    ("{% set ns = namespace(s='x') %}{% for i in range(25) %}{% set ns.s = ns.s + ns.s %}"
     "{% endfor %}", "a concatenation ('+') would be about 32,768 characters"),
    ("{% set ns = namespace(s='x') %}{% for i in range(25) %}{% set ns.s = ns.s ~ ns.s %}"
     "{% endfor %}", "a concatenation ('~') would be about 32,768 characters"),
    # many values alive at once, each within the limit
    ("{% set s = 'x' * 10000 %}{% set ns = namespace(l=[]) %}{% for i in range(1000) %}"
     "{% set ns.l = ns.l + [s|upper] %}{% endfor %}", "in all while rendering one conversation"),
    # numbers (10 ** (10 ** 9) would compute for hours)
    ("{{ 10 ** 100000 }}", "a number of about 332,193 bits"),
    ("{% set ns = namespace(x=3) %}{% for i in range(20) %}{% set ns.x = ns.x * ns.x %}"
     "{% endfor %}", "a number of about 103,8"),
    # counts
    ("{{ [1]|batch(10**7, 'x')|list }}", "a batch of 10,000,000"),
    ("{{ lipsum(1000, max=1000) }}", "lipsum() words"),
])
def test_a_template_that_builds_too_much_is_refused_before_it_does(tight, source, needle):
    assert needle in refused(source)


@pytest.mark.parametrize(("source", "needle"), [
    ("{{ range(10**9) }}", "OverflowError: Range too big"),
    ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
    ("{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}", "recursed too deeply"),
    ("{{ '\\ud800' }}", "not valid Unicode"),
    ("{{ messages[('a' * 1000,) * 1000].y }}", "list object has no element ('aaaa"),
    ("{{ raise_exception(['x' * 1000] * 1000) }}", "failed to render: ['xxxx"),
])
def test_template_errors_are_one_line(source, needle):
    msg = refused(source)
    assert needle in msg and len(msg) < 1200, msg


def test_memory_error_is_one_line(monkeypatch):
    import tessel.data.template_sandbox as sandbox

    def exhausted(value: str) -> str:
        raise MemoryError

    monkeypatch.setitem(sandbox.environment().filters, "upper", exhausted)
    assert "ran out of memory" in refused("{{ 'x'|upper }}")


def test_a_template_file_that_is_not_utf8_is_refused(tmp_path: Path):
    bad = tmp_path / "latin1.jinja"
    bad.write_bytes("{{ messages[0]['content'] }} caf\xe9".encode("latin-1"))
    with pytest.raises(DataError, match=r"latin1.jinja: a chat template must be UTF-8 text, "
                                        r"and byte 32 is not"):
        resolve_template(str(bad), None)
    (tmp_path / "chat_template.jinja").write_bytes(bad.read_bytes())
    with pytest.raises(DataError, match="chat_template.jinja: a chat template must be UTF-8"):
        resolve_template("auto", tmp_path)


def _config_dir(tmp_path: Path, chat_template) -> Path:
    from tokenizers import Tokenizer, models

    Tokenizer(models.WordLevel({"<unk>": 0}, "<unk>")).save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": chat_template, "eos_token": "</s>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return tmp_path


@pytest.mark.parametrize("value", [
    {"default": "D{{ messages[0]['content'] }}", "tool_use": "T"},
    [{"name": "default", "template": "first"}, {"name": "default", "template": "L{{ eos_token }}"}],
    [{"name": "rag", "template": "R"}, {"name": "default", "template": "N"}],
])
def test_named_chat_templates_are_read_as_transformers_reads_them(tmp_path: Path, value):
    from transformers import AutoTokenizer

    directory = _config_dir(tmp_path, value)
    ours = resolve_template("auto", directory)
    assert "the model's own" in ours.origin
    theirs = AutoTokenizer.from_pretrained(directory).apply_chat_template(CHAT, tokenize=False)
    assert ours.render(CHAT) == theirs


@pytest.mark.parametrize(("value", "needle"), [
    (5, "5 is neither text nor a list"),
    ([1, 2], "[1, 2] is neither text nor a list"),
    ([{"name": "default"}], "is neither text nor a list"),
    ({"tool_use": "T", "rag": "R"}, "templates named 'rag', 'tool_use' but none \"default\""),
    ([], "an empty list of templates, no \"default\""),
    ({"default": ["not", "text"]}, "its \"default\" template is a list, not text"),
])
def test_a_malformed_chat_template_is_refused_not_replaced_by_chatml(tmp_path: Path, value,
                                                                     needle):
    """transformers fails on each of these too; tessel said "the model has none" and
    trained with ChatML."""
    from transformers import AutoTokenizer

    directory = _config_dir(tmp_path, value)
    with pytest.raises(DataError) as info:
        resolve_template("auto", directory)
    msg = str(info.value)
    assert "tokenizer_config.json: chat_template is malformed" in msg and needle in msg, msg
    with pytest.raises(Exception):  # noqa: B017 (transformers' own errors differ by case)
        AutoTokenizer.from_pretrained(directory).apply_chat_template(CHAT, tokenize=False)


def test_ctrl_c_stops_a_rendering_at_once():
    """KeyboardInterrupt is not a template's failure: it goes through, whatever the template
    is doing (here: a loop that runs for seconds)."""
    import signal

    def interrupt(*_: object) -> None:
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    signal.setitimer(signal.ITIMER_REAL, 0.05)
    try:
        with pytest.raises(KeyboardInterrupt):
            ChatTemplate("{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}"
                         "{% endfor %}", "t").render(CHAT)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def test_generate_chat_refuses_what_training_refuses(tmp_path: Path, quick):
    """`tessel generate --chat` resolves and renders the template the same way: a malformed
    tokenizer_config.json is refused (it fell back to ChatML), a hanging template stopped."""
    from tessel.data.tokenizer import load_tokenizer
    from tessel.generate import chat_prompt, chat_template_for

    tok = load_tokenizer("bytes")
    directory = _config_dir(tmp_path, {"tool_use": "T"})
    with pytest.raises(DataError, match="chat_template is malformed"):
        chat_template_for(directory, None, tok)
    hang = ChatTemplate("{% for i in range(3000) %}{% for j in range(3000) %}{% endfor %}"
                        "{% endfor %}", "hang.jinja")
    with pytest.raises(DataError, match=r"chat template \(hang.jinja\) failed to render: it "
                                        r"took longer than 0.05 s"):
        chat_prompt(hang, tok, "hi")
