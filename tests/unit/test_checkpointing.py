"""Activation checkpointing policies (tessel.parallel.checkpointing) and the chunked loss
(tessel.models.loss): each equals the plain computation in value and every gradient, and
each keeps what it says it keeps. Per rank under layouts: tests/distributed/test_layouts.py;
the planner's prediction of what each keeps: tests/unit/test_planner_memory.py."""

from __future__ import annotations

import copy

import pytest
import torch

from tessel.config import Config, ModelConfig
from tessel.models.loss import PIECE_LOGITS, loss_pieces, token_loss_sum
from tessel.models.transformer import build_model
from tessel.parallel.checkpointing import apply_activation_checkpointing, checkpointed_blocks
from tessel.planner.probe import _probe_config
from tessel.planner.record import run_probe

LLAMA = dict(preset="tiny-llama", n_layers=4, vocab_size=500)  # padded to 512: -inf ids
GPT = dict(preset="tiny", n_layers=4, vocab_size=300, tie_embeddings=False)  # biases: addmm


def _run(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, ac: str = "none",
         every: int = 1, chunks: int = 1) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model = copy.deepcopy(model)
    apply_activation_checkpointing(model, ac, every)
    model.loss_chunks = chunks
    loss = model(x, targets=y).sum() if chunks > 1 else token_loss_sum(model(x), y)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _same_gradients(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> None:
    """Each gradient within 1e-6 of its own largest element (floored at 1e-7 of the model's
    largest: a gradient that is zero in exact arithmetic, e.g. the key projection's bias,
    whose shift softmax ignores, holds only rounding noise)."""
    scale = max(g.abs().max().item() for g in want.values())
    for name, g in want.items():
        err = (got[name] - g).abs().max().item()
        assert err <= 1e-6 * g.abs().max().item() + 1e-7 * scale, (name, err)


@pytest.fixture(scope="module", params=[LLAMA, GPT], ids=["llama", "gpt"])
def case(request):
    torch.manual_seed(0)
    m = ModelConfig(**request.param)
    model = build_model(m, seed=0)
    x = torch.randint(0, m.vocab_size, (3, 29))
    y = torch.randint(0, m.vocab_size, (3, 29))
    y[0, :7] = -100  # fine-tuning's unlearned targets
    y[2, 20:] = -100
    return model, x, y, _run(model, x, y)


@pytest.mark.parametrize("chunks", [2, 5, 87, 200])  # 87 = every token alone; 200 > tokens
def test_the_chunked_loss_equals_the_whole_loss_and_its_gradients(case, chunks):
    model, x, y, (loss, grads) = case
    got, got_grads = _run(model, x, y, chunks=chunks)
    assert got == pytest.approx(loss.item(), rel=1e-6)
    _same_gradients(got_grads, grads)


@pytest.mark.parametrize("chunks", [2, 5, 200])
def test_each_rows_loss_over_pieces_equals_the_whole_logits_rows(case, chunks):
    """`row_losses` (preference tuning: each row's summed loss): the rows' sums of the whole
    logits' token losses, in value and in the gradients of a weighted sum of them (the
    DPO loss weighs each row differently)."""
    from tessel.train.dpo import row_logps

    model, x, y, _ = case
    weights = torch.tensor([0.5, -2.0, 1.5])  # each row's own share of the loss
    whole = copy.deepcopy(model)
    want = -row_logps(whole(x), y)[0]
    (want * weights).sum().backward()
    pieces = copy.deepcopy(model)
    pieces.loss_chunks, pieces.row_losses = chunks, True
    got = pieces(x, targets=y)
    assert got.shape == (3,)
    (got * weights).sum().backward()
    assert torch.allclose(got, want, rtol=1e-6)
    _same_gradients({n: p.grad for n, p in pieces.named_parameters()},
                    {n: p.grad for n, p in whole.named_parameters()})


@pytest.mark.parametrize("ac, every, chunks", [("selective", 1, 1), ("matmuls", 1, 1),
                                               ("full", 1, 1), ("selective", 2, 3),
                                               ("full", 3, 1), ("matmuls", 2, 4)])
def test_every_policy_gives_the_plain_gradients(case, ac, every, chunks):
    model, x, y, (loss, grads) = case
    got, got_grads = _run(model, x, y, ac, every, chunks)
    assert got == pytest.approx(loss.item(), rel=1e-6)
    _same_gradients(got_grads, grads)


@pytest.mark.parametrize("shape, kept", [
    (LLAMA, {"attention.wq", "attention.wv", "feed_forward.w1", "feed_forward.w2"}),
    # GELU MLP: wq (1), wv (3), w1 (5) kept; wk (2), wo (4), w2 (6) made again
    (GPT, {"attention.wq", "attention.wv", "feed_forward.w1"}),
])
def test_the_per_op_policy_keeps_every_other_matmul_and_the_attention(shape, kept):
    """torchtitan's policy: the 1st, 3rd, 5th, ... matmul output of each block, and the
    attention kernel's outputs; `matmuls` keeps every matmul output."""
    m = _probe_config(ModelConfig(**shape), 0.0)
    _, outputs, _ = run_probe(m, "fp32", False)
    block = {r.where for r in outputs["selective"] if r.where.startswith(("attention", "feed"))}
    assert block == kept | {"attention"}
    every = {r.where for r in outputs["matmuls"] if r.where.startswith(("attention", "feed"))}
    assert every == {"attention", "attention.wq", "attention.wk", "attention.wv",
                     "attention.wo", "feed_forward.w1", "feed_forward.w2"} | (
                         {"feed_forward.w3"} if shape is LLAMA else set())


def test_per_layer_checkpointing_wraps_every_nth_block_only():
    assert list(checkpointed_blocks(6, 1)) == [0, 1, 2, 3, 4, 5]
    assert list(checkpointed_blocks(6, 2)) == [1, 3, 5]  # torchtitan counts layers from one
    assert list(checkpointed_blocks(7, 3)) == [2, 5]
    model = build_model(ModelConfig(**LLAMA))
    plain = {k: b.forward for k, b in model.layers.items()}
    apply_activation_checkpointing(model, "full", 2)
    wrapped = {k for k, b in model.layers.items() if b.forward != plain[k]}
    assert wrapped == {"1", "3"}


def test_the_automatic_piece_count_bounds_each_pieces_logits():
    assert loss_pieces(3, 10**9, 10**6) == 3  # given: as given
    assert loss_pieces(0, 8 * 256, 2048) == 1  # the demo: whole
    n = loss_pieces(0, 2 * 8192, 128256)  # torchtitan's Llama 3 8B micro-batch: 8 pieces
    assert n == 8 and 2 * 8192 * 128256 / n <= PIECE_LOGITS
    assert loss_pieces(0, 2 * 8192 / 2, 128256 / 4) == 1  # cp 2, tp 4: this rank's share


def test_the_config_takes_the_policies_and_refuses_bad_values():
    c = Config.load(None, {"parallel.activation_checkpointing": "matmuls",
                           "parallel.activation_checkpointing_every": 2,
                           "parallel.loss_chunks": 4})
    assert (c.parallel.activation_checkpointing, c.parallel.loss_chunks) == ("matmuls", 4)
    for bad in ({"parallel.activation_checkpointing": "op"},
                {"parallel.activation_checkpointing_every": 0},
                {"parallel.loss_chunks": -1}):
        with pytest.raises(Exception):  # noqa: B017 (a TesselError subclass or pydantic's)
            Config.load(None, bad)


def test_the_per_op_policy_compiles_without_a_graph_break(case):
    """train.compile traces each checkpointed block with its policy (a mutable matmul count):
    fullgraph=True fails on any graph break; the compiled blocks give the eager gradients."""
    model, x, y, (loss, grads) = case
    model = copy.deepcopy(model)
    apply_activation_checkpointing(model, "selective")
    for block in model.layers.values():
        block.compile(backend="eager", fullgraph=True)
    got = token_loss_sum(model(x), y)
    got.backward()
    assert got.item() == pytest.approx(loss.item(), rel=1e-6)
    _same_gradients({n: p.grad for n, p in model.named_parameters()}, grads)
