"""The one typed configuration of a tessel run: its sections, a docstring under every field,
and the checks that run when it is built (which never touch the disk).

Reading TOML files and merging dotted overrides is `tessel.config.load`; the model fields fixed
by the weights of `model.init_from` are read by `tessel.checkpoint.init_from.load_config` and
passed in through the validation context (`Config.from_dict(..., init_fields=...)`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tessel.config.base import ConfigError, Section
from tessel.config.blend import weighted_paths
from tessel.config.dpo import DpoConfig
from tessel.config.evaluation import LMEvalConfig
from tessel.config.fault_tolerance import FaultToleranceConfig
from tessel.config.load import merge, read_toml, validate
from tessel.config.lora import LoraConfig
from tessel.config.model import SHAPE_FIELDS, ModelConfig
from tessel.config.monitoring import (
    AlertConfig,
    MetricsConfig,
    NotifyConfig,
    RecoveryConfig,
    WatchdogConfig,
    check_comm_alerts,
)
from tessel.config.optim import OptimConfig

__all__ = [
    "SHAPE_FIELDS", "CheckpointConfig", "Config", "ConfigError", "DataConfig",
    "LMEvalConfig", "LoraConfig", "ModelConfig", "OptimConfig", "ParallelConfig", "RunConfig",
    "TrainConfig",
]


class DataConfig(Section):
    source: Literal["stdlib", "files", "indexed", "synthetic", "sft"] = "stdlib"
    """Where training tokens come from: `stdlib` is the embedded demo corpus (this Python's
    own standard-library sources), `files` tokenizes the text/JSONL files or directories in
    `data.paths` (cached), `indexed` reads datasets made by `tessel preprocess`, `synthetic`
    is a random-token stream (for benchmarks and smoke tests), `sft` is supervised
    fine-tuning on the chat or prompt/completion records in `data.paths` (rendered with
    `data.chat_template`, loss on the assistant turns only, packed and cached; the document
    mask is always on)."""
    paths: list[str] = []
    """`files`: inputs to tokenize. `indexed`: dataset prefixes, optionally weighted Megatron
    style (["0.7 data/web", "0.3 data/books"]); without weights they mix in proportion to
    their sizes. `sft`: JSONL files (.gz/.zst too), Parquet or Arrow files, directories of
    them, or Hugging Face save_to_disk directories of fine-tuning records."""
    json_key: str = "text"
    """Field holding the text in JSONL/Parquet/Arrow inputs (`files` source)."""
    tokenizer: str = "auto"
    """`auto` (an `indexed` dataset's own tokenizer; for `stdlib`/`files` a byte-level BPE
    trained on the corpus with model.vocab_size ids), `bytes`, `bpe` (that BPE explicitly),
    a tokenizer.json path, or `gpt2-files:vocab.json,merges.txt`."""
    eod_token: str = "auto"
    """The token that ends every document (and stops `tessel generate`): `auto` takes the
    first of <|endoftext|>, <|end_of_text|>, </s>, <eos>, <|im_end|>, ... the tokenizer has,
    and adds <|endoftext|> when it has none; or name one of the tokenizer's own tokens (its
    EOS or pad token). `tessel convert hf-to-tessel` sets the model's EOS here when the
    tokenizer has none of those names."""
    split: str = "98,2"
    """Train/validation[/test] split of each dataset's documents, as relative weights
    ("98,2" or "969,30,1"); contiguous ranges of documents, Megatron style."""
    verify: Literal["auto", "full", "sampled"] = "auto"
    """How datasets are checked when training opens them (besides the index, which is always
    checked): `full` reads every token file whole (its checksum, and every id inside the
    vocabulary); `sampled` checks the ids of 64 spread chunks only; `auto` is `full` for
    token files up to 2 GiB and `sampled` above (said in one line)."""
    document_mask: bool = False
    """Attention does not cross document boundaries inside a packed sample, and positions
    restart at each document (FlexAttention's block mask on CUDA, a dense mask on CPU);
    always on for `data.source = "sft"`."""
    cache_dir: str = ""
    """Where tokenized corpora and sample indices are cached; empty means $TESSEL_CACHE or
    ~/.cache/tessel."""
    chat_template: str = "auto"
    """`sft` (and `tessel generate --chat`): the chat template conversations are rendered
    with. `auto` is the model's own (chat_template.jinja or tokenizer_config.json beside
    data.tokenizer), else `chatml`; `chatml` and `plain` (prompt, then completion and the
    end-of-sequence token) are built in; or a path to a .jinja file."""
    sft_overlong: Literal["truncate", "drop"] = "truncate"
    """`sft`: an example longer than train.seq_len + 1 tokens is cut to that length
    (`truncate`, the default; dropped when no learned token is left) or left out (`drop`).
    Both are counted in the start-up line."""
    sft_pack: bool = True
    """`sft`: pack several examples into each sample (first-fit, each its own document);
    false puts one example per sample, padded."""

    @model_validator(mode="after")
    def _check(self) -> DataConfig:
        self.split_fractions()  # raises on a malformed split
        if self.source in ("files", "indexed", "sft") and not self.paths:
            raise ValueError(f'data.source = "{self.source}" needs data.paths = ["...", ...]')
        if self.paths and self.source not in ("files", "indexed", "sft"):
            raise ValueError(
                f'data.paths is set but data.source = "{self.source}" does not read it; set '
                'data.source = "files" (text/JSONL/Parquet/Arrow, compressed too), '
                '"indexed" (tessel preprocess output) or "sft" (fine-tuning JSONL), or drop '
                'data.paths'
            )
        if self.source == "sft":
            if "document_mask" in self.model_fields_set and not self.document_mask:
                raise ValueError('data.document_mask = false does not apply to data.source = '
                                 '"sft": packed examples must not attend to each other')
            if not self.document_mask:  # (plain assignment would validate again, recursively)
                object.__setattr__(self, "document_mask", True)
        if not self.chat_template.strip():
            raise ValueError('data.chat_template is empty; set "auto", "chatml", "plain" or a '
                             '.jinja file path')
        if self.source == "indexed":
            self.weighted_paths()  # raises on malformed weights
        return self

    def split_fractions(self) -> tuple[float, float, float]:
        """(train, val, test) fractions parsed from `split`."""
        try:
            parts = [float(p) for p in self.split.split(",")]
        except ValueError:
            parts = []
        if len(parts) not in (2, 3) or min(parts) < 0 or sum(parts) <= 0 or parts[0] <= 0:
            raise ValueError(
                f"split={self.split!r} must be two or three non-negative weights with a "
                "positive first one, e.g. '98,2' or '969,30,1'"
            )
        total = sum(parts)
        fractions = [p / total for p in parts] + [0.0]
        return fractions[0], fractions[1], fractions[2]

    def weighted_paths(self) -> list[tuple[float | None, str]]:
        """`paths` as (weight or None, prefix) pairs (see `blend.weighted_paths`)."""
        return weighted_paths(self.paths)


class TrainConfig(Section):
    steps: int = Field(400, gt=0)
    """Optimizer steps to train for."""
    seed: int = Field(1234, ge=0)
    """Seed for weights, data order and dropout; the same seed gives the same run."""
    micro_batch_size: int = Field(16, gt=0)
    """Sequences per forward/backward pass on one device."""
    global_batch_size: int = Field(32, gt=0)
    """Sequences per optimizer step over all devices; a multiple of micro_batch_size times
    the data-parallel size (the quotient is the gradient-accumulation count)."""
    seq_len: int = Field(256, gt=0)
    """Tokens per sequence; at most model.max_seq_len."""
    objective: Literal["lm", "dpo"] = "lm"
    """What the run learns: `lm` predicts the next token (pretraining; fine-tuning with
    data.source = "sft"); `dpo` learns preferences from the pairs of dpo.paths ([dpo]),
    train.micro_batch_size and global_batch_size then counting pairs (two rows each)."""
    eval_interval: int = Field(100, ge=0)
    """Evaluate on the validation split every N steps and at the end (0: only at the end)."""
    eval_iters: int = Field(10, gt=0)
    """Validation micro-batches per evaluation, over all data-parallel ranks: the split's first
    eval_iters, as one process evaluates them, in every layout (a rank with fewer of them runs
    as many forward passes as the others; the extra ones count nothing)."""
    grad_clip: float = Field(1.0, ge=0)
    """Clip the global gradient norm to this value (0 disables clipping)."""
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    """Compute precision: autocast to bf16 or fp16 (fp16 with dynamic loss scaling) over
    fp32 weights; `auto` is bf16 on a CUDA device that supports it, fp32 otherwise."""
    compile: bool = False
    """Compile each transformer block with torch.compile."""
    fp8: bool | Literal["tensorwise", "rowwise", "rowwise_with_gw_hp", "mxfp8"] = False
    """Run the blocks' linear layers in float8 through torchao's float8 training
    (`pip install torchao`): `tensorwise` (one dynamic scale per tensor; `true` means this),
    `rowwise` (one per row, scales rounded to powers of 2), `rowwise_with_gw_hp` (rowwise,
    the weight gradient in high precision); `mxfp8` is refused (a torchao prototype). The
    output layer, the MoE router and routed experts, and matrices with a dimension not a
    multiple of 16 stay in high precision (the start-up line lists them). Any layout. Needs
    a GPU with FP8 tensor cores (compute capability 8.9+) unless emulated
    (train.fp8_emulate)."""
    fp8_emulate: bool | None = None
    """Emulate the float8 matmuls (the same casts, scales and autograd; the product of the
    dequantised operands in float32): None = on CPU only (one start-up line says so), true
    also on a GPU (debugging), false on CPU is refused."""
    fp8_all_gather: bool = True
    """Under FSDP (parallel.zero >= 1) all-gather the float8 weights instead of the high
    precision ones (half the bytes of bf16). Tensorwise scaling only (other recipes
    all-gather in high precision)."""
    fp8_recompute_weight: bool = False
    """torchtitan's force_recompute_fp8_weight_in_bwd: cast the weight to float8 again in
    backward instead of keeping its float8 copy. torchao 0.18 always does this (its
    Float8Linear saves the high-precision weight), so both values run the same; kept for
    configs written for torchtitan."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Device to train on; `auto` picks CUDA when present."""

    @property
    def rows_per_micro_batch(self) -> int:
        """Sequences through the model a micro-batch: micro_batch_size, twice that under
        objective = "dpo" (a pair is two rows, chosen and rejected)."""
        return self.micro_batch_size * (2 if self.objective == "dpo" else 1)

    @property
    def tokens_per_step(self) -> int:
        """Tokens through the model a step: global_batch_size x seq_len, twice that under
        objective = "dpo" (a pair is two rows, chosen and rejected)."""
        return self.global_batch_size * self.seq_len * (2 if self.objective == "dpo" else 1)


