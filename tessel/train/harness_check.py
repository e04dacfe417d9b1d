"""The lm_eval pre-flight: what would fail at the first benchmark scoring (possibly hours in)
refused before training, in one line.

- the layout (pipeline and context parallelism are not supported): a pure config check that
  the launchers (`tessel train --nproc`, `tessel launch`) make before starting any process;
- lm_eval installed, every task name known (its own tasks and those of
  `lm_eval.include_path`; a task YAML that cannot be parsed is named with its line, not
  reported as an unknown task);
- every task loaded (its data read) and one request built, as `simple_evaluate` will (the
  few-shot setting applied): a YAML without `doc_to_text`, a missing data file or an empty
  one fail here rather than at the end of the run; a generative task asking for more tokens
  than the model's context is refused too.
"""

from __future__ import annotations

import contextlib
import functools
import io
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.config import Config

_INSTALL = "pip install 'tessel[eval]'"


class LMEvalError(TesselError):
    """lm_eval cannot run as configured (not installed, unknown task, unsupported layout)."""


def require_lm_eval() -> Any:
    """The `lm_eval` module, or LMEvalError saying how to install it."""
    try:
        import lm_eval
    except ImportError:
        raise LMEvalError(f"lm_eval.tasks needs lm-evaluation-harness; {_INSTALL}") from None
    return lm_eval


@functools.lru_cache(maxsize=4)
def task_manager(include_path: str, defaults: bool = True) -> Any:
    """lm_eval's task index, with the task YAMLs of `include_path` (a directory) added;
    `defaults`: also lm_eval's own tasks (indexing them costs ~15 s of CPU)."""
    require_lm_eval()
    from lm_eval.tasks import TaskManager

    if include_path and not Path(include_path).is_dir():
        raise LMEvalError(f"lm_eval.include_path={include_path!r} is not a directory; name "
                          "the directory holding the task YAMLs")
    return TaskManager(include_path=include_path or None, include_defaults=defaults)


def check_lm_eval_layout(cfg: Config) -> None:
    """Refuse a layout the harness cannot score on (config only: no import, no disk)."""
    p = cfg.parallel
    # (Under context parallelism every cp rank scores the whole request: the model gets
    # whole sequences, no positions, so its attention exchanges nothing.)
    if cfg.lm_eval.enabled and p.pp > 1:
        raise LMEvalError(f"lm_eval.tasks does not run under parallel.pp={p.pp} yet (pipeline "
                          "parallelism); score an exported checkpoint with `lm_eval --model hf` "
                          "instead, or set lm_eval.tasks = []")


def check_lm_eval(cfg: Config) -> Any:
    """Refuse, before anything runs, what would fail at the first evaluation (see the module
    docstring). Returns the task manager (its index takes seconds to build), or None when
    lm_eval is off."""
    e = cfg.lm_eval
    if not e.enabled:
        return None
    check_lm_eval_layout(cfg)
    manager = _known(list(e.tasks), e.include_path)
    for name in e.tasks:
        _try_one_request(manager, name, cfg)
    return manager


def generation_limit(gen_kwargs: dict[str, Any], default: int, max_length: int
                     ) -> tuple[dict[str, Any], int]:
    """A generative request's settings normalised as lm_eval's `hf` model does, less
    `max_gen_toks`, and that limit; refused when the model's context cannot hold it."""
    from lm_eval.models.utils import normalize_gen_kwargs

    kwargs = dict(normalize_gen_kwargs(dict(gen_kwargs), default))
    limit = int(kwargs.pop("max_gen_toks"))
    if limit >= max_length:
        raise LMEvalError(f"a task asks for {limit} generated tokens but the model's context "
                          f"is {max_length}; lower its max_gen_toks (or lm_eval.max_gen_tokens)")
    return kwargs, limit


def describe_failure(exc: BaseException) -> str:
    """One line for an exception raised inside lm_eval: its type, its message's first line,
    and the function that raised it (lm_eval raises some without a message)."""
    lines = str(exc).strip().splitlines()
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (in {frames[-1].name})" if frames else ""
    return f"{type(exc).__name__}{': ' + lines[0][:300] if lines else ''}{where}"


# ---- task names --------------------------------------------------------------------------


