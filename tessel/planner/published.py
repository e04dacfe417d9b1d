"""Published large-scale training throughputs the planner's time model is checked against.

Each row is a run someone measured and published with enough of its configuration to
replay it: model shape, sequence, batch, layout, hardware, and the throughput converted to
tokens/s over the whole job (how is said per source). Where a source leaves a setting out,
the row states the value assumed (`assumed`). `benchmarks/planner_validation.py` prints
prediction vs publication row by row; tests/unit/test_planner_validation.py pins the
predictions so that changes to the model show up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# Sources (read, not recalled; see the closing notes of the planner issue for the copies).
MEGATRON_2021 = ("Narayanan et al., Efficient Large-Scale Language Model Training on GPU "
                 "Clusters Using Megatron-LM, SC21 (arXiv 2104.04473), Table 1: A100-80GB, "
                 "seq 2048, vocab 51,200, interleaved schedule; TFLOP/s per GPU counted with "
                 "recomputation, F = 96 B s l h^2 (1 + s/6h + V/16lh)")
LLAMA3_2024 = ("Llama Team, The Llama 3 Herd of Models (arXiv 2407.21783), Table 4: 405B on "
               "H100-80GB, seq 8192, 16M tokens per batch, BF16 MFU (Chowdhery et al.)")
LLAMA3_2024_LONG = ("Llama Team, The Llama 3 Herd of Models (arXiv 2407.21783), Table 4, the "
                    "long-context row (the 128K stage, seq 131,072): 405B on 16,384 H100-80GB, "
                    "TP 8, CP 16, PP 16 (so DP 8), 16M tokens per batch, 380 TFLOP/s per GPU; "
                    "read as transcribed from P. Balaji's SC'24 slide at "
                    "glennklockwood.com/garden/llama-3.1 (GPUs, TP, CP, PP, tokens, TFLOP/s)")
TORCHTITAN_A100 = ("pytorch/torchtitan docs/performance.md (commit 0413364): 64 x A100-80GB, "
                   "FSDP (1D), words per second per GPU, Llama 3 seq 8192, Llama 2 seq 4096")
TORCHTITAN_H100 = ("pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md: H100 "
                   "96GB at a 500 W limit (the doc: below SXM's peak), FSDP, bf16 rows only, "
                   "tokens/s per GPU at step 90; seq 8192 assumed from its default configs")
MEGASCALE_2024 = ("Jiang et al., MegaScale (NSDI'24, arXiv 2402.15627), Table 2, Megatron-LM "
                  "baseline: 175B (96 layers, d 12288, 128 heads), TP 8, PP 8 interleaved x 6, "
                  "seq 2048, vocab 64,000, tokens/s of the job; 'Ampere' GPUs (A100-80GB "
                  "assumed)")


def _mfu_tokens(mfu: float, peak: float, gpus: int, preset: str, seq_len: int) -> float:
    """Tokens/s of a run published as MFU (6N + 12 L d T FLOPs per token, as tessel counts)."""
    from tessel.config import ModelConfig
    from tessel.models.transformer import flops_per_token

    return mfu * peak * gpus / flops_per_token(ModelConfig(preset=preset), seq_len)


A100_CLUSTER_GBPS = 75.0
"""GB/s per GPU between nodes that torchtitan's A100 rows imply (not published)."""
_A100_NETWORK = ("network not published: at the a100-80gb profile's 200 Gb/s per GPU ZeRO-3's "
                 "collectives of the Llama 2 70B row alone take longer (15.6 s a step) than its "
                 "published step (11.5 s); 600 Gb/s (75 GB/s) per GPU assumed, the least that "
                 "leaves every row compute-bound; eager PyTorch (torch.compile not in "
                 "torchtitan's runs of the time); per-op selective checkpointing")
_H100_POWER = "GPUs capped at 500 W, below the SXM peak the h100-sxm profile assumes"


@dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    gpu: str
    gpus: int
    model: dict[str, Any]
    """model.* settings (a preset and/or explicit shape)."""
    seq_len: int
    global_batch: int
    parallel: dict[str, Any]
    """parallel.* settings of the equivalent tessel layout, plus micro_batch."""
    tokens_per_s: float
    """Published throughput of the whole job, tokens/s."""
    assumed: str = ""
    """Settings the source does not state, and the values used."""
    dp_overlap: float | None = None
    """Fraction of compute the system's data-parallel communication hid behind, where it
    differs from tessel's (None: tessel's)."""
    fit: bool = True
    """Used to fit the matmul efficiency; False where the source leaves out something the
    time depends on (then `caveat` says what)."""
    caveat: str = ""
    stack: str = "megatron-te"
    """The software stack that ran it (tessel/planner/stack.py)."""
    fp8: bool = False
    """Ran its linears in float8 (train.fp8)."""
    hardware: dict[str, Any] | None = None
    """Profile fields of the cluster where they differ from the named profile's (assumed
    where the source does not publish them: said in `assumed`)."""


