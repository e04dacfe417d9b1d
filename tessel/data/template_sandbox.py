"""The Jinja2 environment chat templates render in: transformers' sandbox, metered.

The environment is the one Hugging Face transformers renders `apply_chat_template` in (an
`ImmutableSandboxedEnvironment` with `trim_blocks` and `lstrip_blocks`, the loop-controls
extension, transformers' `tojson` filter and its `raise_exception`, `strftime_now`, `dict` and
`namespace` globals), so a template renders to the same text. A template comes from whoever
published the model: the sandbox keeps it from running their code, and a meter keeps it from
taking the machine (`tessel.data.template_meter` holds the limits and the meter,
`tessel.data.template_checks` the measures taken before a value is built). Each rendering
(`render`) has

- a time limit, `RENDER_SECONDS`, checked at every loop iteration and call (the only ways a
  template repeats anything), so a loop that writes nothing is stopped too; no signal or
  thread is involved, so it holds in any thread;
- a size limit, max(`MIN_TEXT`, `TEXT_FACTOR` x the characters of the conversation): no
  output, and no single string, list or printed value built on the way, may be longer. It is
  checked before the value is built: `'x' * 10**9`, `'x'|center(10**9)`, `'%0999999999d'`, a
  list of a million references to one long string printed or joined (a `+`, at most twice
  the limit, is checked once built);
- a budget: everything built during one rendering (strings, lists, output) adds up to at most
  `BUDGET_FACTOR` x the size limit, so a loop cannot keep many long strings alive either;
- at most `LOOP_FACTOR` x the size limit loop iterations in all;
- numbers of at most `MAX_INT_BITS` bits (`10 ** (10 ** 9)` would compute for hours),
  `range()` of at most 100,000 items (Jinja's own sandbox limit, as in transformers),
  `batch`, `slice` and `lipsum` counts of at most `MAX_ITEMS`, and Python's recursion limit.

Real templates (Llama 3, Qwen 2.5, ChatML, Mistral, Gemma) render a conversation in a fraction
of a millisecond per turn and build a few times its text, hundreds of times below the limits.
A template that goes past one, or fails in any other way (its own `raise_exception`, a
division by zero, a recursive macro, `MemoryError`), raises `TemplateFailure`, whose message
is one line.
"""

from __future__ import annotations

import functools
import json
import re
import reprlib
from datetime import datetime
from typing import Any

from tessel.data.template_checks import (
    check_call,
    check_count,
    check_multiply,
    check_power,
    digits_total,
    metered_filter,
    percent_size,
)
from tessel.data.template_meter import (
    LimitReached,
    MeteredIterable,
    add,
    concat,
    current,
    made,
    metering,
    strings_size,
    text_size,
)


class TemplateFailure(Exception):
    """A template did not parse (`parse` true), failed while rendering, or went past a
    limit; the message is one line."""

    def __init__(self, message: str, parse: bool = False):
        super().__init__(message)
        self.parse = parse


# ---- the environment ----------------------------------------------------------------------


def _raise_exception(message: Any) -> None:
    import jinja2

    raise jinja2.exceptions.TemplateError(message if isinstance(message, str)
                                          else _short_repr(message))


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: Any = None, sort_keys: bool = False) -> str:
    # transformers' own filter (Jinja's escapes HTML characters, which would change the
    # text models were trained on), encoded piece by piece so its size is checked as it grows
    meter = current()
    if isinstance(indent, int) and indent > 1000 or isinstance(indent, str) and len(indent) > 1000:
        raise LimitReached("tojson's indent is longer than the 1,000 characters tessel allows")
    encoder = json.JSONEncoder(ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                               sort_keys=sort_keys)
    pieces, size = [], 0
    for piece in encoder.iterencode(x):
        size += len(piece)
        meter.check(size, "the tojson output")
        pieces.append(piece)
    out = "".join(pieces)
    meter.charge(len(out))
    return out


def _strftime_now(fmt: str) -> str:
    meter = current()
    # CPython lets strftime's output grow to 256 x the format's length
    meter.check(256 * len(fmt) if isinstance(fmt, str) else 0, "the strftime_now() result")
    return datetime.now().strftime(fmt)


def _short_repr(value: Any) -> str:
    r = reprlib.Repr()
    r.maxstring = r.maxother = 200
    return r.repr(value)


def _generation() -> Any:
    """The `{% generation %}` extension (transformers' assistant-token mask), a no-op."""
    import jinja2.ext
    import jinja2.nodes as nodes

    class Generation(jinja2.ext.Extension):
        # `{% generation %}...{% endgeneration %}` marks assistant text in some templates
        # (transformers' assistant-token mask); it renders its body unchanged. tessel finds
        # the assistant spans by rendering prefixes, which works for every template.
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller: Any) -> str:
            return caller()

    return Generation


