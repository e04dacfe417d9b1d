"""FP8 training (train.fp8, torchao's float8 linears emulated on CPU) under every layout,
against the single-process FP8 run, on CPU with gloo.

The same machinery as tests/distributed/test_layouts.py (worker.py runs the layouts of one
world size one after another in one torchrun job). Float8 casts are rounding steps of 1/8 to
1/16 of a value, so two runs whose float32 arithmetic differs in the last bit (a gradient
summed in another order) may round a few elements to neighbouring float8 values from then
on. Every layout computes each scale from the whole tensor one process scales (under
context parallelism the amax is reduced over the cp ranks). Each layout is held to the
tolerance of its class, measured (about 2x margin over the largest difference seen) and
explained in TOLERANCES:

- exact: nothing the casts see differs (pipeline stages; rowwise scales under ZeRO-3 and
  context parallelism): the usual float32 tolerances.
- rounding: the same scales, float32 noise in the sums (ZeRO's reduce-scatter, over dp x cp
  under context parallelism; tensor parallelism's partial sums) tipping a few float8
  roundings after the first steps.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from tessel.checkpoint.init_from import load_config
from tessel.train import Trainer

sys.path.insert(0, str(Path(__file__).parent))
from test_layouts import base, final_weights, job_output, torchrun, train_metrics  # noqa: E402

pytestmark = pytest.mark.slow

STEPS = 4
"""Steps of every run (the references checkpoint at 2 and 4; a resumed run starts at 3)."""
RECIPES = {"tw": "tensorwise", "rw": "rowwise"}
LAYOUTS_2 = {
    "zero3": {"parallel.zero": 3},
    "tp2_sp": {"parallel.tp": 2},  # sequence parallelism is on by default
    "pp2": {"parallel.pp": 2},
    "cp2": {"parallel.cp": 2},
}
LAYOUTS_4 = {"tp2_zero3": {"parallel.tp": 2, "parallel.zero": 3}}
# FP8 with ZeRO-2, the per-op checkpointing policy and the loss in 2 pieces (tensorwise:
# FSDP's float8 all-gather of the weights).
EXTRA_2 = {"tw_zero2_selective_chunked": {
    "train.fp8": "tensorwise", "parallel.zero": 2,
    "parallel.activation_checkpointing": "selective", "parallel.loss_chunks": 2}}

# (loss rel, grad-norm rel, val-loss rel, weight max abs, weight rel norm)
EXACT = (1e-5, 1e-4, 1e-5, 1e-4, 1e-4)
ROUNDING = (2e-4, 2e-2, 1e-3, 5e-3, 1e-2)
"""Largest seen: loss 2.5e-5, grad norm 4.3e-3, val 2.0e-4, weight 1.3e-3 (max), 5.1e-3 (rel)."""
TOLERANCES = {
    "tw_zero3": ROUNDING, "tw_tp2_sp": ROUNDING, "tw_pp2": EXACT, "tw_cp2": ROUNDING,
    "rw_zero3": EXACT, "rw_tp2_sp": ROUNDING, "rw_pp2": EXACT, "rw_cp2": EXACT,
    "tw_tp2_zero3": EXACT, "rw_tp2_zero3": ROUNDING,
    "tw_zero2_selective_chunked": ROUNDING, "tw_resumed_tp2": ROUNDING,
}


def fp8_run(root: Path, corpus: Path, name: str, **extra) -> dict:
    return base(root / name, corpus, **{"train.steps": STEPS, "checkpoint.interval": 0,
                                        "train.eval_interval": STEPS, **extra})


@pytest.fixture(scope="module")
def fp8_refs(refs, tmp_path_factory) -> dict[str, Path]:  # noqa: ANN001
    """The single-process FP8-emulated runs, one per recipe, shared by every layout."""
    root = tmp_path_factory.mktemp("fp8_refs")
    out = {}
    for short, recipe in RECIPES.items():
        overrides = fp8_run(root, refs["corpus"], short, **{"train.fp8": recipe,
                                                            "checkpoint.interval": 2})
        Trainer(load_config(None, overrides), console=False).train()
        out[short] = root / short
    return out


def assert_close_run(run: Path, ref: Path, tol: tuple, first_step: int = 1) -> None:
    """Losses and gradient norms of every step, the final validation loss and every final
    weight of `run` against `ref`, within `tol` (see TOLERANCES)."""
    loss_rel, gn_rel, val_rel, w_max, w_rel = tol
    got, got_vals = train_metrics(run)
    want, want_vals = train_metrics(ref)
    assert sorted(got) == list(range(first_step, STEPS + 1)), f"{run.name}: steps {sorted(got)}"
    for step in got:
        assert got[step]["loss"] == pytest.approx(want[step]["loss"], rel=loss_rel), (
            f"{run.name}: loss at step {step}: {got[step]['loss']} vs {want[step]['loss']}")
        assert got[step]["grad_norm"] == pytest.approx(want[step]["grad_norm"], rel=gn_rel), (
            f"{run.name}: grad norm at {step}: {got[step]['grad_norm']} vs {want[step]['grad_norm']}")
    assert got_vals[STEPS] == pytest.approx(want_vals[STEPS], rel=val_rel), f"{run.name}: val"
    w_got, w_want = final_weights(run), final_weights(ref, STEPS)
    assert w_got.keys() == w_want.keys()
    for name in w_want:
        diff = (w_got[name] - w_want[name]).abs()
        assert diff.max() < w_max, f"{run.name}: weight {name} differs by {diff.max():.2e}"
        rel = diff.norm() / w_want[name].norm()
        assert rel < w_rel, f"{run.name}: weight {name} differs by {rel:.2e} (relative norm)"


CHECKPOINTED = {"tw_zero3"}
"""Runs whose final checkpoint is read (exported to Hugging Face); the others keep their
final weights in memory (worker.py's `weights_in_memory`), compared all the same."""


def _runs(root: Path, corpus: Path, layouts: dict[str, dict]) -> list[dict]:
    return [{"overrides": fp8_run(root, corpus, f"{short}_{name}",
                                  **{"train.fp8": recipe, **layout}),
             "weights_in_memory": f"{short}_{name}" not in CHECKPOINTED}
            for short, recipe in RECIPES.items() for name, layout in layouts.items()]


@pytest.mark.budget(300)  # seconds on the reference machine: estimated
def test_fp8_two_process_layouts_match_the_single_process_fp8_run(refs, fp8_refs, tmp_path: Path):
    corpus = refs["corpus"]
    spec = {"runs": _runs(tmp_path, corpus, LAYOUTS_2)}
    spec["runs"] += [{"overrides": fp8_run(tmp_path, corpus, name, **extra),
                      "weights_in_memory": True} for name, extra in EXTRA_2.items()]
    # An FP8 checkpoint of one process (step 2), resumed under tp2 + sequence parallelism.
    resumed = fp8_run(tmp_path, corpus, "tw_resumed_tp2", **{"train.fp8": "tensorwise",
                                                             "parallel.tp": 2})
    spec["runs"].append({"overrides": resumed, "resume": True,
                         "copy_from": str(fp8_refs["tw"]), "copy_step": 2})
    proc = torchrun(2, spec, tmp_path)
    assert proc.returncode == 0, job_output(proc)
    for name, tol in TOLERANCES.items():
        if (tmp_path / name).exists():
            first = 3 if name == "tw_resumed_tp2" else 1
            assert_close_run(tmp_path / name, fp8_refs[name[:2]], tol, first)
    assert_exports_plain_weights(tmp_path / "tw_zero3", tmp_path / "hf")


def assert_exports_plain_weights(run: Path, out: Path) -> None:
    """An FP8 run's checkpoint (ZeRO-3, float8 all-gather) exports to Hugging Face as
    ordinary float32 weights, the checkpoint's own values."""
    from safetensors.torch import load_file

    from tessel.cli import main

    assert main(["convert", "tessel-to-hf", str(run), str(out)]) == 0
    hf: dict[str, torch.Tensor] = {}
    for f in sorted(out.glob("*.safetensors")):
        hf.update(load_file(f))
    weights = final_weights(run)
    assert all(t.dtype == torch.float32 for t in hf.values())
    assert torch.equal(hf["model.layers.0.self_attn.o_proj.weight"],
                       weights["layers.0.attention.wo.weight"])
    assert torch.equal(hf["model.layers.1.mlp.down_proj.weight"],
                       weights["layers.1.feed_forward.w2.weight"])


@pytest.mark.budget(300)  # seconds on the reference machine: estimated
def test_fp8_tp2_zero3_dp2_matches_the_single_process_fp8_run(refs, fp8_refs, tmp_path: Path):
    proc = torchrun(4, {"runs": _runs(tmp_path, refs["corpus"], LAYOUTS_4)}, tmp_path)
    assert proc.returncode == 0, job_output(proc)
    for short in RECIPES:
        name = f"{short}_tp2_zero3"
        assert_close_run(tmp_path / name, fp8_refs[short], TOLERANCES[name])
