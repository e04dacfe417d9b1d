"""Measured scaling without training: the metrics arithmetic on hand-written metrics.jsonl
records, the overrides each point gets (through the real config loader), the one-line
errors, and the sweep's handling of commands that fail, die, hang or stop short (small
Python commands standing in for `tessel train`). The real sweep: tests/distributed/
test_scale_measure.py."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

from tessel.checkpoint.init_from import load_config
from tessel.errors import TesselError
from tessel.planner.calls import ring_bytes
from tessel.scaling import MeasuredPoint, measure_sweep
from tessel.scaling.gloo import fit, measure_gloo
from tessel.scaling.measure import point_name, run_overrides
from tessel.scaling.points import error_line, summarize, with_efficiency

TINY = Path(__file__).resolve().parents[2] / "configs" / "tiny.toml"


def rec(step: int, tps: float, step_time: float, **extra) -> dict:
    return {"step": step, "loss": 5.0, "tokens_per_s": tps, "step_time_s": step_time,
            "time_data_s": 0.01, "time_compute_s": step_time * 0.8,
            "time_optimizer_s": step_time * 0.1, **extra}


def test_summary_covers_the_timed_steps_only_as_tokens_over_time():
    records = [
        rec(1, 10.0, 9.0), rec(2, 10.0, 9.0),  # warm-up: left out
        rec(3, 1000.0, 1.0), rec(4, 3000.0, 0.5, time_comm_exposed_s=0.2, time_comm_s=0.3),
        {"step": 4, "val_loss": 5.1},  # a validation record of the same step
        rec(5, 2000.0, 0.5),
        rec(6, 9e9, 0.1),  # past warmup + steps
    ]
    got = summarize(records, warmup=2, steps=3, nproc=2)
    # Step 4 was profiled for its communication (slower than the others): the throughput,
    # step time and split are the unprofiled steps' (3 and 5). Tokens: 1000*1 + 2000*0.5 =
    # 2000 in 1.5 s (the mean of the rates would be 1500).
    assert got["tokens_per_s"] == pytest.approx(2000 / 1.5)
    assert got["tokens_per_s_per_process"] == pytest.approx(1000 / 1.5)
    assert got["timed_steps"] == 3
    assert got["step_time_s"] == pytest.approx(0.75)
    assert got["split"] == pytest.approx({"data": 0.01, "compute": 0.8 * 0.75,
                                          "optimizer": 0.1 * 0.75})
    # exposed communication: the mean over the steps that measured it (sampled steps)
    assert got["comm_exposed_s"] == pytest.approx(0.2)
    assert got["comm_s"] == pytest.approx(0.3)
    # a sweep's run: its profiled steps after the timed ones (steps 6-7 of `profiled` 2),
    # not past them (step 8)
    after = summarize([rec(1, 1000.0, 1.0), rec(2, 3000.0, 0.5),
                       rec(3, 10.0, 2.0, time_comm_exposed_s=0.1, time_comm_s=0.2),
                       rec(4, 10.0, 2.0, time_comm_exposed_s=0.3, time_comm_s=0.4),
                       rec(5, 10.0, 2.0, time_comm_exposed_s=9.0)],
                      warmup=0, steps=2, nproc=1, profiled=2)
    assert after["tokens_per_s"] == pytest.approx(2500 / 1.5) and after["timed_steps"] == 2
    assert after["comm_exposed_s"] == pytest.approx(0.2)
    assert after["comm_s"] == pytest.approx(0.3)
    # with every step profiled, they are all there is
    every = summarize([rec(1, 1000.0, 1.0, time_comm_exposed_s=0.1),
                       rec(2, 3000.0, 0.5, time_comm_exposed_s=0.3)], warmup=0, steps=2, nproc=1)
    assert every["tokens_per_s"] == pytest.approx(2500 / 1.5)
    assert every["comm_exposed_s"] == pytest.approx(0.2)


def test_summary_skips_damaged_records_and_has_no_communication_without_the_field():
    records = [rec(1, 100.0, 1.0), {"step": 2, "loss": 1.0, "tokens_per_s": "fast",
                                    "step_time_s": 1.0},
               rec(3, float("nan"), 1.0), {"step": True, "tokens_per_s": 5.0, "step_time_s": 1.0},
               rec(4, 100.0, -1.0), rec(5, 400.0, 0.25, time_compute_s=float("inf"))]
    got = summarize(records, warmup=0, steps=5, nproc=1)
    assert got["timed_steps"] == 2  # steps 1 and 5
    assert got["tokens_per_s"] == pytest.approx(200 / 1.25)
    assert got["split"]["compute"] == pytest.approx(0.8)  # the infinite one is left out
    assert got["comm_exposed_s"] is None and got["comm_s"] is None
    assert summarize([], warmup=2, steps=3, nproc=1) == {"timed_steps": 0}


def point(nproc: int, tps: float | None, error: str | None = None, timed: int = 3) -> MeasuredPoint:
    return MeasuredPoint(nproc, {}, 16, f"run{nproc}", 3, timed_steps=timed if tps else 0,
                         tokens_per_s=tps, tokens_per_s_per_process=tps and tps / nproc,
                         error=error, exit_code=2 if error else 0)


def test_efficiency_is_per_process_throughput_against_the_first_point_that_ended_well():
    points = with_efficiency([point(1, None, "exit code 2"), point(2, 1000.0),
                              point(4, 1500.0), point(8, None, "killed")])
    assert [p.efficiency for p in points] == [None, 1.0, 0.75, None]
    # (tok/s_4 / tok/s_2) / (4 / 2) = 0.75 is the strong-scaling definition; under weak
    # scaling tokens per process per step are fixed, so the same ratio is step_2 / step_4
    assert with_efficiency([point(1, None, "bad")])[0].efficiency is None


def test_a_point_is_json_ready_and_says_when_it_is_short():
    p = point(2, 1000.0, timed=2)
    data = json.loads(json.dumps(p.as_dict()))
    assert data["short"] is True and data["ok"] is True and data["timed_steps"] == 2
    assert set(data) >= {"nproc", "layout", "tokens_per_s", "tokens_per_s_per_process",
                         "step_time_s", "split", "comm_exposed_s", "efficiency", "error"}
    assert not point(2, None, "exit code 2").ok


def test_the_error_line_is_tessels_own_not_torchruns_traceback():
    output = ("[W] torchrun warning\ntessel: error: parallel.tp=3 does not divide n_heads=4; "
              "use a divisor\nTraceback (most recent call last):\n  File x\n"
              "torch.distributed.elastic.multiprocessing.errors.ChildFailedError:\n"
              "  exitcode  : 2 (pid: 12)\n")
    assert error_line(output, 1) == ("parallel.tp=3 does not divide n_heads=4; use a divisor "
                                     "(exit code 1)")
    assert error_line("Traceback\n  exitcode  : -9 (pid: 7)\nnoise\n", 1).startswith(
        "exitcode  : -9 (pid: 7)")
    assert error_line("", 137) == "no output (killed by SIGKILL, exit code 137)"
    assert error_line("x" * 1000, 3).endswith("x (exit code 3)")
    assert len(error_line("x" * 1000, 3)) < 450


def test_overrides_keep_or_scale_the_batch_and_the_layout_wins(tmp_path: Path):
    user = ["--train.steps=999", "--parallel.tp=2", "--data.source=synthetic"]
    layout = {"parallel.tp": 1, "parallel.pp": "2", "parallel.pp_schedule": "interleaved-1f1b"}
    strong = load_config(TINY, user + run_overrides(16, 4, 2, 3, layout, True, tmp_path / "r"))
    weak = load_config(TINY, user + run_overrides(16, 4, 2, 3, layout, False, tmp_path / "r"))
    assert strong.train.global_batch_size == 16 and weak.train.global_batch_size == 64
    for cfg in (strong, weak):
        # 2 warm-up, 3 timed, then 4 with every other one profiled (its communication):
        # the timed steps run unprofiled
        assert cfg.train.steps == 9 and cfg.metrics.log_interval == 1
        assert (cfg.metrics.comm_sample_after, cfg.metrics.comm_sample_interval) == (5, 2)
        assert (cfg.train.eval_interval, cfg.checkpoint.interval, cfg.run.sample_tokens) == (0, 0, 0)
        assert cfg.lm_eval.tasks == [] and cfg.metrics.tensorboard is False
        assert (cfg.parallel.tp, cfg.parallel.pp) == (1, 2)
        assert cfg.parallel.pp_schedule == "interleaved-1f1b"
        assert cfg.run.dir == str(tmp_path / "r") and cfg.data.source == "synthetic"


@pytest.mark.parametrize("nprocs, message", [
    ([], "no process counts"), ([1, 0], "whole numbers >= 1"), ([2, 2], "repeat"),
    ([1.5], "whole numbers"),
])
def test_bad_process_counts_are_one_line_before_anything_runs(tmp_path: Path, nprocs, message):
    with pytest.raises(TesselError, match=message):
        measure_sweep(TINY, [], nprocs, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_sweep_never_overwrites_an_earlier_one(tmp_path: Path):
    (tmp_path / point_name(2)).mkdir()
    with pytest.raises(TesselError, match="exists"):
        measure_sweep(TINY, [], [1, 2], tmp_path)
    with pytest.raises(TesselError, match="does not exist"):
        measure_sweep(tmp_path / "missing.toml", [], [1], tmp_path / "new")
    with pytest.raises(TesselError, match="timed steps >= 1"):
        measure_sweep(TINY, [], [1], tmp_path / "new", steps=0)


# Stand-ins for `tessel train --nproc N`: each writes the metrics a run would, or fails.
_WRITE = ("import json, sys; from pathlib import Path; d = Path(sys.argv[1]); d.mkdir(); "
          "(d / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\\n' for r in {records}))")
FAKES = {
    1: _WRITE.format(records=[rec(s, 1000.0, 0.5) for s in (1, 2, 3, 4, 5)]),
    2: "import sys; print('noise', flush=True); print('tessel: error: the layout does not divide', "
       "file=sys.stderr); sys.exit(2)",
    3: "import os, signal; os.kill(os.getpid(), signal.SIGKILL)",
    4: _WRITE.format(records=[rec(s, 3000.0, 0.5) for s in (1, 2, 3, 4)]),  # one step short
    5: "import time; time.sleep(60)",
    6: _WRITE.format(records=[rec(1, 5.0, 1.0)]),  # exit 0, nothing past the warm-up
}


def test_a_failed_killed_hung_or_short_point_is_reported_and_the_sweep_goes_on(tmp_path: Path):
    out = tmp_path / "sweep"

    def command(n: int, args: list[str]) -> list[str]:
        assert f"--run.dir={json.dumps(str(out / point_name(n)))}" in args
        return [sys.executable, "-c", FAKES[n], str(out / point_name(n))]

    seen: list[int] = []
    points = measure_sweep(TINY, [], [1, 2, 3, 4, 6], out, warmup=2, steps=3,
                           command_for=command, on_point=lambda p: seen.append(p.nproc))
    assert seen == [1, 2, 3, 4, 6]
    one, two, three, four, six = points
    assert one.ok and one.tokens_per_s == 1000.0 and one.efficiency == 1.0 and not one.short
    assert two.error == "the layout does not divide (exit code 2)" and two.exit_code == 2
    assert three.error == "no output (killed by SIGKILL, exit code 137)"
    assert four.ok and four.short and four.timed_steps == 2
    assert four.efficiency == pytest.approx(3000.0 / 4 / 1000.0)
    assert six.error.startswith("no timed steps") and six.efficiency is None
    assert (out / "nproc-2.log").read_text().startswith("noise")
    # a run that hangs is stopped at the timeout (its own sweep: a short timeout for it alone)
    [five] = measure_sweep(TINY, [], [5], out, command_for=command, timeout_s=1)
    assert five.error == "timed out after 1 s; its processes were stopped"
    assert five.exit_code is None and not five.ok


def test_the_gloo_fit_recovers_latency_and_bandwidth():
    lat, bw = 2e-4, 5e8
    samples = [(b, lat + ring_bytes(b, 4, True) / bw) for b in (4096, 65536, 1 << 20)]
    got = fit(samples, 4)
    assert got["latency_s"] == pytest.approx(lat) and got["bandwidth_Bps"] == pytest.approx(bw)
    # noise that bends the line: what the samples show, never a negative figure
    got = fit([(4096, 1e-3), (1 << 20, 1e-4)], 2)
    assert got == {"latency_s": 1e-3, "bandwidth_Bps": pytest.approx((1 << 20) / 1e-4)}
    assert all(math.isfinite(v) and v > 0 for v in got.values())


def test_gloo_refuses_what_it_cannot_measure():
    with pytest.raises(TesselError, match="at least 2 processes"):
        measure_gloo(1)
    with pytest.raises(TesselError, match="two message sizes"):
        measure_gloo(2, sizes=[4096])


@pytest.mark.parametrize("preset", ["demo", "tiny-llama", "tiny-moe"])
def test_the_tensor_parallel_probe_times_the_configs_own_blocks(preset):
    """tessel.scaling.tp_cost times blocks of the config's own model (its width and
    operators are what cost time beyond a tp-th of the compute), dense (MoE layers are not
    split by tensor parallelism), with room for the micro-batch's positions."""
    from tessel.config import ModelConfig
    from tessel.models.transformer import Transformer
    from tessel.scaling.tp_cost import probe_model

    model = ModelConfig(preset=preset)
    probe = probe_model(model, layers=3, seq_len=4 * model.max_seq_len)
    assert probe.n_layers == 3 and probe.moe_experts == 0 and probe.dropout == 0.0
    assert probe.max_seq_len == 4 * model.max_seq_len and probe.init_from is None
    for field in ("d_model", "n_heads", "n_kv_heads", "ffn_hidden", "vocab_size", "norm", "mlp",
                  "position", "bias", "qk_norm", "tie_embeddings"):
        assert getattr(probe, field) == getattr(model, field)
    assert probe_model(model, 1, 8).max_seq_len == model.max_seq_len  # never shorter
    with torch.device("meta"):
        Transformer(probe)  # a valid model
    # a count that does not split the model: the nearest shape it does split
    for tp in (2, 4, 3):
        split = probe_model(model, 1, 100, tp)
        assert split.n_heads % tp == 0 and split.n_kv_heads % tp == 0
        assert split.n_heads % split.n_kv_heads == 0 and split.ffn_hidden % tp == 0
        assert split.padded_vocab_size % tp == 0 and split.max_seq_len >= 100
        assert split.n_heads // split.n_kv_heads == -(-model.n_heads // model.n_kv_heads)
        assert model.n_kv_heads <= split.n_kv_heads < model.n_kv_heads + tp
        assert split.d_model == model.d_model and split.head_dim == model.head_dim
        if model.n_heads % tp == 0 and model.n_kv_heads % tp == 0:
            assert (split.n_heads, split.n_kv_heads) == (model.n_heads, model.n_kv_heads)
        with torch.device("meta"):
            Transformer(split)