def _megatron(params: str, heads: int, d: int, layers: int, tp: int, pp: int, gpus: int,
              batch: int, tflops: float, virtual: int = 2) -> PublishedRun:
    # Published TFLOP/s count recomputation: F per token = 96 l h^2 (1 + s/6h + V/16lh) / 1.
    s, v = 2048, 51200
    per_token = 96 * layers * d * d * (1 + s / (6 * d) + v / (16 * layers * d))
    return PublishedRun(
        f"GPT {params}B, {gpus} x A100", MEGATRON_2021, "a100-80gb", gpus,
        {"preset": "gpt3-1.3b", "n_layers": layers, "d_model": d, "n_heads": heads,
         "vocab_size": v, "max_seq_len": s, "tie_embeddings": False},
        s, batch,
        {"tp": tp, "pp": pp, "zero": 1, "activation_checkpointing": "full", "micro_batch": 1,
         **({"pp_schedule": "interleaved-1f1b", "pp_virtual_stages": virtual} if pp > 1 else {})},
        tflops * 1e12 * gpus / per_token,
        dp_overlap=0.0,
        assumed=("data-parallel all-reduce after the backward pass (Megatron's DDP of 2021 "
                 "did not overlap it), micro-batch 1, "
                 + (f"{virtual} virtual stages, " if pp > 1 else "")
                 + "full recomputation (as the FLOP count implies)"),
    )


def _titan_a100(model: str, shape: dict[str, Any], seq_len: int, micro_batch: int, ac: str,
                per_gpu: float) -> PublishedRun:
    """A torchtitan row: 64 A100s, ZeRO-3 over all of them, words per second per GPU."""
    return PublishedRun(
        f"{model}, 64 x A100 ({'no' if ac == 'none' else ac} AC)", TORCHTITAN_A100, "a100-80gb",
        64, shape, seq_len, 64 * micro_batch,
        {"zero": 3, "micro_batch": micro_batch, "activation_checkpointing": ac},
        per_gpu * 64, assumed=_A100_NETWORK, stack="pytorch-eager",
        hardware={"inter_node_gbps": A100_CLUSTER_GBPS},
    )


def _titan_h100(gpus: int, mode: str, per_gpu: float) -> PublishedRun:
    """A row of torchtitan's Dec 2024 Llama 3.1 8B tables (1 and 3): FSDP over `gpus` H100
    96GB at 500 W, local batch 2, per-op selective checkpointing; `mode` eager, compile, or
    compile + Float8; tokens/s per GPU."""
    fp8 = mode.endswith("Float8")
    return PublishedRun(
        f"Llama 3 8B, {gpus} x H100 96GB 500 W ({mode})", TORCHTITAN_H100, "h100-96gb-500w",
        gpus, {"preset": "llama3-8b"}, 8192, 2 * gpus,
        {"zero": 3, "micro_batch": 2, "activation_checkpointing": "selective"},
        per_gpu * gpus,
        assumed=("seq 8192 (the default config of the time); torchtitan's per-op selective "
                 "checkpointing, as tessel's selective"
                 + ("; torchao's float8 linears with tensorwise scaling (the default of the "
                    "time) on every block projection, the output layer in bf16, weights "
                    "all-gathered in float8 (torchtitan's advised setting; the doc does not "
                    "say)" if fp8 else "")),
        stack="pytorch-eager" if mode == "eager" else "pytorch-compile", fp8=fp8,
    )


