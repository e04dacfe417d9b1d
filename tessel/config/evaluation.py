"""The [lm_eval] section: benchmark scores through lm-evaluation-harness during training.

Only the shape of the settings is checked here (no disk, no import of lm_eval); whether the
tasks exist and load is checked before training starts (`tessel.train.harness_check`).
"""

from __future__ import annotations

from pydantic import Field, model_validator

from tessel.config.base import Section


class LMEvalConfig(Section):
    tasks: list[str] = Field(default_factory=list)
    """lm-evaluation-harness task (or group) names to score the model on, e.g. ["hellaswag",
    "arc_easy"], or tasks defined in `include_path`; empty: no benchmark scores. Needs `pip
    install 'tessel[eval]'`. Scores go to metrics.jsonl as `eval/<task>/<metric>`."""
    include_path: str = ""
    """A directory of extra task YAMLs (lm_eval's --include_path), e.g. local multiple-choice
    sets read from JSONL files; empty: lm_eval's own tasks only. A task YAML can run Python
    (`!function` imports a .py file beside it): name only task files you trust."""
    limit: int = Field(0, ge=0)
    """Examples per task (the first N of each); 0: all of them."""
    num_fewshot: int | None = Field(None, ge=0)
    """Few-shot examples put before each question; unset: each task's own default."""
    interval: int = Field(0, ge=0)
    """Score every N optimizer steps, and always at the end (0: only at the end)."""
    batch_size: int = Field(8, gt=0)
    """Requests (context + continuation) per forward pass."""
    max_gen_tokens: int = Field(256, gt=0)
    """Most tokens generated per request of generative tasks (generate_until), unless the
    task asks for fewer."""

    @model_validator(mode="after")
    def _check(self) -> LMEvalConfig:
        for name in self.tasks:
            if not name.strip():
                raise ValueError("lm_eval.tasks holds an empty name; list task names such as "
                                 '["arc_easy"]')
        if self.include_path and not self.tasks:
            raise ValueError("lm_eval.include_path is set but lm_eval.tasks is empty; name the "
                             "tasks to run")
        return self

    @property
    def enabled(self) -> bool:
        return bool(self.tasks)
