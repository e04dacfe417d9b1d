"""The planner's formulas against hand-computed cases and the real model, its search, its
hardware profiles and its outputs. (Memory against measurement: test_planner_memory.py and
tests/distributed; time against published runs: test_planner_validation.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tessel.config import Config, ModelConfig
from tessel.errors import TesselError
from tessel.models.transformer import Transformer, flops_per_token, param_count
from tessel.parallel.pipeline import split_model
from tessel.planner import hardware
from tessel.planner.compute import _size_efficiency, micro_batch_compute
from tessel.planner.layout import Layout
from tessel.planner.memory import (
    ADAM_BYTES,
    GIB,
    estimate_memory,
    in_flight,
    memory_by_rank,
    parameter_elements,
    peak_in_flight,
    pipeline_order,
    rank_parameters,
    stage_parameters,
)
from tessel.planner.prelaunch import check_memory, choose_layout
from tessel.planner.report import as_json
from tessel.planner.search import candidates, evaluate, search, trainer_refusal
from tessel.planner.speed import (
    EP_CALLS_EACH_WAY,
    _ring,
    all_to_all,
    estimate_step,
)

H100 = hardware.BUILTIN["h100-sxm"]


def layout(**kw) -> Layout:
    base = dict(dp_replicate=1, dp_shard=1, tp=1, pp=1, cp=1, zero=0, micro_batch=1)
    return Layout(**{**base, **kw})


def cfg(**overrides) -> Config:
    return Config.load(None, {"model.preset": "tiny-llama", "model.n_layers": 4,
                              "train.seq_len": 64, "train.global_batch_size": 16,
                              "train.micro_batch_size": 1, **overrides})


# ---- parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize("preset", ["tiny", "tiny-llama"])
@pytest.mark.parametrize("pp, virtual", [(1, 1), (2, 1), (2, 2)])
def test_stage_parameters_equal_the_pipeline_stages_tessel_builds(preset, pp, virtual):
    m = ModelConfig(preset=preset, n_layers=4, tie_embeddings=False)
    with torch.device("meta"):
        whole = Transformer(m)
    p = Config.load(None, {"model.preset": preset, "model.n_layers": 4,
                           "model.tie_embeddings": False, "parallel.pp": pp,
                           "parallel.pp_virtual_stages": virtual,
                           "parallel.pp_schedule": "interleaved-1f1b" if virtual > 1 else "1f1b"}
                    ).parallel
    n_stages = pp * virtual
    for rank in range(pp):
        stages = split_model(whole, p, rank) if pp > 1 else [(0, whole)]
        real = sum(t.numel() for _, s in stages for t in s.parameters())
        ids = [s for s, _ in stages]
        layers = sum(len(s.layers) for _, s in stages)
        assert stage_parameters(m, layers, 0 in ids, n_stages - 1 in ids, 1).total == real


def test_stage_parameters_under_tensor_parallelism_by_hand():
    # GPT shape, d 64, 4 heads, ffn 256, vocab 512, 256 positions, biases, LayerNorm.
    m = ModelConfig(preset="tiny", n_layers=1, tie_embeddings=False)
    d, f, v, t = 64, 256, 512, 256
    col = (3 * d * d + d * f) // 2 + (3 * d + f) // 2  # wq wk wv w1 weights and biases / tp
    row = (d * d + f * d) // 2 + 2 * d  # wo w2 weights / tp, their biases replicated
    norms = 2 * 2 * d  # two LayerNorms with bias
    block = col + row + norms
    root = v * d // 2 + t * d + 2 * d + v * d // 2  # embedding / tp, positions, final norm, head
    p = stage_parameters(m, 1, True, True, 2)
    assert (p.block, p.root, p.total) == (block, root, block + root)
    assert p.matmul == (4 * d * d + 2 * d * f) // 2 + v * d // 2


def test_stage_parameters_with_own_head_width_and_qk_norm():
    """Qwen3's attention: q_proj 64 -> 4 x 24 = 96, o_proj back, QK-norm weights of 24."""
    m = ModelConfig(preset="tiny-llama", n_layers=2, head_dim=24, qk_norm=True)
    with torch.device("meta"):
        real = sum(t.numel() for t in Transformer(m).parameters())
    assert stage_parameters(m, 2, True, True, 1).total == real
    d, q, kv, f, v = 64, 96, 2 * 24, 192, 512
    # tp 2: every matmul halves; the RMSNorms, QK-norm's included, are replicated.
    block = (d * q + 2 * d * kv + 2 * d * f + q * d + f * d) // 2 + 2 * d + 2 * 24
    assert stage_parameters(m, 2, True, True, 2).total == 2 * block + v * d // 2 + d + v * d // 2


