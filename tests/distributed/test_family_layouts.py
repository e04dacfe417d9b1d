"""The decoder's Qwen2 / OLMo 2 features under every kind of parallelism, against the
single-process run on CPU with gloo: q/k/v biases (model.qkv_bias), QK-norm over each whole
projection (model.qk_norm_scope = "projection", split over the tp ranks with the projection's
columns) and norms after the sub-layers (model.norm_placement = "post"), all on in one
model, with heads of their own width (q_proj 64 -> 96). One reference, four layouts in one
2-process job: tp2 with sequence parallelism, ZeRO-3 over dp2, pp2 and cp2; the planner's
parameter and activation memory checked against what the ranks held and saved. (Per-head
QK-norm, Qwen3's, is in test_layouts.py's qk_ layouts.)"""

from __future__ import annotations

from pathlib import Path

import pytest
from test_layouts import (
    SHORT,
    assert_planner_memory_matches,
    assert_same_run,
    base,
    job_output,
    torchrun,
)

from tessel.checkpoint.init_from import load_config
from tessel.train import Trainer

pytestmark = pytest.mark.slow

FAMILY = {"model.qkv_bias": True, "model.qk_norm": True, "model.qk_norm_scope": "projection",
          "model.norm_placement": "post", "model.head_dim": 24}
LAYOUTS = {
    "family_tp2_sp": {"parallel.tp": 2, "parallel.sequence_parallel": True},
    "family_zero3": {"parallel.zero": 3},
    "family_pp2": {"parallel.pp": 2},
    "family_cp2": {"parallel.cp": 2},
}
# SHORT steps, a checkpoint (and the validation loss) at the last: what assert_same_run reads
# (of the layouts, their final weights kept in memory: worker.py's `weights_in_memory`).
RUN = {"train.steps": SHORT, "checkpoint.interval": SHORT, "train.eval_interval": SHORT}


def test_qwen2_and_olmo2_features_train_alike_in_every_layout(refs, tmp_path: Path):
    corpus = refs["corpus"]
    reference = tmp_path / "family_reference"
    Trainer(load_config(None, base(reference, corpus, **FAMILY, **RUN)), console=False).train()
    spec = {"runs": [{"overrides": base(tmp_path / name, corpus, **FAMILY, **RUN, **layout),
                      "weights_in_memory": True} for name, layout in LAYOUTS.items()],
            "measure_memory": True}
    proc = torchrun(2, spec, tmp_path)
    assert proc.returncode == 0, job_output(proc)
    for name in LAYOUTS:
        assert_same_run(tmp_path / name, reference)
        assert_planner_memory_matches(tmp_path / name, 2)
