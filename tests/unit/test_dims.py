"""ParallelDims: degrees checked against the world size, the model and the batch, with
messages that say what to change."""

from __future__ import annotations

import pytest

from tessel.config import Config
from tessel.parallel.dims import ParallelDims, ParallelError, stage_layer_counts


def dims(world: int, **overrides) -> tuple[ParallelDims, Config]:
    cfg = Config.load(None, {"model.preset": "gpt2-124m", "model.tie_embeddings": False,
                             "model.vocab_size": 50304,  # padded, as nanoGPT and Megatron do
                             "train.seq_len": 1024, "train.micro_batch_size": 1,
                             "train.global_batch_size": 64, **overrides})
    return ParallelDims.from_config(cfg.parallel, world), cfg


def rejected(world: int, **overrides) -> str:
    """The one-line refusal of the layout check the trainer and planner run before launch."""
    from tessel.parallel.check import check_layout

    with pytest.raises(ParallelError) as info:
        d, cfg = dims(world, **overrides)
        check_layout(cfg, d, "cpu", "fp32")
    return str(info.value)


def test_degrees_resolve_and_the_rest_goes_to_dp_shard():
    d, _ = dims(16, **{"parallel.tp": 2, "parallel.pp": 2, "parallel.dp_replicate": 2})
    assert (d.pp, d.dp_replicate, d.dp_shard, d.cp, d.tp) == (2, 2, 2, 1, 2)
    assert d.dp == 4 and d.shape == (2, 2, 2, 1, 2)
    d, _ = dims(8, **{"parallel.dp_shard": 8})
    assert d.dp == 8


def test_degrees_that_do_not_multiply_to_the_world_size():
    msg = rejected(4, **{"parallel.tp": 3, "parallel.pp": 2, "parallel.dp_shard": 1})
    assert msg.startswith("tp*pp*dp*cp = 6 but 4 processes were started")
    assert "tessel train --nproc 6" in msg
    msg = rejected(6, **{"parallel.tp": 4})
    assert "dp_replicate*cp*tp*pp = 4 does not divide the 6 processes" in msg


def test_model_dimensions_must_divide_by_tp():
    assert rejected(5, **{"parallel.tp": 5}).startswith("hidden size 768 is not divisible by tp=5")
    msg = rejected(8, **{"parallel.tp": 8, "model.preset": "tiny-llama",
                         "train.seq_len": 256})
    assert "heads" in msg and "tp=8" in msg
    # GPT-2's 50257 ids divide by no tp, but the default padding (model.vocab_pad_to=128)
    # gives 50304 rows, which tp=2..128 in powers of two divide.
    for tp in (2, 8, 128):
        d, cfg = dims(tp, **{"parallel.tp": tp, "model.vocab_size": 50257,
                             "model.n_heads": 128, "model.d_model": 1024})
        assert cfg.model.padded_vocab_size == 50304
        d.validate(cfg)
    # Without padding (or with too little) the message names the setting that fixes it.
    msg = rejected(2, **{"parallel.tp": 2, "model.vocab_size": 50257, "model.vocab_pad_to": 1})
    assert msg == ("the padded vocabulary (50257 ids padded to 50257 rows, "
                   "model.vocab_pad_to=1) is not divisible by tp=2; set model.vocab_pad_to to "
                   "a multiple of tp (e.g. 2)")
    msg = rejected(256, **{"parallel.tp": 256, "model.vocab_size": 50257,
                           "model.n_heads": 256, "model.d_model": 2048,
                           "train.global_batch_size": 1})
    assert "50304 rows" in msg and "set model.vocab_pad_to to a multiple of tp (e.g. 256)" in msg


