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
    """The cheapest task index that knows every name of `tasks` and every task their groups
    list (the local one when they are all local), or LMEvalError naming the unknown ones
    (a group's unknown member with the group) and any task file lm_eval skipped."""
    unreadable: list[tuple[Path, str, str]] = []
    if include_path:
        local = task_manager(include_path, defaults=False)
        missing, members = _unknown(local, tasks)
        if not missing and not members:
            return local
        unreadable = _unreadable_yamls(Path(include_path))
        # A task whose own file cannot be parsed: say so now, without lm_eval's whole index.
        for path, problem, text in unreadable:
            named = [t for t in missing + list(members) if t in text]
            if named:
                raise LMEvalError(
                    f"lm_eval.tasks: {', '.join(map(repr, named))} is not known because "
                    f"{path} cannot be parsed ({problem}) and lm_eval skips it; fix the file")
    manager = task_manager(include_path)
    unknown, members = _unknown(manager, tasks)
    hint = (f" (neither lm_eval's own nor in {include_path!r})" if include_path else "")
    if unreadable:
        path, problem, _ = unreadable[0]
        hint += f"; lm_eval skipped {path}, which cannot be parsed ({problem})"
    if unknown:
        raise LMEvalError(f"lm_eval.tasks: unknown task(s) {', '.join(map(repr, unknown))}{hint}; "
                          "`lm_eval ls tasks` lists them")
    if members:
        member, group = next(iter(members.items()))
        raise LMEvalError(
            f"lm_eval.tasks: group {group!r}{_source(manager, group)} lists task {member!r}, "
            f"which lm_eval does not know{hint}; fix the group's `task:` list "
            "(`lm_eval ls tasks` lists the tasks) or remove the group from lm_eval.tasks")
    return manager


def _unknown(manager: Any, tasks: list[str]) -> tuple[list[str], dict[str, str]]:
    """The names of `tasks` the index does not know, and the tasks their groups (and the
    groups in those) list that it does not know, each with the group listing it (lm_eval
    fails on those with "expected str ... not NoneType")."""
    index = manager.task_index
    members: dict[str, str] = {}
    for group in _reachable(manager, [t for t in tasks if t in index]):
        for item in _listed(index[group].cfg):
            if isinstance(item, str) and item not in index:
                members.setdefault(item, group)
    return [t for t in tasks if t not in index], members


def _listed(cfg: Any) -> list[Any]:
    """What a group's config lists under `task` ([] for a task's config)."""
    if not isinstance(cfg, dict) or "group" not in cfg:
        return []
    listed = cfg.get("task", [])
    return listed if isinstance(listed, list) else [listed]


def _reachable(manager: Any, names: list[str]) -> list[str]:
    """`names` and every indexed name their groups list, recursively, each once."""
    index, seen, stack = manager.task_index, [], list(names)
    while stack:
        name = stack.pop()
        if name in seen or name not in index:
            continue
        seen.append(name)
        stack += [t for t in _listed(index[name].cfg) if isinstance(t, str)]
    return seen


def _source(manager: Any, name: str) -> str:
    entry = manager.task_index.get(name)
    return f" ({entry.yaml_path})" if entry is not None and entry.yaml_path else ""


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


def _unknown_metrics(cfg: dict[str, Any]) -> list[str]:
    """The metrics a task's YAML names that lm_eval does not have: it looks them up by name
    unless the task computes its own (`process_results`) or asks Hugging Face `evaluate` for
    them (`hf_evaluate`)."""
    from lm_eval.api.registry import metric_registry

    if cfg.get("process_results") is not None or not isinstance(cfg.get("metric_list"), list):
        return []
    return [m["metric"] for m in cfg["metric_list"] if isinstance(m, dict)
            and isinstance(m.get("metric"), str) and not m.get("hf_evaluate")
            and not m["metric"].startswith("!function") and m["metric"] not in metric_registry]


def _no_metric(task: str, metric: str) -> str:
    from lm_eval.api.registry import metric_registry

    return (f"task {task!r} asks for metric {metric!r}, which lm_eval does not have (its "
            f"metrics: {', '.join(sorted(metric_registry))})")


def _data_files(cfg: dict[str, Any]) -> list[Path]:
    """The local files a task's config reads (`dataset_kwargs.data_files`: a path, a list, or
    split -> path or list)."""
    kwargs = cfg.get("dataset_kwargs")
    files = kwargs.get("data_files") if isinstance(kwargs, dict) else None
    values = list(files.values()) if isinstance(files, dict) else [files]
    paths = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return [Path(p) for p in paths if isinstance(p, str) and "://" not in p]


def _diagnosis(manager: Any, name: str) -> str | None:
    """What lm_eval's own error for a task (or group) that failed to load leaves unsaid
    (`KeyError: None`, `StopIteration`), when the task's config shows it: a metric lm_eval
    does not have, an empty data file. None otherwise."""
    index = manager.task_index
    for task in _reachable(manager, [name]):
        cfg = index[task].cfg
        if not isinstance(cfg, dict) or "group" in cfg:
            continue
        metrics = _unknown_metrics(cfg)
        if metrics:
            return _no_metric(task, metrics[0])
        for path in _data_files(cfg):
            try:
                empty = path.is_file() and not path.read_bytes().strip()
            except OSError:
                continue
            if empty:
                return f"task {task!r} reads {path}, which is empty (no records)"
    return None



def _try_one_request(manager: Any, name: str, cfg: Config) -> None:
    """Load task (or group) `name` as simple_evaluate will and build the request of its first
    example; LMEvalError naming the task, its file and what lm_eval raised otherwise."""
    e = cfg.lm_eval
    source = _source(manager, name)
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
                          f"{_diagnosis(manager, name) or describe_failure(exc)}; fix the task "
                          "or remove it from lm_eval.tasks") from None
    unknown = [(str(getattr(getattr(task, "config", None), "task", name)), m) for task in tasks
               for m in _metrics_not_found(task)]
    if unknown:  # lm_eval found no such metric and goes on: it would fail at the scoring
        task_name, metric = unknown[0]
        raise LMEvalError(f"lm_eval.tasks: task {name!r}{source}: "
                          f"{_no_metric(task_name, metric)}; fix the task or remove it from "
                          "lm_eval.tasks")


def _metrics_not_found(task: Any) -> list[str]:
    """The metrics of a loaded task that lm_eval found no function for (it says so in a log
    line and goes on; the scoring would then fail), unless the task computes its own."""
    functions = getattr(task, "_metric_fn_list", None)  # noqa: SLF001 (lm_eval keeps no other)
    if not isinstance(functions, dict) or \
            getattr(getattr(task, "config", None), "process_results", None) is not None:
        return []
    return [metric for metric, function in functions.items() if function is None]
