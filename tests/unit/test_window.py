"""Sliding windows and Gemma's conventions, piece by piece: the masks (HF's rule, with
documents, and the rows of context parallelism on global positions), the FLOPs a window
leaves, the embedding scale's rounding, and the config's one-line refusals."""

from __future__ import annotations

import pytest
import torch

from tessel.config import ConfigError, ModelConfig
from tessel.config.load import validate
from tessel.models import flops_per_token
from tessel.models.attention import attention_mask
from tessel.models.variants import scale_embeddings, window_flops_share


def allowed(mask: torch.Tensor) -> torch.Tensor:
    return mask == 0  # the additive mask: 0 where a key is seen


def test_window_mask_is_transformers_rule_within_documents_and_on_global_positions():
    T, W = 24, 5
    docs = torch.tensor([[0] * 10 + [1] * 14, [0] * 24])
    mask = attention_mask(docs, None, T, torch.device("cpu"), False, torch.float32, W)
    q, kv = torch.arange(T)[:, None], torch.arange(T)
    # transformers' sliding_window_causal_mask_function: kv <= q and kv > q - window
    rule = (kv <= q) & (kv > q - W)
    same = docs[:, :, None] == docs[:, None, :]
    assert torch.equal(allowed(mask)[:, 0], rule & same)
    # Without documents the window still applies (the global layers' mask is None there).
    plain = attention_mask(None, None, T, torch.device("cpu"), False, torch.float32, W)
    assert attention_mask(None, None, T, torch.device("cpu"), False, torch.float32) is None
    assert torch.equal(allowed(plain)[0, 0], rule)
    # Context parallelism: a rank's query rows at their global positions see what the
    # same rows of the whole sequence see.
    rows = torch.tensor([[0, 1, 2, 3, 20, 21, 22, 23]] * 2)
    part = attention_mask(docs, rows, T, torch.device("cpu"), False, torch.float32, W)
    assert torch.equal(allowed(part)[:, 0], (rule & same)[:, rows[0]])


def test_flops_count_the_keys_a_window_leaves():
    assert window_flops_share(None, 100) == window_flops_share(100, 100) == 1.0
    # window 1: each query sees itself, T keys of the causal T(T+1)/2
    assert window_flops_share(1, 10) == pytest.approx(10 / 55)
    g = ModelConfig(preset="gemma-3-4b")
    full = g.model_copy(update={"sliding_window": None, "layer_types": None})
    T = 8192
    local = sum(g.is_local_layer(i) for i in range(g.n_layers))
    assert local == 34 - 34 // 6  # five local to one global
    expected = 12 * local * g.q_dim * T * (1 - window_flops_share(1024, T))
    assert flops_per_token(full, T) - flops_per_token(g, T) == pytest.approx(expected, abs=1)
    assert flops_per_token(g, 1024) == flops_per_token(full, 1024)  # the window is the sequence


def test_embedding_scale_rounds_as_transformers_does():
    h = torch.ones(2, dtype=torch.bfloat16)
    assert scale_embeddings(h, 3072).tolist() == [55.5, 55.5]  # sqrt(3072) = 55.4256...
    assert scale_embeddings(h.float(), 3072)[0].item() == pytest.approx(3072 ** 0.5)


@pytest.mark.parametrize("fields, message", [
    ({"layer_types": ["full_attention"]}, "layer_types has 1 entries for n_layers=2"),
    ({"layer_types": ["sliding_attention"] * 2}, "model.sliding_window is unset"),
    ({"norm_offset": True, "norm": "layernorm"}, "model.norm_offset needs model.norm"),
    ({"mlp": "geglu", "moe_experts": 4}, "'geglu' is for dense models"),
    ({"sliding_window": 0}, "sliding_window"),
])
def test_config_refusals_are_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as exc:
        validate(ModelConfig, {"preset": "tiny-llama", "n_layers": 2, **fields})
    assert "\n" not in str(exc.value)


@pytest.mark.filterwarnings("ignore")  # flex_attention uncompiled on CPU warns that it is slow
def test_flex_block_masks_with_a_window_equal_the_dense_masks():
    """CUDA's path (FlexAttention's block masks, here evaluated eagerly on CPU) attends as
    the dense masks do: whole sequences and a context-parallel rank's rows, with and without
    documents."""
    from torch.nn.attention.flex_attention import flex_attention

    from tessel.models.attention import attend

    torch.manual_seed(0)
    B, T, H, hd, W = 2, 256, 2, 8, 37
    docs = torch.tensor([[0] * 100 + [1] * 156, [0] * 256])
    q, k, v = (torch.randn(B, T, H, hd) for _ in range(3))
    cpu = torch.device("cpu")
    for rows in (None, torch.cat([torch.arange(0, 64), torch.arange(192, 256)]).expand(B, -1)):
        for d in (docs, None):
            dense = attention_mask(d, rows, T, cpu, False, torch.float32, W)
            block = attention_mask(d, rows, T, cpu, True, torch.float32, W)
            qq = q if rows is None else q[:, rows[0]]
            want = attend(qq, k, v, dense, scale=0.3)
            got = flex_attention(qq.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                 block_mask=block, scale=0.3).transpose(1, 2)
            assert (got - want).abs().max() < 1e-5, (rows is None, d is None)