# ---- memory ---------------------------------------------------------------------------------


def test_one_gpu_memory_by_hand():
    m = ModelConfig(preset="tiny-llama", n_layers=4)
    n = sum(t.numel() for t in Transformer(m).parameters())
    mem = estimate_memory(m, layout(), 64, 16, "fp32")
    assert (mem.parameters, mem.gradients, mem.optimizer) == (4 * n, 4 * n, ADAM_BYTES * n)
    assert mem.margin > 0 and mem.total == pytest.approx(mem.allocated + mem.margin)


def test_zero_stages_shard_what_they_promise():
    m = ModelConfig(preset="llama3-8b")
    per = {z: estimate_memory(m, layout(dp_shard=8, zero=z), 4096, 64, "bf16") for z in range(4)}
    n = stage_parameters(m, 32, True, True, 1).total
    assert per[0].optimizer == ADAM_BYTES * n
    for z in (1, 2, 3):
        assert per[z].optimizer == pytest.approx(ADAM_BYTES * n / 8, rel=1e-6)
    # ZeRO-1 accumulates unsharded gradients; ZeRO-2/3 keep only the shard.
    assert per[1].gradients == pytest.approx(4 * n + 4 * n / 8, rel=1e-6)
    assert per[2].gradients == per[3].gradients == pytest.approx(4 * n / 8, rel=1e-6)
    # ZeRO-3 does not keep the gathered parameters.
    assert per[3].parameters < per[2].parameters == per[1].parameters
    total = [per[z].parameters + per[z].gradients + per[z].optimizer for z in range(4)]
    assert total[3] < total[2] < total[1] < total[0]


def test_offload_moves_state_to_the_host():
    m = ModelConfig(preset="llama3-8b")
    lay = dict(dp_shard=8, zero=3)
    plain = estimate_memory(m, layout(**lay), 4096, 64, "bf16")
    opt = estimate_memory(m, layout(**lay, offload="optimizer"), 4096, 64, "bf16")
    params = estimate_memory(m, layout(**lay, offload="params"), 4096, 64, "bf16")
    assert opt.optimizer == 0 and opt.host > plain.optimizer and plain.host == 0
    assert params.optimizer == params.gradients == 0 and params.total < opt.total < plain.total


def test_activation_checkpointing_and_tensor_parallelism_shrink_activations():
    m = ModelConfig(preset="llama3-8b")
    acts = {ac: estimate_memory(m, layout(activation_checkpointing=ac), 4096, 8, "bf16").saved
            for ac in ("none", "selective", "full")}
    assert acts["full"] < acts["selective"] < acts["none"]
    tp = {t: estimate_memory(m, layout(tp=t), 4096, 8, "bf16").saved for t in (1, 2, 8)}
    assert tp[8] < tp[2] < tp[1]
    nosp = estimate_memory(m, layout(tp=8, sequence_parallel=False), 4096, 8, "bf16").saved
    assert tp[8] < nosp


def test_in_flight_micro_batches_per_schedule():
    assert in_flight(layout(pp=4), 0, 16) == 4  # 1F1B: pp - rank
    assert in_flight(layout(pp=4), 3, 16) == 1
    assert in_flight(layout(pp=4, pp_schedule="gpipe"), 2, 16) == 16
    assert in_flight(layout(pp=4), 0, 2) == 2  # fewer micro-batches than stages
    inter = layout(pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2)
    # PyTorch: warm-up (v-1) x pp + 2 (pp-1-rank) chunk forwards, then one more.
    assert in_flight(inter, 0, 4) == (2 + 2 + 1) / 2
    assert in_flight(inter, 1, 4) == (2 + 0 + 1) / 2