def _template_globals() -> tuple[Any, Any]:
    """`dict` and `namespace` as transformers gives them to templates."""
    import jinja2
    import jinja2.utils

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

    return TemplateDict, TemplateNamespace


def _undefined() -> Any:
    """Jinja's Undefined, its message kept short."""
    import jinja2
    import jinja2.utils

    class Undefined(jinja2.Undefined):
        # Jinja's own, with its error message naming the missing key in at most a few
        # hundred characters (a key can be a tuple of a million long strings)
        __slots__ = ()

        @property
        def _undefined_message(self) -> str:
            if self._undefined_hint:
                return self._undefined_hint
            name = _short_repr(self._undefined_name)
            if self._undefined_obj is jinja2.utils.missing:
                return f"{name} is undefined"
            owner = jinja2.utils.object_type_repr(self._undefined_obj)
            if not isinstance(self._undefined_name, str):
                return f"{owner} has no element {name}"
            return f"{owner!r} has no attribute {name}"

    return Undefined


def _formatters() -> tuple[Any, Any]:
    """str.format's formatters, plain and for Markup, that check each field first."""
    from jinja2.sandbox import SandboxedFormatter
    from markupsafe import EscapeFormatter

    class Formatter(SandboxedFormatter):
        # str.format's fields: the width in a spec, and the value printed, checked first
        def format_field(self, value: Any, format_spec: str) -> Any:
            meter = current()
            meter.check(text_size(value, meter) + digits_total(format_spec), "a formatted field")
            out = super().format_field(value, format_spec)
            return made(out)

        def convert_field(self, value: Any, conversion: str | None) -> Any:
            meter = current()
            meter.check(text_size(value, meter), "a formatted field")
            return super().convert_field(value, conversion)

    class EscapeFieldFormatter(Formatter, EscapeFormatter):
        pass

    return Formatter, EscapeFieldFormatter


def _code_generator() -> Any:
    """Jinja's code generator with the meter called where Jinja's own code calls nothing."""
    import jinja2.nodes as nodes
    from jinja2.compiler import CodeGenerator, optimizeconst

    class Metered(CodeGenerator):
        # The generated code calls the meter where Jinja's own does not call the sandbox.

        def visit_For(self, node: Any, frame: Any) -> None:
            # every iteration passes the meter: a loop that writes nothing is stopped too
            node.iter = nodes.Call(nodes.EnvironmentAttribute("tessel_iterate"), [node.iter], [],
                                   None, None, lineno=node.iter.lineno)
            node.iter.set_environment(self.environment)
            super().visit_For(node, frame)

        def visit_Call(self, node: Any, frame: Any, forward_caller: bool = False) -> None:
            if isinstance(node.node, nodes.EnvironmentAttribute):  # ours (visit_For): direct
                self.write(f"environment.{node.node.name}(")
                self.visit(node.args[0], frame)
                self.write(")")
                return
            super().visit_Call(node, frame, forward_caller=forward_caller)

        @optimizeconst
        def visit_Concat(self, node: Any, frame: Any) -> None:
            # `a ~ b`: Jinja's join function, given to the meter with the pieces
            if frame.eval_ctx.volatile:
                join = "(markup_join if context.eval_ctx.volatile else str_join)"
            else:
                join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
            self.write(f"environment.tessel_concat({join}, (")
            for arg in node.nodes:
                self.visit(arg, frame)
                self.write(", ")
            self.write("))")

        def visit_Add(self, node: Any, frame: Any) -> None:
            # `a + b + c`, a chain as templates write them, is one call to the meter: the
            # sizes are checked before the text is built (a sandbox call_binop for every `+`
            # would cost real templates a third of their rendering time)
            terms = [node.right]
            while isinstance(node.left, nodes.Add):
                node = node.left
                terms.append(node.right)
            terms.append(node.left)
            self.write("environment.tessel_add((")
            for term in reversed(terms):
                self.visit(term, frame)
                self.write(", ")
            self.write("))")

        def visit_Getitem(self, node: Any, frame: Any) -> None:
            if not isinstance(node.arg, nodes.Slice):  # goes through the sandbox's getitem
                super().visit_Getitem(node, frame)
                return
            self.write("environment.tessel_made(")  # a slice is a copy
            super().visit_Getitem(node, frame)
            self.write(")")

    return Metered


