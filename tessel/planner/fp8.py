"""What train.fp8 changes in a plan: which matmuls run at the FP8 rate, the casts and scales
beside them, FSDP's float8 all-gather, and the float8 buffers in memory.

The matmuls counted are the ones `tessel.parallel.fp8` converts: every `nn.Linear` of the
blocks whose two dimensions are multiples of 16 (attention's wq/wk/wv/wo, the dense MLPs'
and the shared experts' w1/w2/w3); the output layer, the MoE router (fp32) and the routed
experts (grouped matmuls) stay at the BF16 rate. Of a converted linear's three matmuls
(forward, input gradient, weight gradient) tensorwise, rowwise and mxfp8 run all three in
float8, rowwise_with_gw_hp the first two.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from tessel.config import Config, ModelConfig
from tessel.planner.hardware import GpuProfile
from tessel.planner.layout import Layout
from tessel.planner.memory import Memory, fsdp_active, rank_parameters

# The fraction of FP8 peak x the profile's (stack-adjusted) matmul efficiency that
# torchao's float8 GEMMs reach, the casts counted apart (`cast_bytes`). Fitted on
# torchtitan's two Float8 rows (Llama 3 8B, 8 and 128 H100 96GB at 500 W, FSDP, compile,
# tensorwise with float8 all-gather; published.py): the only published FP8 runs of this
# stack, so the fit is not checked on held-out rows.
FP8_GEMM_EFFICIENCY = 0.85
MATMUL_MULTIPLE = 16  # torchao's filter (tessel.parallel.fp8): both dimensions divisible
# Bytes of device memory traffic per element cast to float8: tensorwise scaling needs the
# whole tensor's amax before it casts (a pass reading bf16, then read bf16 + write fp8);
# rowwise and block (mx) scales are local to a row or block, so one pass reads and writes.
CAST_BYTES = {"tensorwise": 5.0, "rowwise": 3.0, "rowwise_with_gw_hp": 3.0, "mxfp8": 3.0}
# Casts of one converted linear per micro-batch, in elements of (input, weight, output
# gradient): torchao 0.18 saves the high-precision input and weight and casts them again in
# backward; tensorwise casts the output gradient once (its dgrad and wgrad casts are the
# same, which the compiler computes once), rowwise along each of two axes; with the weight
# gradient in high precision the input's second cast and the gradient's second go.
CASTS = {"tensorwise": (2, 2, 1), "rowwise": (2, 2, 2), "rowwise_with_gw_hp": (1, 2, 1),
         "mxfp8": (2, 2, 2)}
FP8_PASSES = {"tensorwise": 3, "rowwise": 3, "rowwise_with_gw_hp": 2, "mxfp8": 3}


def recipe_of(cfg: Config) -> str | None:
    """train.fp8's recipe (`true` is tensorwise), None without FP8 (as tessel.parallel.fp8)."""
    fp8 = cfg.train.fp8
    if fp8 is True:
        return "tensorwise"
    return fp8 or None


def fp8_peak(hw: GpuProfile, recipe: str) -> float | None:
    """The FP8 FLOP/s the recipe's matmuls get on `hw`; None: no such tensor cores (all at
    the BF16 rate). MXFP8's block-scaled matmuls need Blackwell (the b200 profile)."""
    if recipe == "mxfp8" and not hw.name.startswith("b"):
        return None
    return hw.fp8_flops