def test_layers_that_cannot_be_split_into_stages():
    msg = rejected(5, **{"parallel.pp": 5, "model.n_layers": 24, "train.global_batch_size": 80})
    assert msg.startswith("24 layers cannot be split into pp=5 stages; set parallel.pp_layers_first/last")
    # Lighter first and last stages make it possible: 3 + 6 + 6 + 6 + 3.
    d, cfg = dims(5, **{"parallel.pp": 5, "model.n_layers": 24, "train.global_batch_size": 80,
                        "parallel.pp_layers_first": 3, "parallel.pp_layers_last": 3})
    d.validate(cfg)
    assert stage_layer_counts(24, 5, 3, 3) == [3, 6, 6, 6, 3]
    msg = rejected(2, **{"parallel.pp": 2, "parallel.pp_virtual_stages": 4, "model.n_layers": 6,
                         "parallel.pp_schedule": "interleaved-1f1b"})
    assert "pp=2 x 4 virtual = 8 stages" in msg


@pytest.mark.parametrize("overrides, needle", [
    ({"train.global_batch_size": 12},  # dp_shard = -1: the config alone cannot tell
     "global_batch_size=12 is not divisible by micro_batch_size*dp = 1*8; use a multiple of 8"),
    ({"parallel.pp": 4, "parallel.dp_shard": 2, "train.global_batch_size": 4},
     "2 micro-batches per step cannot fill 4 pipeline stages"),
    ({"parallel.pp": 2, "parallel.dp_shard": 4, "parallel.pp_virtual_stages": 2,
      "parallel.pp_schedule": "interleaved-1f1b", "train.global_batch_size": 12},
     "need micro-batches per step (3) to be a multiple of pp=2"),
    ({"parallel.tp": 4, "parallel.dp_shard": 2, "train.seq_len": 1022},
     "sequence parallelism splits train.seq_len=1022 over tp=4"),
    ({"parallel.cp": 8, "parallel.zero": 1, "train.seq_len": 1000},
     "context parallelism cuts train.seq_len=1000 into 2*cp = 16 equal chunks; use a seq_len "
     "that is a multiple of 16 or change parallel.cp"),
    ({"parallel.cp": 4, "parallel.cp_load_balance": False, "train.seq_len": 1022},
     "context parallelism cuts train.seq_len=1022 into cp = 4 equal chunks"),
    # 1028 divides by tp = 4 and into 2*cp = 4 chunks, but a cp rank's 514 positions do not
    # split over the 4 tp ranks of sequence parallelism
    ({"parallel.cp": 2, "parallel.tp": 4, "train.seq_len": 1028, "model.max_seq_len": 2048},
     "sequence parallelism splits each context-parallel rank's 514 positions (train.seq_len / "
     "cp) over tp=4; use a seq_len that is a multiple of cp*tp = 8"),
    # gpt2-124m: 12 heads (and 12 KV heads); Ulysses at cp 8 cannot split them
    ({"parallel.cp": 8, "parallel.cp_mode": "ulysses"},
     "parallel.cp_mode='ulysses' splits the 12 attention heads (model.n_heads) over cp=8"),
    ({"parallel.cp": 2, "parallel.tp": 4, "parallel.cp_mode": "ulysses"},
     "splits the 3 attention heads per tensor-parallel rank (tp=4) (model.n_heads) over cp=2"),
])
def test_batch_and_sequence_must_divide(overrides, needle):
    assert needle in rejected(8, **overrides)


@pytest.mark.parametrize("overrides, needle", [
    ({"parallel.tp": 2, "parallel.dp_comm_hook": "bf16"}, "set parallel.dp_comm_hook='none'"),
])
def test_combinations_this_build_cannot_run(overrides, needle):
    assert needle in rejected(4, **overrides)