RUNS: tuple[PublishedRun, ...] = (
    _megatron("1.7", 24, 2304, 24, 1, 1, 32, 512, 137),
    _megatron("3.6", 32, 3072, 30, 2, 1, 64, 512, 138),
    _megatron("7.5", 32, 4096, 36, 4, 1, 128, 512, 142),
    _megatron("18.4", 48, 6144, 40, 8, 1, 256, 1024, 135),
    _megatron("39.1", 64, 8192, 48, 8, 2, 512, 1536, 138),
    _megatron("76.1", 80, 10240, 60, 8, 4, 1024, 1792, 140, virtual=3),
    _megatron("145.6", 96, 12288, 80, 8, 8, 1536, 2304, 148),
    _megatron("310.1", 128, 16384, 96, 8, 16, 1920, 2160, 155),
    _megatron("529.6", 128, 20480, 105, 8, 35, 2520, 2520, 163, virtual=3),
    _megatron("1008.0", 160, 25600, 128, 8, 64, 3072, 3072, 163),
    *(
        PublishedRun(
            f"Llama 3 405B, {gpus:,} x H100", LLAMA3_2024, "h100-sxm", gpus,
            {"preset": "llama3-405b"}, 8192, 2048,
            {"tp": 8, "pp": 16, "zero": 1, "micro_batch": 1, "pp_schedule": "interleaved-1f1b",
             "pp_virtual_stages": 4, "pp_layers_first": 1, "pp_layers_last": 1},
            _mfu_tokens(mfu, 989e12, gpus, "llama3-405b", 8192),
            assumed="micro-batch 1, interleaved 1F1B with 4 virtual stages of 2 layers and "
                    "1-layer first and last stages (the paper lightens the first and last "
                    "stages; its exact interleaving is not given), no activation checkpointing "
                    "(the paper: none at 8K); tokens/s = MFU x peak x GPUs / tessel's FLOPs per "
                    "token",
        )
        for gpus, mfu in ((8192, 0.43), (16384, 0.41))
    ),
    PublishedRun(
        "Llama 3 405B, 16,384 x H100, seq 131,072", LLAMA3_2024_LONG, "h100-sxm", 16384,
        {"preset": "llama3-405b", "max_seq_len": 131072}, 131072, 128,
        {"tp": 8, "cp": 16, "pp": 16, "zero": 1, "micro_batch": 1,
         "pp_schedule": "interleaved-1f1b", "pp_virtual_stages": 4, "pp_layers_first": 1,
         "pp_layers_last": 1, "activation_checkpointing": "matmuls"},
        _mfu_tokens(380e12 / 989e12, 989e12, 16384, "llama3-405b", 131072),
        assumed="the 8K rows' pipeline (micro-batch 1, interleaved 1F1B, 4 virtual stages, "
                "1-layer first and last stages), all-gather context parallelism, selective "
                "activation checkpointing; tokens/s = 380 TFLOP/s x GPUs / tessel's FLOPs per "
                "token (the same count, full attention matrix)",
        fit=False,
        caveat=("Llama 3 405B at 131,072: activation checkpointing (and its memory measures) "
                "not published; with selective recomputation assumed the prediction is +7.9%, "
                "with none +13.1%, with full -15.4%"),
    ),
    _titan_a100("Llama 3 8B", {"preset": "llama3-8b"}, 8192, 1, "selective", 2973),
    _titan_a100("Llama 3 70B", {"preset": "llama3-70b"}, 8192, 1, "full", 331),
    _titan_a100("Llama 2 13B", {"preset": "llama3-8b", "n_layers": 40, "d_model": 5120,
                                "n_heads": 40, "n_kv_heads": 40, "ffn_hidden": 13824,
                                "vocab_size": 32000, "max_seq_len": 4096}, 4096, 2, "none", 2162),
    _titan_a100("Llama 2 70B", {"preset": "llama3-70b", "vocab_size": 32000, "max_seq_len": 4096},
                4096, 1, "selective", 355),
    *(_titan_h100(gpus, mode, per_gpu) for gpus, mode, per_gpu in (
        (8, "compile", 6667), (128, "compile", 6514), (8, "eager", 5762), (128, "eager", 5605),
        (8, "compile + Float8", 8532), (128, "compile + Float8", 8380))),
    *(
        PublishedRun(
            f"GPT 175B, {gpus} x A100, batch {gbs}", MEGASCALE_2024, "a100-80gb", gpus,
            {"preset": "gpt3-175b", "n_heads": 128, "vocab_size": 64000, "tie_embeddings": False},
            2048, gbs,
            {"tp": 8, "pp": 8, "zero": 1, "micro_batch": 1, "pp_schedule": "interleaved-1f1b",
             "pp_virtual_stages": 6, "activation_checkpointing": "matmuls"},
            tokens,
            assumed="A100-80GB, micro-batch 1, selective recomputation",
        )
        for gpus, gbs, tokens in (
            (256, 768, 39.3e3), (512, 768, 74.1e3), (768, 768, 103.8e3), (1024, 768, 132.7e3),
            (3072, 6144, 433.6e3), (6144, 6144, 851.6e3), (12288, 6144, 1466.8e3),
        )
    ),
)