def test_peak_of_a_pipeline_order_by_hand():
    order = [("F", 0), ("F", 0), ("F", 2), ("B", 2), ("F", 2), ("B", 0), ("I", 2), ("W", 2)]
    assert peak_in_flight(order, {0: 1.0, 2: 10.0}) == 12.0
    # PyTorch's interleaved order for rank 1 of pp 2 x v 2 with 4 micro-batches.
    got = pipeline_order(layout(pp=2, pp_schedule="interleaved-1f1b", pp_virtual_stages=2), 1, 4)
    if got is not None:  # built from PyTorch's own schedule where this version allows it
        assert got[:4] == [("F", 1), ("F", 1), ("F", 3), ("B", 3)]
        assert sum(k == "F" for k, _ in got) == sum(k == "B" for k, _ in got) == 8


def test_the_busiest_pipeline_rank_is_reported():
    m = ModelConfig(preset="llama3-8b")
    lay = layout(pp=4, dp_shard=2, zero=1)
    ranks = memory_by_rank(m, lay, 4096, 64, "bf16")
    assert len(ranks) == 4
    assert ranks[0].saved > ranks[3].saved  # the first rank holds 4 micro-batches, the last 1
    assert estimate_memory(m, lay, 4096, 64, "bf16").total == max(r.total for r in ranks)


# ---- time -----------------------------------------------------------------------------------


def test_ring_collectives_and_matmul_size_by_hand():
    assert _ring(8e9, 8, 100e9, all_reduce=True) == pytest.approx(2 * 7 / 8 * 0.08)
    assert _ring(8e9, 8, 100e9, all_reduce=False) == pytest.approx(7 / 8 * 0.08)
    assert _ring(8e9, 1, 100e9, all_reduce=True) == 0
    assert _size_efficiency(128) == 0.5 and _size_efficiency(3968) == pytest.approx(0.96875)


def test_compute_time_by_hand():
    # One GELU block, d = ffn = 4096, 32 heads of 128, 4096 tokens, no head: six 4096 x 4096
    # matmuls at 4096/(4096+128) of the rate, and causal attention (half of 12 T^2 d) at
    # 128/(128+128) of it; forward + backward = 3 x 2 FLOPs per multiply-add.
    m = ModelConfig(preset="gpt3-1.3b", d_model=4096, n_heads=32, ffn_hidden=4096, n_layers=1)
    T, d = 4096, 4096
    rate = H100.bf16_flops * H100.matmul_efficiency
    matmuls = 6 * (6 * T * d * d) / (rate * 4096 / 4224)
    attention = (12 * T * T * d / 2) / (rate * 0.5)
    t, attn = micro_batch_compute(m, layout(micro_batch=1), H100, T, 1, False, H100.bf16_flops)
    assert attn == pytest.approx(attention, rel=1e-12)
    assert t == pytest.approx(matmuls + attention, rel=1e-12)


def test_step_time_parts_respond_to_the_layout():
    m = ModelConfig(preset="llama3-70b")
    base = estimate_step(m, layout(tp=8, dp_shard=8, zero=1), H100, 4096, 256, "bf16")
    assert base.tp_comm_s > 0 and base.bubble_s == 0 and base.pp_comm_s == 0
    piped = estimate_step(m, layout(tp=8, pp=4, dp_shard=2, zero=1), H100, 4096, 256, "bf16")
    assert piped.bubble_s > 0 and piped.pp_comm_s > 0
    # 1F1B's bubble: (pp - 1) x one micro-batch's compute and tensor-parallel time.
    m_batches = 256 // 2
    per_mb = (piped.compute_s + piped.tp_comm_s) / m_batches
    assert piped.bubble_s == pytest.approx(3 * per_mb)
    inter = estimate_step(m, layout(tp=8, pp=4, dp_shard=2, zero=1, pp_schedule="interleaved-1f1b",
                                    pp_virtual_stages=2), H100, 4096, 256, "bf16")
    assert inter.bubble_s == pytest.approx(piped.bubble_s / 2, rel=0.01)
    full = estimate_step(m, layout(tp=8, dp_shard=8, zero=1, activation_checkpointing="full"),
                         H100, 4096, 256, "bf16")
    assert full.compute_s == pytest.approx(base.compute_s * 4 / 3)