@pytest.mark.parametrize("overrides, zero, replicate, shard", [
    # auto: replicated (DDP) for pure data parallelism, the distributed optimizer beside tp/pp
    ({}, 0, 4, 1),
    ({"parallel.tp": 2}, 1, 1, 2),
    ({"parallel.pp": 2, "model.tie_embeddings": True}, 1, 1, 2),
    ({"parallel.cp": 2}, 1, 1, 2),
    ({"parallel.cp": 2, "parallel.zero": 0}, 0, 2, 1),  # replicated beside cp too
    ({"parallel.dp_shard": 4}, 1, 1, 4),  # sharding asked for
    ({"parallel.offload": "params"}, 3, 1, 4),
    # zero 0 beside tp/pp: plain replication (every data-parallel rank a replica)
    ({"parallel.tp": 2, "parallel.zero": 0}, 0, 2, 1),
    ({"parallel.pp": 2, "parallel.zero": 0}, 0, 2, 1),
    ({"parallel.zero": 2}, 2, 1, 4),
])
def test_layout_defaults_that_work(overrides, zero, replicate, shard):
    from tessel.parallel.dims import resolve_zero, resolved

    d, cfg = dims(4, **overrides)
    d.validate(cfg)
    assert resolve_zero(cfg.parallel) == zero
    assert (d.dp_replicate, d.dp_shard) == (replicate, shard)
    assert resolved(cfg)[0].parallel.zero == zero


def test_dp_shard_with_zero_0_reads_as_replicas_with_a_note():
    from tessel.parallel.dims import resolved

    d, cfg = dims(4, **{"parallel.zero": 0, "parallel.dp_shard": 4})
    assert (d.dp_replicate, d.dp_shard) == (4, 1)
    note = resolved(cfg)[1]
    assert note is not None and "\n" not in note
    assert "parallel.dp_shard=4 with parallel.zero=0 shards nothing" in note
    assert "parallel.dp_replicate=4" in note
    assert resolved(dims(4, **{"parallel.zero": 0})[1])[1] is None


def test_one_process_accepts_the_defaults():
    d, cfg = dims(1)
    d.validate(cfg)
    assert d.describe() == "dp=1 (replicate 1 x shard 1), tp=1, pp=1, cp=1"


MOE = {"model.preset": "tiny-moe", "train.seq_len": 64}


@pytest.mark.parametrize("world, overrides, needle", [
    (2, {"parallel.ep": 2, "model.preset": "tiny", "train.seq_len": 64},
     "parallel.ep=2 splits the experts of Mixture-of-Experts layers, and this model has none "
     "(model.moe_experts=0); set parallel.ep=1"),
    (3, {**MOE, "parallel.ep": 3, "train.global_batch_size": 3},
     "parallel.ep=3 does not divide model.moe_experts=8; choose an ep that divides"),
    (2, {**MOE, "parallel.ep": 2, "parallel.zero": 0},
     "parallel.zero=0 replicates every parameter and expert parallelism splits the experts; "
     "set parallel.zero >= 1 (or auto)"),
    # ep borrows from dp_shard: here 2 shard ranks x 2 replicas
    (4, {**MOE, "parallel.ep": 4, "parallel.dp_replicate": 2},
     "parallel.ep=4 borrows its ranks from the dp_shard x cp x tp = 2 data-parallel shard, "),
    (4, {**MOE, "parallel.ep": 2, "model.moe_ffn_hidden": 65},
     "model.moe_ffn_hidden=65 is not divisible by the experts' shard group dp_shard*cp*tp/ep = 2"),
])
def test_expert_parallel_layouts_that_cannot_run(world, overrides, needle):
    msg = rejected(world, **overrides)
    assert needle in msg and "\n" not in msg


def test_expert_parallelism_borrows_from_dp_shard_and_implies_zero_1():
    from tessel.parallel.dims import resolve_zero

    d, cfg = dims(8, **MOE, **{"parallel.ep": 4, "parallel.dp_replicate": 2})
    d.validate(cfg)
    assert (d.dp_replicate, d.dp_shard, d.ep, d.efsdp, d.world_size) == (2, 4, 4, 1, 8)
    assert resolve_zero(cfg.parallel) == 1 and "ep=4" in d.describe()