class ParallelConfig(Section):
    """Degrees multiply to the world size: dp_replicate * dp_shard * cp * tp * pp. Applied in a
    fixed order: pipeline split -> tensor parallel -> activation checkpointing -> compile ->
    data parallel (DDP or FSDP2)."""

    dp_replicate: int = Field(1, gt=0)
    """Data-parallel replicas that hold the same (sharded) state: the replicate dimension of
    HSDP (zero >= 1). With zero = 0 every data-parallel rank is a replica."""
    dp_shard: int = Field(-1, ge=-1)
    """Data-parallel ranks that shard ZeRO state (zero >= 1) among themselves; -1 means all
    processes the other degrees leave. With zero = 0 nothing is sharded: these ranks are
    replicas too (counted into dp_replicate; an explicit value > 1 gets a one-line note)."""
    tp: int = Field(1, gt=0)
    """Tensor-parallel degree (Megatron column/row split of attention and MLP, vocab-parallel
    embedding and loss); divides heads, key/value heads, ffn_hidden and the padded
    vocabulary (model.vocab_pad_to)."""
    pp: int = Field(1, gt=0)
    """Pipeline-parallel degree: the layers are split into pp (x pp_virtual_stages) stages."""
    cp: int = Field(1, gt=0)
    """Context-parallel degree: each sequence is split over cp ranks (long context), every
    rank computing attention and the loss for its part; any device (CPU/gloo included), with
    every other degree, document masks and MoE. train.seq_len must divide into 2*cp chunks
    (cp_load_balance) and, with sequence parallelism, seq_len/cp by tp."""
    cp_mode: Literal["allgather", "ulysses"] = "allgather"
    """allgather: each rank keeps its queries and all-gathers keys and values along the
    sequence (before GQA expansion: only KV heads move); any mask. ulysses: all-to-all to
    head-sharded before attention and back after (DeepSpeed-Ulysses); the query and KV head
    counts per tensor-parallel rank must divide by cp."""
    cp_load_balance: bool = True
    """Cut the sequence into 2*cp chunks, rank r holding chunks r and 2*cp-1-r, so causal
    attention costs every rank the same; false: rank r holds the r-th of cp pieces."""
    ep: int = Field(1, gt=0)
    """Expert-parallel degree (Mixture-of-Experts models): each MoE layer's routed experts
    are split over ep ranks, which send each token to its experts' ranks and back with
    all-to-all. ep borrows ranks from dp_shard x cp x tp (it adds no processes), which it
    divides, and divides model.moe_experts; the experts' own data-parallel group is the rest
    of them (dp_shard x cp x tp / ep ranks, times dp_replicate, sharded as the ZeRO stage says).
    Needs zero >= 1. Under tp, MoE layers run on each rank's part of the sequence (they need
    sequence_parallel)."""
    zero: Literal["auto", 0, 1, 2, 3] = "auto"
    """ZeRO stage over the dp_shard ranks: 0 = replicated data parallel (DDP's bucketed
    all-reduce overlapped with the backward pass; beside tp/pp, FSDP2 with a shard group of
    one, as torchtitan's replicate: gradients all-reduced once per step); 1 = optimizer state
    sharded (gradients reduce-scattered once per step: Megatron's distributed optimizer);
    2 = + gradients sharded (reduce-scattered every micro-batch); 3 = + parameters sharded
    (FSDP2: gathered for each block's forward and backward). auto = 0 for pure data
    parallelism (and one process), 1 beside tp, pp, cp or ep or with an explicit
    dp_shard > 1."""
    dp_comm_hook: Literal["none", "bf16", "fp16", "powersgd"] = "none"
    """Gradient compression for DDP (zero = 0): all-reduce in bf16/fp16, or PowerSGD rank 2."""
    pp_schedule: Literal["gpipe", "1f1b", "interleaved-1f1b", "zero-bubble"] = "1f1b"
    """Pipeline schedule; interleaved-1f1b and zero-bubble (PyTorch's interleaved zero-bubble)
    use pp_virtual_stages stages per rank."""
    pp_virtual_stages: int = Field(1, gt=0)
    """Stages per pipeline rank (> 1 only with interleaved-1f1b or zero-bubble)."""
    pp_layers_first: int = Field(0, ge=0)
    """Layers in the first pipeline stage, which also holds the embeddings (0: an even
    split)."""
    pp_layers_last: int = Field(0, ge=0)
    """Layers in the last pipeline stage, which also holds the final norm, head and loss (0:
    an even split)."""
    sequence_parallel: bool = True
    """With tp > 1, also shard norms and dropout along the sequence (Megatron SP): less
    activation memory, same communication volume."""
    async_tp: bool = False
    """Asynchronous tensor parallelism (PyTorch's micro-pipelined TP): the compiler splits
    each sequence-parallel all-gather and reduce-scatter of a block into per-rank pieces
    exchanged through symmetric memory while the projections compute on the pieces already
    there. Needs a CUDA GPU, train.compile = true, tp > 1 with sequence_parallel, and a
    torch with symmetric memory; refused elsewhere in one line. Within a node only (NVLink)."""
    activation_checkpointing: Literal["none", "full", "selective", "matmuls"] = "none"
    """Recompute activations in the backward pass: full = keep each block's input, recompute
    the whole block (least memory, +1 forward); selective = torchtitan's per-op policy: keep
    attention outputs, what collectives return and every other matmul output, recompute the
    rest (in a Llama block wk, wo and w3 are recomputed: about +10% time); matmuls = keep every
    matmul and attention output, recompute only element-wise ops (Megatron's "selective":
    most memory of the three, about +3% time). docs/parallelism.md says which to use when."""
    activation_checkpointing_every: int = Field(1, gt=0)
    """Apply activation_checkpointing to every N-th block only (torchtitan's per-layer
    checkpointing): 1 = every block; 2 = blocks 2, 4, 6, ... (counted from 1); the other
    blocks keep all their activations."""
    loss_chunks: int = Field(0, ge=0)
    """Compute the output projection and cross-entropy over this many pieces of each
    micro-batch's tokens, each made again in the backward pass, so that only one piece's
    logits (tokens x vocabulary) exist at once: 1 = the whole micro-batch at once; 0 = as
    many as keep a piece at most 2^28 logits per rank (1 GiB in fp32; 1 for small models).
    Equal to the plain loss in value and gradients; costs one more forward of the output
    projection (about 2% of a Llama 3 8B step)."""
    offload: Literal["none", "optimizer", "params"] = "none"
    """Keep state in host memory: optimizer = AdamW's moments and update on the host
    (ZeRO-Offload; any layout; parameters and gradients stay on the device); params =
    FSDP2 CPU offload of parameters, gradients and the optimizer step (needs zero = 3, CUDA)."""
    auto: bool = False
    """Let the planner choose the layout (degrees, ZeRO stage, micro-batch, activation
    checkpointing, offload) for the actual world size and device memory before the model is
    built; the run logs what it chose and why."""
    timeout_s: int = Field(600, gt=0)
    """Seconds a collective may wait before the job is ended as hung."""

    @model_validator(mode="after")
    def _combinations(self) -> ParallelConfig:
        self.check_combinations()
        return self

    def check_combinations(self) -> None:
        """Raise ValueError if the settings do not go together (run when the section is
        built; public for copies made without validation, e.g. the planner's)."""
        if self.pp_virtual_stages > 1 and self.pp_schedule in ("gpipe", "1f1b"):
            raise ValueError(
                f"pp_virtual_stages={self.pp_virtual_stages} needs an interleaved schedule; set "
                "parallel.pp_schedule='interleaved-1f1b' or 'zero-bubble'"
            )
        if self.dp_comm_hook != "none" and self.zero not in (0, "auto"):
            raise ValueError(
                f"dp_comm_hook={self.dp_comm_hook!r} compresses DDP's all-reduce and needs "
                "zero=0; set parallel.dp_comm_hook='none' to use ZeRO"
            )
        if self.offload == "params" and self.zero not in (3, "auto"):
            raise ValueError(
                "offload='params' is FSDP2's CPU offload and needs parallel.zero=3"
            )

    @property
    def dp_size(self) -> int:
        """Data-parallel degree when dp_shard is explicit (a lower bound when it is -1)."""
        return self.dp_replicate * max(self.dp_shard, 1)