@dataclass(frozen=True)
class Fp8Terms:
    """What a plan counts for train.fp8 on one GPU profile."""

    recipe: str
    peak: float | None
    """FP8 FLOP/s of the profile for this recipe (None: no FP8 tensor cores for it)."""
    hbm: float
    """Device memory bandwidth, bytes/s (the casts are bound by it)."""
    all_gather: bool = False
    """FSDP all-gathers the converted weights in float8 (tensorwise, train.fp8_all_gather)."""
    shard: int = 1
    """Ranks a weight is sharded over (FSDP); its float8 cast then runs on the shard."""
    tp_float8: bool = False
    """Tensor-parallel all-gathers move float8 (tensorwise on CUDA: torchao's float8 TP
    styles, tessel.parallel.fp8.float8_collectives), where sequence parallelism has them."""

    @classmethod
    def of(cls, cfg: Config, hw: GpuProfile, shard: int = 1) -> Fp8Terms | None:
        """None without train.fp8, or where `hw` has no FP8 tensor cores for its recipe (the
        trainer refuses it there; the plan counts every matmul at the BF16 rate)."""
        recipe = recipe_of(cfg)
        peak = fp8_peak(hw, recipe) if recipe is not None else None
        if recipe is None or peak is None:
            return None
        gather = recipe == "tensorwise" and getattr(cfg.train, "fp8_all_gather", True)
        return cls(recipe, peak, hw.hbm_gbps * 1e9, gather and shard > 1, shard,
                   recipe == "tensorwise" and hw.device_type == "cuda")

    def cast_bytes(self, rows: float, k: float, n: float) -> float:
        """Memory traffic of one converted (K, N) linear's float8 casts over `rows` rows, one
        micro-batch's forward and backward. With float8 all-gather the weight is cast on its
        shard before the gather and arrives in float8."""
        ci, cw, cg = CASTS[self.recipe]
        weight = k * n / (self.shard if self.all_gather else 1)
        return CAST_BYTES[self.recipe] * (ci * rows * k + cw * weight + cg * rows * n)

    def linear_seconds(self, rows: float, k: float, n: float, bf16_rate: float,
                       matmul_efficiency: float, size: float) -> float:
        """Seconds of one converted (K, N) linear over `rows` rows, forward and backward: its
        float8 matmuls at the FP8 peak x matmul_efficiency x FP8_GEMM_EFFICIENCY, the rest
        at `bf16_rate`, each times `size` (the small-dimension factor), plus the casts at
        device memory bandwidth. Without FP8 tensor cores, all at `bf16_rate`, no casts."""
        flops = 2 * rows * k * n
        if self.peak is None:
            return 3 * flops / (bf16_rate * size)
        fast = FP8_PASSES[self.recipe]
        rate = self.peak * matmul_efficiency * FP8_GEMM_EFFICIENCY
        return (fast * flops / (rate * size) + (3 - fast) * flops / (bf16_rate * size)
                + self.cast_bytes(rows, k, n) / self.hbm)


Linear = tuple[float, float, bool]
"""(K, N) on one tensor-parallel rank, and whether train.fp8 converts it."""


def _linears(whole: list[tuple[int, int, int, int]]) -> list[Linear]:
    """(K, N, ranks K is split over, ranks N is split over) -> Linear: the filter
    (tessel.parallel.fp8) sees the module's whole dimensions; each rank multiplies its share."""
    return [(k / sk, n / sn, k % MATMUL_MULTIPLE == 0 and n % MATMUL_MULTIPLE == 0)
            for k, n, sk, sn in whole]


def attention_linears(m: ModelConfig, tp: int) -> list[Linear]:
    """wq, wk, wv (column-parallel) and wo (row-parallel)."""
    d, q, kv = m.d_model, m.q_dim, m.n_kv_heads * m.head_dim
    return _linears([(d, q, 1, tp), (d, kv, 1, tp), (d, kv, 1, tp), (q, d, tp, 1)])


def mlp_linears(m: ModelConfig, hidden: int, split: int) -> list[Linear]:
    """w1 (and w3 when gated), column-parallel over `split` ranks, and w2, row-parallel: a
    dense MLP (split tp) or an MoE layer's shared experts (whole on every rank)."""
    d = m.d_model
    n_in = 1 if m.mlp == "gelu" else 2
    return _linears([(d, hidden, 1, split)] * n_in + [(hidden, d, split, 1)]) if hidden else []


def converted_elements(m: ModelConfig, tp: int, layers: int, moe_layers: int) -> float:
    """Weight elements on one tensor-parallel rank that train.fp8 converts, over `layers`
    blocks of which `moe_layers` are MoE blocks."""
    attention = sum(k * n for k, n, c in attention_linears(m, tp) if c)
    dense = sum(k * n for k, n, c in mlp_linears(m, m.ffn_hidden, tp) if c)
    shared = (m.moe_shared_experts or 0) * (m.moe_ffn_hidden or 0)
    moe = sum(k * n for k, n, c in mlp_linears(m, shared, 1) if c)
    return layers * attention + (layers - moe_layers) * dense + moe_layers * moe