# ---- search ---------------------------------------------------------------------------------


def test_search_returns_valid_layouts_fastest_first_and_says_why_others_are_out():
    c = Config.load(None, {"model.preset": "llama3-70b", "train.seq_len": 4096,
                           "train.global_batch_size": 256, "train.micro_batch_size": 1})
    result = search(c, 64, H100, keep=5)
    assert result.plans and result.evaluated > 100
    speeds = [p.tokens_per_s for p in result.plans]
    # Fastest first; predictions within 0.5% tie (broken by less communication, less memory).
    assert all(a > b * 0.99 for a, b in zip(speeds, speeds[1:])), speeds
    assert speeds[0] > max(speeds) * 0.99
    for p in result.plans:
        assert p.fits and trainer_refusal(c, p.layout, full=True) is None
        assert p.layout.world == 64
    assert all(p.shortfall_gib > 0 for p in result.too_big)
    # Context parallelism is searched from 8K positions on (4,096 or more per rank).
    assert {lay.cp for lay in candidates(c, 64, H100)} == {1}
    longer = c.with_overrides({"model.max_seq_len": 16384, "train.seq_len": 16384})
    assert {lay.cp for lay in candidates(longer, 64, H100)} == {1, 2, 4}


def test_an_impossible_layout_is_explained_not_evaluated():
    c = cfg(**{"parallel.tp": 3})
    assert "not divisible by tp=3" in trainer_refusal(c, Layout.from_config(c, 3))


def test_auto_layout_and_the_memory_refusal():
    c = Config.load(None, {"model.preset": "llama3-8b", "train.seq_len": 4096,
                           "train.global_batch_size": 64, "train.micro_batch_size": 1})
    chosen, plan = choose_layout(c, 8, H100)
    assert plan.fits and chosen.parallel.auto
    assert Layout.from_config(chosen, 8) == plan.layout
    small = hardware.GpuProfile("small", 989e12, None, 16.0, 450.0, 50.0, 8)
    refused, why = check_memory(c.with_overrides({"parallel.zero": 0}), 8, small)
    assert not refused.fits
    assert why.startswith("layout dp=8 tp=1 pp=1 zero=0 mbs=1 is predicted to need")
    assert "GiB more than the 16.0 GiB available" in why and "--force" in why
    assert "layouts predicted to fit: --parallel.dp_replicate=1 --parallel." in why
    with pytest.raises(TesselError, match="no layout of this model on 1 device"):
        choose_layout(c, 1, small)


def test_json_has_the_documented_fields():
    c = cfg()
    plan = evaluate(c, Layout.from_config(c, 1), H100)
    out = as_json(c, 1, H100, [plan], [])
    row = json.loads(json.dumps(out))["layouts"][0]
    for key in ("dp", "tp", "pp", "cp", "zero", "micro_batch", "activation_checkpointing",
                "offload", "memory_gib", "step_time_s", "tokens_per_s", "mfu", "fits"):
        assert key in row, key
    assert {"parameters", "gradients", "optimizer", "activations", "communication", "margin",
            "total"} <= set(row["memory_gib"])


# ---- hardware profiles ----------------------------------------------------------------------


def test_builtin_profiles_cover_the_required_gpus():
    for name in ("a100-40gb", "a100-80gb", "h100-sxm", "h100-pcie", "h200", "b200", "mi300x"):
        p = hardware.BUILTIN[name]
        assert p.bf16_flops > 1e14 and p.memory_gib >= 40 and p.gpus_per_node == 8
        assert name in hardware.SOURCES
    assert hardware.profile_for_device("NVIDIA H100 80GB HBM3").name == "h100-sxm"
    assert hardware.profile_for_device("NVIDIA GeForce RTX 4090") is None


def test_profiles_from_toml_override_and_extend(tmp_path: Path):
    f = tmp_path / "hw.toml"
    f.write_text('[gpu.h100-sxm]\ninter_node_gbps = 25\n\n[gpu.l40s]\nbf16_tflops = 362\n'
                 'memory_gib = 48\nintra_node_gbps = 32\ninter_node_gbps = 12.5\ngpus_per_node = 4\n')
    profiles = hardware.load_profiles(f)
    assert profiles["h100-sxm"].inter_node_gbps == 25 and profiles["h100-sxm"].memory_gib == 80
    assert profiles["l40s"].bf16_flops == 362e12 and profiles["l40s"].fp8_flops is None
    # What profile_toml writes reads back the same.
    f2 = tmp_path / "out.toml"
    f2.write_text(hardware.profile_toml(profiles["l40s"]))
    assert hardware.load_profiles(f2)["l40s"] == profiles["l40s"]