def _known(tasks: list[str], include_path: str) -> Any:
    """The cheapest task index that knows every name of `tasks` (the local one when they are
    all local), or LMEvalError naming the unknown ones and any task file lm_eval skipped."""
    unreadable: list[tuple[Path, str, str]] = []
    if include_path:
        local = task_manager(include_path, defaults=False)
        missing = [t for t in tasks if t not in set(local.all_tasks)]
        if not missing:
            return local
        unreadable = _unreadable_yamls(Path(include_path))
        # A task whose own file cannot be parsed: say so now, without lm_eval's whole index.
        for path, problem, text in unreadable:
            named = [t for t in missing if t in text]
            if named:
                raise LMEvalError(
                    f"lm_eval.tasks: {', '.join(map(repr, named))} is not known because "
                    f"{path} cannot be parsed ({problem}) and lm_eval skips it; fix the file")
    manager = task_manager(include_path)
    unknown = [t for t in tasks if t not in set(manager.all_tasks)]
    if unknown:
        hint = (f" (neither lm_eval's own nor in {include_path!r})" if include_path else "")
        if unreadable:
            path, problem, _ = unreadable[0]
            hint += f"; lm_eval skipped {path}, which cannot be parsed ({problem})"
        raise LMEvalError(f"lm_eval.tasks: unknown task(s) {', '.join(map(repr, unknown))}{hint}; "
                          "`lm_eval ls tasks` lists them")
    return manager


def _unreadable_yamls(root: Path) -> list[tuple[Path, str, str]]:
    """(file, what is wrong and where, its text) of each task YAML under `root` (as lm_eval
    finds them) that is no YAML; lm_eval's index skips those without a word. Parsed as data
    only (`!function` kept as text: nothing is imported)."""
    import yaml

    class TaskYaml(yaml.SafeLoader):
        pass

    TaskYaml.add_constructor("!function", lambda loader, node: loader.construct_scalar(node))
    out = []
    for path in sorted(root.glob("**/*.yaml")):
        if "__pycache__" in path.parts or ".ipynb_checkpoints" in path.parts:
            continue
        text = ""
        try:
            text = path.read_text(encoding="utf-8")
            yaml.load(text, Loader=TaskYaml)  # noqa: S506 (a SafeLoader)
        except yaml.MarkedYAMLError as exc:
            # Where the parser gave up, and where what it was reading began (an unclosed
            # bracket is the line before the error).
            at = lambda mark: f"line {mark.line + 1}, column {mark.column + 1}"  # noqa: E731
            what = f"{exc.problem} at {at(exc.problem_mark)}" if exc.problem_mark else ""
            if exc.context and exc.context_mark:
                what = f"{exc.context} from {at(exc.context_mark)}: {what}"
            out.append((path, what or str(exc).splitlines()[0], text))
        except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
            out.append((path, str(exc).splitlines()[0] if str(exc) else type(exc).__name__,
                        text))
    return out


# ---- one request per task ------------------------------------------------------------------


def _try_one_request(manager: Any, name: str, cfg: Config) -> None:
    """Load task (or group) `name` as simple_evaluate will and build the request of its first
    example; LMEvalError naming the task, its file and what lm_eval raised otherwise."""
    e = cfg.lm_eval
    entry = manager.task_index.get(name)
    source = f" ({entry.yaml_path})" if entry is not None and entry.yaml_path else ""
    quiet = io.StringIO()  # progress bars (datasets', lm_eval's) and lm_eval's prints
    try:
        with contextlib.redirect_stderr(quiet), contextlib.redirect_stdout(quiet):
            tasks = list(manager.load([name])["tasks"].values())
            for task in tasks:
                # simple_evaluate's few-shot setting: ours unless the task fixes 0, else its own
                if e.num_fewshot is not None and task.get_config("num_fewshot") != 0:
                    task.set_config(key="num_fewshot", value=e.num_fewshot)
                elif task.get_config("num_fewshot") is None:
                    task.set_config(key="num_fewshot", value=0)
                task.set_fewshot_seed(seed=cfg.train.seed)
                task.build_all_requests(limit=1, rank=0, world_size=1)
        for task in tasks:
            for request in task.instances:
                if request.request_type == "generate_until":
                    generation_limit(request.args[1], e.max_gen_tokens, cfg.model.max_seq_len)
    except LMEvalError as exc:
        raise LMEvalError(f"lm_eval.tasks: task {name!r}{source}: {exc}") from None
    except Exception as exc:  # noqa: BLE001 (whatever a task file makes lm_eval raise)
        raise LMEvalError(f"lm_eval.tasks: task {name!r}{source} cannot be loaded: "
                          f"{describe_failure(exc)}; fix the task or remove it from "
                          "lm_eval.tasks") from None