def gathered_bytes(fp8: Fp8Terms | None, dense_bytes: float, act_bytes: int, m: ModelConfig,
                   tp: int, layers: int, moe_layers: int) -> float:
    """The bytes FSDP all-gathers of `dense_bytes` (the non-expert parameters in the
    compute dtype): with float8 all-gather, 1 byte instead of `act_bytes` per converted
    weight element."""
    if fp8 is None or not fp8.all_gather:
        return dense_bytes
    return dense_bytes - (act_bytes - 1) * converted_elements(m, tp, layers, moe_layers)


def tp_activation_bytes(fp8: Fp8Terms | None, act_bytes: int, layout: Layout) -> float:
    """Bytes per activation element a tensor-parallel collective of a block moves: with
    float8 TP styles (`Fp8Terms.tp_float8`) and sequence parallelism each all-gather half
    of a collective (the sequence's activations forward, the output gradients backward)
    moves float8, 1 byte, and the reduce-scatter half `act_bytes`; otherwise `act_bytes`."""
    if fp8 is None or not fp8.tp_float8 or not layout.sequence_parallel:
        return act_bytes
    return (act_bytes + 1) / 2


def described(cfg: Config, hw: GpuProfile) -> str:
    """`tessel plan`'s line: which matmuls it counts at the FP8 rate, and how."""
    recipe = recipe_of(cfg)
    if recipe is None:
        return ""
    if fp8_peak(hw, recipe) is None:
        return (f"; train.fp8 ({recipe}): {hw.name} has no FP8 tensor cores for it, every "
                "matmul counted at the BF16 rate")
    passes = ("forward and input-gradient matmuls (the weight gradient in BF16)"
              if FP8_PASSES[recipe] == 2 else "forward, input- and weight-gradient matmuls")
    gather = (", FSDP all-gathers them in float8 (1 byte a weight)"
              if recipe == "tensorwise" and getattr(cfg.train, "fp8_all_gather", True) else "")
    if recipe == "tensorwise" and cfg.parallel.tp > 1 and cfg.parallel.sequence_parallel:
        gather += (", tensor parallelism's all-gathers move float8 activations and output "
                   "gradients (1 byte an element; the reduce-scatters stay BF16)")
    return (f"; train.fp8 ({recipe}): at the FP8 peak x {FP8_GEMM_EFFICIENCY} the {passes} of "
            f"the blocks' linears with both dimensions multiples of {MATMUL_MULTIPLE} "
            "(attention's, the dense MLPs', shared experts'), plus their casts at "
            f"{CAST_BYTES[recipe]:g} bytes an element at HBM bandwidth{gather}; attention, "
            "the router, routed experts and the output layer at the BF16 rate")


def fp8_memory(mem: Memory, m: ModelConfig, layout: Layout, seq_len: int,
               fp8: Fp8Terms | None) -> Memory:
    """`mem` (the busiest pipeline rank's) with train.fp8's buffers: under FSDP with float8
    all-gather the gathered copies of the converted weights take 1 byte an element, not
    bf16's 2 (ZeRO-3: the two blocks in flight; ZeRO-1/2: all, kept from forward to
    backward); and the largest converted linear's float8 operands (input, weight, output
    gradient; two casts of each under row-wise and block scales) live during its backward.
    torchao 0.18 saves the high-precision input and weight for backward, as a bf16 linear
    does, so the saved activations do not change."""
    if fp8 is None:
        return mem
    p = rank_parameters(m, layout, mem.stage)
    parameters = mem.parameters
    if fp8.all_gather and fsdp_active(layout):
        blocks = (2 * converted_elements(m, layout.tp, 1, 0) if layout.zero == 3
                  else converted_elements(m, layout.tp, p.layers, p.moe_layers))
        parameters -= blocks  # 1 byte saved per gathered element
    rows = layout.micro_batch * seq_len / layout.cp
    linears = attention_linears(m, layout.tp) + mlp_linears(m, m.ffn_hidden, layout.tp)
    operands = max((rows * k + k * n + rows * n for k, n, c in linears if c), default=0.0)
    copies = 1 if fp8.recipe == "tensorwise" else 2
    return replace(mem, parameters=parameters,
                   activations=mem.activations + copies * operands)