def _environment_class() -> Any:
    """The sandbox (transformers' ImmutableSandboxedEnvironment), its operators, calls and
    str.format metered."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    from markupsafe import Markup

    Metered = _code_generator()
    Formatter, EscapeFieldFormatter = _formatters()

    class Environment(ImmutableSandboxedEnvironment):
        code_generator_class = Metered
        intercepted_binops = frozenset({"*", "%", "**"})

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            meter = current()
            if operator == "*":
                check_multiply(meter, left, right)
            elif operator == "**":
                check_power(left, right)
            elif operator == "%" and isinstance(left, str):
                size = percent_size(meter, left, right)
                meter.check(6 * size if isinstance(left, Markup) else size, "'%' formatting")
            out = self.binop_table[operator](left, right)
            return made(out)

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
            meter = current()
            meter.tick()
            args = check_call(meter, __obj, args, kwargs)
            out = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
            return made(out)

        def wrap_str_format(self, value: Any) -> Any:
            # Jinja's own, with the fields of str.format checked (Formatter above)
            wrapped = super().wrap_str_format(value)
            if wrapped is None:
                return None
            owner = value.__self__
            formatter = (EscapeFieldFormatter(self, escape=owner.escape)
                         if isinstance(owner, Markup) else Formatter(self))
            is_map = value.__name__ == "format_map"

            @functools.wraps(wrapped)
            def metered(*args: Any, **kwargs: Any) -> str:
                if is_map:
                    if kwargs or len(args) != 1:
                        return wrapped(*args, **kwargs)  # Jinja's own TypeError
                    args, kwargs = (), args[0]
                return type(owner)(formatter.vformat(owner, args, kwargs))

            return metered

        @staticmethod
        def tessel_iterate(iterable: Any) -> Any:
            return MeteredIterable(iterable)

        @staticmethod
        def tessel_concat(join: Any, pieces: tuple) -> Any:
            meter = current()
            meter.check(sum(text_size(p, meter) for p in pieces), "a concatenation ('~')")
            out = join(pieces)
            meter.charge(len(out))
            return out

        tessel_made = staticmethod(made)
        tessel_add = staticmethod(add)

    return Environment


@functools.lru_cache(maxsize=1)
def environment() -> Any:
    """The one metered sandbox (built on first use: jinja2 is imported only then)."""
    import jinja2
    import jinja2.ext
    import jinja2.utils

    TemplateDict, TemplateNamespace = _template_globals()

    def finalize(value: Any) -> Any:
        # every `{{ ... }}` is printed with str() after this: the text of a value that is not
        # a string yet is measured before it is made (strings are counted by `concat`)
        if type(value) is not str:
            meter = current()
            size = text_size(value, meter)
            meter.check(size, "a printed value")
            meter.charge(size)
        return value

    def lipsum(n: int = 5, html: bool = True, min: int = 20, max: int = 100) -> str:  # noqa: A002
        check_count(n * max if isinstance(n, int) and isinstance(max, int) else 0,
                    "lipsum() words:")
        return jinja2.utils.generate_lorem_ipsum(n, html, min, max)

    env = _environment_class()(trim_blocks=True, lstrip_blocks=True, undefined=_undefined(),
                               finalize=finalize,
                               extensions=[_generation(), jinja2.ext.loopcontrols])
    env.concat = concat  # joins the output, and the text of blocks and macros
    env.filters["tojson"] = _tojson
    env.filters = {name: metered_filter(name, f) for name, f in env.filters.items()}
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = TemplateDict()
    env.globals["namespace"] = TemplateNamespace
    env.globals["lipsum"] = lipsum
    return env


# ---- rendering ----------------------------------------------------------------------------

_SURROGATE = re.compile("[\ud800-\udfff]")


@functools.lru_cache(maxsize=16)
def _compile(source: str) -> Any:
    return environment().from_string(source)


def _one_line(exc: BaseException) -> str:
    text = str(exc)[:1000]
    return " ".join(text.split()) or type(exc).__name__


def render(source: str, variables: dict[str, Any]) -> str:
    """`source` rendered with `variables` under the limits for a conversation as long as the
    strings in `variables` (see the module docstring); `TemplateFailure` when it does not
    parse, fails, or goes past a limit."""
    parsed = False
    # compiling runs filters on constants: under the meter too
    with metering(lambda: strings_size(list(variables.values()))):
        try:
            template = _compile(source)
            parsed = True
            text = template.render(**variables)  # joined by `concat`: measured first
        except Exception as exc:  # whatever a template causes: 1/0, int('9' * 5000), a limit
            raise _failure(exc, parsed) from None
    if not text.isascii() and _SURROGATE.search(text):
        raise TemplateFailure("the rendered text is not valid Unicode (a lone surrogate such "
                              "as \\ud800, from the template or the messages)")
    return text


def _failure(exc: Exception, parsed: bool) -> TemplateFailure:
    """The one-line TemplateFailure for what a template raised."""
    from jinja2 import TemplateError

    if isinstance(exc, LimitReached):
        message = str(exc)
    elif isinstance(exc, RecursionError):
        message = ("it recursed too deeply (a macro or recursive loop that calls itself "
                   "without end?)" if parsed else "it nests too deeply")
    elif isinstance(exc, MemoryError):
        message = "it ran out of memory"
    elif isinstance(exc, TemplateError):  # its own raise_exception, a syntax error, ...
        message = _one_line(exc)
    else:
        message = f"{type(exc).__name__}: {_one_line(exc)}"
    return TemplateFailure(message, parse=not parsed)