@pytest.mark.parametrize("text, needle", [
    ("[gpu.x]\nbf16_tflops = 1\n", "lacks gpus_per_node; a new profile needs"),
    ("[gpu.h100-sxm]\nspeed = 3\n", "unknown key 'speed'"),
    ("[gpu.h100-sxm]\nmemory_gib = -1\n", "memory_gib must be a positive number"),
    ("nothing = 1\n", "has no [gpu.NAME] tables"),
    ("[gpu\n", "is not valid TOML"),
])
def test_bad_profile_files_are_one_line_errors(tmp_path: Path, text: str, needle: str):
    f = tmp_path / "hw.toml"
    f.write_text(text)
    with pytest.raises(TesselError) as info:
        hardware.load_profiles(f)
    assert needle in str(info.value)


def test_calibration_makes_the_prediction_equal_the_measurement():
    c = cfg()
    lay = Layout.from_config(c, 1)
    predict = lambda hw: evaluate(c, lay, hw).tokens_per_s  # noqa: E731
    target = predict(H100) * 0.7
    tuned = hardware.calibrate(H100, predict, target)
    assert tuned.matmul_efficiency < H100.matmul_efficiency
    assert predict(tuned) == pytest.approx(target, rel=0.01)


def test_time_to_budget_and_mfu_follow_from_the_step():
    c = cfg(**{"train.steps": 100})
    plan = evaluate(c, Layout.from_config(c, 1), H100)
    tokens = 16 * 64
    assert plan.tokens_per_s == pytest.approx(tokens / plan.step.total)
    assert plan.time_to_budget_s == pytest.approx(100 * plan.step.total)
    assert plan.mfu == pytest.approx(flops_per_token(c.model, 64) * plan.tokens_per_s / H100.bf16_flops)
    assert plan.memory.total / GIB < 80 and plan.fits


def test_the_no_fit_headline_names_a_structural_refusal_not_more_gpus():
    """gpt3-175b on 1,024 A100s said "more GPUs" while every layout had been refused for its
    vocabulary (tp) or tied embeddings (pp): the headline now names that reason and its fix."""
    from tessel.planner.report import no_fit_headline
    from tessel.planner.search import SearchResult

    refused = {"vocab": (9216, "the padded vocabulary (50257 ids padded to 50257 rows, "
                                "model.vocab_pad_to=1) is not divisible by tp=2; set "
                                "model.vocab_pad_to to a multiple of tp (e.g. 2)"),
               "tied": (210, "tied embeddings cannot be split across pipeline stages")}
    line = no_fit_headline(SearchResult([], [], refused, evaluated=0))
    assert line.startswith("no layout can run these settings: all 9,426 were refused")
    assert "(9,216) because the padded vocabulary (50257 ids padded to 50257 rows" in line
    assert line.endswith("set model.vocab_pad_to to a multiple of tp (e.g. 2)")
    assert "more GPUs" not in line
    memory = no_fit_headline(SearchResult([], [], refused, evaluated=12))
    assert memory.startswith("no layout fits: more GPUs") and "lift the refusals" in memory
    assert "refusals" not in no_fit_headline(SearchResult([], [], {}, evaluated=12))


def test_gpt3_175b_on_1024_a100s_gets_a_3d_layout_that_fits():
    """The issue's recipe: GPT-3 175B (tied embeddings, 50,257-token vocabulary) on 1,024
    A100-80GB at the paper's batch. Tied embeddings across stages and the padded vocabulary
    open tp x pp x dp layouts; the fastest predicted to fit is one."""
    c = Config.load(None, {"model.preset": "gpt3-175b", "train.global_batch_size": 1536,
                           "train.seq_len": 2048})
    assert c.model.tie_embeddings and c.model.vocab_size == 50257
    result = search(c, 1024, hardware.get_profile("a100-80gb"), keep=3)
    best = result.plans[0]
    assert best.fits and best.layout.tp > 1 and best.layout.pp > 1 and best.layout.dp > 1
    assert trainer_refusal(c, best.layout, full=True) is None
    # The recipe in configs/ is one of the layouts that fit.
    recipe = Config.load(Path(__file__).parents[2] / "configs/gpt3-175b.toml")
    plan = evaluate(recipe, Layout.from_config(recipe, 1024), hardware.get_profile("a100-80gb"))
    assert plan.fits and plan.mfu > 0.4