class CheckpointConfig(Section):
    interval: int = Field(200, ge=0)
    """Save every N steps (0: only at the end and on SIGTERM/SIGINT)."""
    keep_last: int = Field(3, gt=0)
    """Checkpoints to keep; older ones are deleted after a newer one is complete."""
    async_save: bool = False
    """Write checkpoints in a background thread (torch.distributed.checkpoint.async_save):
    training continues while the files are written; the checkpoint counts (state.json,
    `latest`) only once every rank has finished."""
    hf_export_interval: int = Field(0, ge=0)
    """Also write a Hugging Face copy of the model (checkpoints/step_N/hf, loadable by
    transformers) with every checkpoint whose step is a multiple of N (0: never)."""
    hf_export_drop_expert_bias: bool = False
    """Let hf_export_interval export an MoE model that trains a balancing bias
    (model.moe_bias_update_rate > 0) without it, as `tessel convert tessel-to-hf
    --drop-expert-bias` does: Mixtral and Qwen3-MoE route without one, so those copies
    compute other logits (hf-export.log says how far they move). Without it such a config is
    refused."""


class RunConfig(Section):
    dir: str = Field("runs/demo", min_length=1, pattern=r"\S")
    """Output directory: config.toml, metrics.jsonl, checkpoints/, TensorBoard events
    (never empty: an empty name would write the run into the current directory)."""
    sample_tokens: int = Field(200, ge=0)
    """Tokens to sample from the model after training (0: no sample)."""
    sample_prompt: str = "def "
    """Prompt for the sample printed after training (with data.source = "sft": the user
    message the model replies to, through the chat template)."""


