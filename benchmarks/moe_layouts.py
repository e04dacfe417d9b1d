"""What `tessel plan` picks for Mixture-of-Experts models with expert parallelism, and what
DeepSeek-V3's published layout gets in the same model. CPU only, about two minutes:

    .venv/bin/python benchmarks/moe_layouts.py               # docs/planning.md's MoE table

Rows
- deepseek-v3 on 2,048 H800 (profile h800), seq 4096, global batch 15,360 sequences (the
  batch of most of its pre-training; DeepSeek-V3 technical report, arXiv 2412.19437, section
  4.2: ramped from 3,072 to 15,360 over the first 469B tokens), and 3,072 (the ramp's start).
  Published setup (section 3.2): 16-way pipeline (DualPipe), 64-way expert parallelism over 8
  nodes, ZeRO-1 data parallelism, no tensor parallelism, FP8 GEMMs. tessel's deepseek-v3
  preset is a shape stand-in (GQA of the same widths instead of MLA, no multi-token
  prediction module): 672.1B parameters, 38.7B active (published 671B / 37B).
- published layout here: pp 16 (1F1B, tessel has no DualPipe; 61 layers split 2 / 4 x 14 / 3),
  ep 64, ZeRO-1, micro-batch 1 (not published), under each activation checkpointing mode.
- published throughput: 180K H800 GPU hours per trillion tokens (section 1; 2,664K hours for
  14.8T tokens) = 1,543 tokens/s per GPU; as MFU with tessel's FLOP count of its preset
  against the BF16 peak (DeepSeek ran FP8 GEMMs: against the FP8 peak it is half). The paper
  publishes no MFU and no per-GPU memory.
- sanity rows: mixtral-8x7b on 64 H100 (batch 1,024 x 4,096, assumed: Mistral published
  none) and qwen3-30b-a3b on 32 H100 (batch 512 x 4,096, assumed).

These are the planner's predictions, not measurements.
"""

from __future__ import annotations

from tessel.config import Config
from tessel.models.transformer import active_param_count, flops_per_token, param_count
from tessel.planner.hardware import get_profile
from tessel.planner.layout import Layout
from tessel.planner.search import Plan, evaluate, search, trainer_refusal

DEEPSEEK_TOKENS_PER_GPU_S = 1e12 / (180e3 * 3600)  # 180K H800 GPU hours per trillion tokens


def _row(label: str, p: Plan) -> str:
    g = p.memory.gib()
    s = p.step
    return (f"| {label} | {p.layout.short()} | {g['total']:.1f} | {p.mfu:.1%} | "
            f"{p.tokens_per_s / p.layout.world:,.0f} | {s.compute_s:.1f} / {s.ep_comm_s:.1f} / "
            f"{s.bubble_s:.1f} / {s.dp_comm_s:.1f} |")


def main() -> None:
    print("| case | layout | GiB/GPU | MFU | tokens/s/GPU | step s: compute / ep all-to-all / "
          "bubble / dp exposed |")
    print("|---|---|---|---|---|---|")
    h800 = get_profile("h800")
    for batch in (15360, 3072):
        cfg = Config.load(None, {"model.preset": "deepseek-v3", "train.seq_len": 4096,
                                 "train.global_batch_size": batch})
        result = search(cfg, 2048, h800, keep=3)
        print(_row(f"deepseek-v3, 2,048 H800, batch {batch:,}: picked", result.plans[0]))
        for ac in ("none", "selective", "full"):
            lay = Layout(1, 128, 1, 16, 1, 1, 1, ac, pp_layers_first=2, pp_layers_last=3, ep=64)
            assert trainer_refusal(cfg, lay) is None
            p = evaluate(cfg, lay, h800)
            fits = "" if p.fits else " (does not fit)"
            print(_row(f"batch {batch:,}: published pp16 x ep64 ZeRO-1, ac={ac}{fits}", p))
        best = [q for q in search(cfg, 2048, h800, keep=10**6).plans
                if q.layout.ep == 64 and q.layout.pp == 16]
        if best:
            print(_row(f"batch {batch:,}: fastest fitting with pp16 x ep64", best[0]))
    m = Config.load(None, {"model.preset": "deepseek-v3"}).model
    mfu = flops_per_token(m, 4096) * DEEPSEEK_TOKENS_PER_GPU_S / h800.bf16_flops
    print(f"\npublished: {DEEPSEEK_TOKENS_PER_GPU_S:,.0f} tokens/s per GPU = {mfu:.1%} MFU "
          f"(BF16 peak, tessel's FLOPs of its preset: {param_count(m) / 1e9:.1f}B total, "
          f"{active_param_count(m) / 1e9:.1f}B active)\n")
    h100 = get_profile("h100-sxm")
    for preset, gpus, batch in (("mixtral-8x7b", 64, 1024), ("qwen3-30b-a3b", 32, 512)):
        cfg = Config.load(None, {"model.preset": preset, "train.seq_len": 4096,
                                 "train.global_batch_size": batch})
        result = search(cfg, gpus, h100, keep=1)
        print(_row(f"{preset}, {gpus} H100, batch {batch:,}: picked", result.plans[0]))


if __name__ == "__main__":
    main()