# ---- Mixture-of-Experts and expert parallelism ----------------------------------------------


def _fsdp_rows(rows: int, group: int, index: int) -> int:
    """Rows of a dim-0 shard on member `index` of an FSDP2 group (torch.chunk's split)."""
    chunk = -(-rows // group)
    return max(0, min(chunk, rows - index * chunk))


@pytest.mark.parametrize("ep, zero, pp", [(1, 1, 1), (2, 1, 1), (4, 1, 1), (1, 3, 1), (2, 3, 2),
                                          (4, 3, 2)])
def test_moe_parameters_per_rank_equal_the_model_sharded_as_expert_parallelism_says(ep, zero, pp):
    """Each rank's parameter (and AdamW-state) elements: the meta-device model's parameters
    of its pipeline stage, routed experts split moe_experts/ep per expert-parallel rank and
    then FSDP-sharded (dim 0) over the experts' own group of dp_shard/ep ranks, the rest over
    dp_shard ranks; equal per rank, and summed over the ranks."""
    m = ModelConfig(preset="tiny-moe")  # 1 dense + 3 MoE layers, 8 experts, 1 shared
    dp_shard = 4
    lay = layout(dp_shard=dp_shard, pp=pp, zero=zero, ep=ep)
    with torch.device("meta"):
        whole = Transformer(m)
    p = Config.load(None, {"model.preset": "tiny-moe", "parallel.pp": pp}).parallel
    efsdp = lay.expert_dp_shard
    assert efsdp == dp_shard // ep
    ranks = memory_by_rank(m, lay, 64, 64, "bf16")
    total = 0
    for rank in range(pp):
        stages = split_model(whole, p, rank) if pp > 1 else [(0, whole)]
        named = [(n, t) for _, s in stages for n, t in s.named_parameters()]
        experts = sum(t.numel() for n, t in named if ".experts." in n)
        planned = rank_parameters(m, lay, rank)
        assert planned.experts * ep == experts  # each ep rank: moe_experts / ep of each layer
        assert planned.total - planned.experts == sum(t.numel() for _, t in named) - experts
        for d in range(dp_shard):  # every data-parallel rank of this pipeline rank
            local = 0
            for name, t in named:
                if ".experts." in name:  # (E, ...) -> (E/ep, ...) on this ep rank, then FSDP
                    rows = t.shape[0] // ep
                    local += _fsdp_rows(rows, efsdp, d % efsdp) * t[0].numel()
                else:
                    local += _fsdp_rows(t.shape[0], dp_shard, d) * t[0].numel()
            assert ranks[rank].optimizer == ADAM_BYTES * local, (rank, d)
            total += local
    assert parameter_elements(m, lay) == total == sum(t.numel() for t in whole.parameters())


def test_expert_parallel_layouts_shrink_expert_memory_and_pay_all_to_all():
    m = ModelConfig(preset="mixtral-8x7b")
    base = dict(dp_shard=8, zero=1, activation_checkpointing="full")
    mem = {ep: estimate_memory(m, layout(**base, ep=ep), 4096, 64, "bf16") for ep in (1, 2, 8)}
    assert mem[8].parameters < mem[2].parameters < mem[1].parameters
    assert mem[8].optimizer == pytest.approx(mem[1].optimizer, rel=0.01)  # ZeRO shards both
    steps = {ep: estimate_step(m, layout(**base, ep=ep), H100, 4096, 64, "bf16") for ep in (1, 8)}
    assert steps[1].ep_comm_s == 0 and steps[8].ep_comm_s > 0
    # Dispatch + combine, forward + backward + the recomputed forward, per MoE layer and
    # micro-batch; 8 ranks fit in a node: NVLink.
    one_way = 4096 * 2 * 4096 * 2  # tokens x top_k x d_model x bf16 bytes
    nvlink = H100.intra_node_gbps * 1e9 * H100.comm_efficiency
    # each dispatch and combine: its bytes, and its calls' latency (the counts, the tokens)
    assert steps[8].ep_comm_s == pytest.approx(8 * 32 * 3 * 2 * (
        one_way * 7 / 8 / nvlink + EP_CALLS_EACH_WAY * H100.collective_latency_s))
    # Across nodes the part to other nodes goes over the NIC.
    inter = H100.inter_node_gbps * 1e9 * H100.comm_efficiency
    assert all_to_all(1e9, 64, H100) == pytest.approx(1e9 * 56 / 64 / inter)


def test_moe_mfu_counts_active_parameters():
    c = Config.load(None, {"model.preset": "qwen3-30b-a3b", "train.seq_len": 4096,
                           "train.global_batch_size": 64})
    plan = evaluate(c, layout(dp_shard=8, zero=3, ep=8, activation_checkpointing="full"), H100)
    assert plan.mfu == pytest.approx(flops_per_token(c.model, 4096) * plan.tokens_per_s
                                     / (8 * H100.bf16_flops))
    assert flops_per_token(c.model, 4096) < 6 * param_count(c.model) / 5  # active, not total


@pytest.mark.parametrize("overrides, gpus, needle", [
    ({"model.preset": "tiny-moe", "parallel.ep": 3, "parallel.dp_shard": 3,
      "train.global_batch_size": 48}, 3,
     "parallel.ep=3 does not divide model.moe_experts=8; choose an ep that divides"),
    ({"model.preset": "tiny-llama", "parallel.ep": 2, "parallel.dp_shard": 2}, 2,
     "parallel.ep=2 splits the experts of Mixture-of-Experts layers, and this model has none"),
    ({"model.preset": "tiny-moe", "parallel.ep": 4, "parallel.dp_shard": 2}, 2,
     "parallel.ep=4 borrows its ranks from the dp_shard x cp x tp = 2 data-parallel"),
    ({"model.preset": "tiny-moe", "parallel.ep": 2, "parallel.zero": 0}, 2,
     "set parallel.zero >= 1"),
    ({"model.preset": "tiny-moe", "parallel.tp": 2, "parallel.sequence_parallel": False}, 2,
     "MoE layers run on each rank's part of the sequence; set parallel.sequence_parallel=true"),
])
def test_bad_expert_parallel_layouts_are_one_line(overrides, gpus, needle):
    c = Config.load(None, overrides)
    why = trainer_refusal(c, Layout.from_config(c, gpus), full=True)
    assert why is not None and needle in why and "\n" not in why


@pytest.mark.budget(35)  # seconds on the reference machine: measured, +~40%
def test_deepseek_v3_on_2048_h800s_gets_a_layout_with_expert_and_pipeline_parallelism():
    """DeepSeek-V3's shape (tessel's GQA stand-in for MLA) at the start of its batch ramp
    (3,072 sequences of 4,096; the full search at 15,360 is in docs/planning.md)."""
    c = Config.load(None, {"model.preset": "deepseek-v3", "train.global_batch_size": 3072,
                           "train.seq_len": 4096})
    h800 = hardware.get_profile("h800")
    assert h800.intra_node_gbps == 200 and h800.inter_node_gbps == 50
    result = search(c, 2048, h800, keep=3)
    best = result.plans[0]
    assert best.fits and best.layout.ep > 1 and best.layout.world == 2048
    assert trainer_refusal(c, best.layout, full=True) is None
    assert 0.05 < best.mfu < 0.6 and best.step.ep_comm_s > 0
    # DeepSeek's published layout (pp16 x ep64, ZeRO-1, no tp) runs here, fits with selective
    # recomputation, and is predicted within a factor of two of the pick.
    published = Layout(1, 128, 1, 16, 1, 1, 1, "selective", pp_layers_first=2, pp_layers_last=3,
                       ep=64)
    assert trainer_refusal(c, published) is None
    p = evaluate(c, published, h800)
    assert p.fits and 0.5 < p.tokens_per_s / best.tokens_per_s <= 1.0