class Config(BaseModel):
    """A whole run. Build it with `Config.load(path, overrides)`, or with `tessel.load_config`
    (the same, with the model's shape read from the weights of model.init_from)."""

    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)

    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    fault_tolerance: FaultToleranceConfig = Field(default_factory=FaultToleranceConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    lm_eval: LMEvalConfig = Field(default_factory=LMEvalConfig)
    """Benchmark scores through lm-evaluation-harness during training."""
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    alerts: list[AlertConfig] = Field(default_factory=list)
    """Alert rules ([[alerts]] tables)."""
    notify: NotifyConfig = Field(default_factory=NotifyConfig)
    recovery: RecoveryConfig = Field(default_factory=RecoveryConfig)
    watchdog: WatchdogConfig = Field(default_factory=WatchdogConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    dpo: DpoConfig = Field(default_factory=DpoConfig)
    """Preference optimisation (train.objective = "dpo")."""
    run: RunConfig = Field(default_factory=RunConfig)

    @model_validator(mode="after")
    def _cross_checks(self) -> Config:
        t, m = self.train, self.model
        if t.seq_len > m.max_seq_len:
            raise ValueError(
                f"train.seq_len={t.seq_len} exceeds model.max_seq_len={m.max_seq_len}; "
                f"lower train.seq_len or raise model.max_seq_len"
            )
        check_comm_alerts(self.alerts, self.metrics)
        if self.lora.enabled and t.fp8:
            # float8 training swaps the projections for Float8Linear modules: the adapters
            # and their hooks would be dropped
            raise ValueError("lora.enabled does not combine with train.fp8 yet; set one of "
                             "them to false")
        if self.lora.enabled and self.optim.name != "adamw":
            raise ValueError(f"lora.enabled trains its adapters with AdamW only; set "
                             f"optim.name = \"adamw\" (not {self.optim.name!r})")
        if t.objective == "dpo" and not self.dpo.paths:
            raise ValueError("train.objective = \"dpo\" needs preference records; set "
                             "dpo.paths to files of prompt/chosen/rejected records")
        per_step = t.micro_batch_size * self.parallel.dp_size
        if t.global_batch_size % per_step:
            raise ValueError(
                f"train.global_batch_size={t.global_batch_size} is not divisible by "
                f"micro_batch_size*dp={per_step}; use a multiple of {per_step}"
            )
        return self

    # ---- construction (reading and merging: tessel.config.load) -------------------------

    @classmethod
    def load(
        cls,
        path: str | Path | None = None,
        overrides: Mapping[str, Any] | Sequence[str] | None = None,
    ) -> Config:
        """Read a TOML file (or start from the defaults), apply dotted overrides, validate.
        Never reads the weights of model.init_from: `tessel.load_config` does."""
        return cls.from_dict(read_toml(path) if path is not None else {}, overrides)

    @classmethod
    def from_dict(
        cls,
        data: Mapping[str, Any],
        overrides: Mapping[str, Any] | Sequence[str] | None = None,
        *,
        init_fields: Mapping[str, Any] | None = None,
    ) -> Config:
        """`data` (a parsed TOML file) with dotted overrides applied, validated. `init_fields`
        are the model fields fixed by the weights of model.init_from, when the caller read
        them (they sit between the preset and explicit fields; an explicit shape field that
        disagrees is an error)."""
        return validate(cls, merge(cls, data, overrides), init_fields)

    def with_overrides(self, overrides: Mapping[str, Any] | Sequence[str]) -> Config:
        """A new, re-validated config with dotted overrides applied (the model fields this
        one states, e.g. those filled from model.init_from, are kept as they are)."""
        return Config.from_dict(self.to_dict(), overrides)

    # ---- output -------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        """Plain dict without None values (TOML has no null)."""
        return _drop_none(self.model_dump())

    def to_toml(self) -> str:
        import tomli_w

        return tomli_w.dumps(self.to_dict())


def _drop_none(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _drop_none(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_drop_none(v) for v in value]
    return value
