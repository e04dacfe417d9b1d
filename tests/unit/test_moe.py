"""The MoE layer: permutation + grouped matmuls equal a per-token reference; the auxiliary
losses reach the gradients; counts, presets and config checks."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from tessel.config import Config, ConfigError, ModelConfig
from tessel.models import PRESETS, active_param_count, build_model, flops_per_token, param_count
from tessel.models.moe import MoE, grouped_mm_supported


def moe_cfg(**kw) -> ModelConfig:
    base = dict(preset=None, n_layers=3, d_model=32, n_heads=4, vocab_size=97, max_seq_len=16,
                mlp="swiglu", norm="rmsnorm", position="rope", bias=False, ffn_hidden=64,
                moe_experts=4, moe_top_k=2, moe_ffn_hidden=16, moe_first_dense_layers=1)
    return ModelConfig(**{**base, **kw})


def reference_moe(moe: MoE, x: torch.Tensor) -> torch.Tensor:
    """The layer token by token, slot by slot: what permutation + grouped matmuls must give."""
    h = x.reshape(-1, x.shape[-1])
    _, _, chosen, weights = moe.route(h)
    ex = moe.experts
    rows = []
    for t in range(h.shape[0]):
        acc = torch.zeros_like(h[t])
        for j in range(moe.top_k):
            e = int(chosen[t, j])
            a = h[t] @ ex.w1[e]
            a = F.silu(a) * (h[t] @ ex.w3[e]) if ex.w3 is not None else F.gelu(a, approximate="tanh")
            acc = acc + weights[t, j] * (a @ ex.w2[e])
        if moe.shared is not None:
            acc = acc + moe.shared(h[t])
        rows.append(acc)
    return torch.stack(rows).view_as(x)


def moe_layer(cfg: ModelConfig) -> MoE:
    model = build_model(cfg, seed=3)
    layer = model.layers["1"].feed_forward
    assert isinstance(layer, MoE)
    return layer


@pytest.mark.parametrize("path", ["grouped", "loop", "padded"])
@pytest.mark.parametrize("kw", [
    dict(), dict(mlp="gelu"), dict(moe_shared_experts=2), dict(moe_router="sigmoid"),
    dict(moe_top_k=1), dict(moe_top_k=4),
], ids=["swiglu", "gelu", "shared", "sigmoid", "top1", "top-all"])
def test_layer_matches_per_token_reference(path, kw):
    layer = moe_layer(moe_cfg(**kw))
    layer.experts.path = path
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([0.3, -0.2, 0.0, 0.1]))  # steers the choice only
    x = torch.randn(3, 5, 32)
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-5)


def test_grouped_loop_and_padded_paths_give_the_same_gradients():
    layer = moe_layer(moe_cfg(moe_shared_experts=1))
    assert grouped_mm_supported(torch.device("cpu"), torch.float32, 32, 16)
    x = torch.randn(2, 7, 32)
    grads = []
    for path in ("grouped", "loop", "padded"):
        layer.zero_grad()
        layer.experts.path = path
        xi = x.clone().requires_grad_()
        layer(xi).square().sum().backward()
        grads.append([xi.grad, *(p.grad.clone() for p in layer.parameters())])
    for other in grads[1:]:
        for a, b in zip(grads[0], other):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_grouped_path_needs_16_byte_rows():
    assert not grouped_mm_supported(torch.device("cpu"), torch.float32, 32, 6)  # 24-byte rows
    assert not grouped_mm_supported(torch.device("cpu"), torch.float64, 32, 16)
    layer = moe_layer(moe_cfg(moe_ffn_hidden=6))  # the automatic choice falls back to the loop
    x = torch.randn(2, 3, 32)
    torch.testing.assert_close(layer(x), reference_moe(layer, x), rtol=1e-5, atol=1e-5)


def test_expert_with_no_tokens_gets_zero_gradient():
    layer = moe_layer(moe_cfg(moe_top_k=1))
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # everything to expert 0
    layer.aux_coef = 0.0
    layer(torch.randn(2, 4, 32)).sum().backward()
    assert layer.experts.w1.grad[1:].abs().sum() == 0
    assert layer.experts.w1.grad[0].abs().sum() > 0
    assert layer.tokens_per_expert.tolist() == [8.0, 0.0, 0.0, 0.0]


def test_aux_loss_gradient_is_added_in_backward():
    """AuxLossScaler: the layer's output is unchanged, and its backward adds exactly the
    gradient of grad_scale * (aux_coef * balance + z_coef * z)."""
    layer = moe_layer(moe_cfg(moe_aux_loss_coef=0.5, moe_z_loss_coef=0.1))
    x = torch.randn(2, 6, 32)
    layer.grad_scale = 0.25
    layer(x).sum().backward()
    with_aux = layer.router.weight.grad.clone()

    layer.zero_grad()
    layer.aux_coef = layer.z_coef = 0.0
    layer(x).sum().backward()
    without = layer.router.weight.grad.clone()

    layer.zero_grad()
    w = layer.router.weight
    logits = x.reshape(-1, 32) @ w.T
    probs = logits.softmax(-1)
    _, _, chosen, _ = layer.route(x.reshape(-1, 32))
    frac = torch.zeros(4).scatter_add_(0, chosen.flatten(), torch.ones(chosen.numel())) / chosen.numel()
    balance = 4 * (frac * probs.mean(0)).sum()
    z = torch.logsumexp(logits, -1).square().mean()
    (0.25 * (0.5 * balance + 0.1 * z)).backward()
    torch.testing.assert_close(with_aux - without, w.grad, rtol=1e-4, atol=1e-7)


def test_statistics_count_training_forwards_once_with_activation_checkpointing():
    from torch.utils.checkpoint import checkpoint

    layer = moe_layer(moe_cfg())
    x = torch.randn(2, 5, 32, requires_grad=True)
    checkpoint(layer, x, use_reentrant=False).sum().backward()  # recompute runs forward again
    assert layer.tokens_per_expert.sum().item() == 2 * 5 * 2  # tokens x top_k, once
    layer.reset_stats()
    layer.eval()
    layer(x)
    assert layer.tokens_per_expert.sum().item() == 0  # evaluation is not counted


def test_capacity_factor_drops_and_counts_slots():
    layer = moe_layer(moe_cfg(moe_top_k=1, moe_capacity_factor=1.0))
    with torch.no_grad():
        layer.expert_bias.copy_(torch.tensor([10.0, 0.0, 0.0, 0.0]))  # all 8 tokens to expert 0
    x = torch.randn(1, 8, 32)
    out = layer(x).reshape(8, 32)
    assert layer.dropped.item() == 6  # capacity ceil(1.0 * 8 * 1 / 4) = 2
    assert torch.count_nonzero(out.abs().sum(-1)).item() == 2  # dropped tokens: zero output
    ref = reference_moe(layer, x).reshape(8, 32)
    torch.testing.assert_close(out[:2], ref[:2], rtol=1e-5, atol=1e-5)  # first come, first kept


def test_bias_is_a_checkpointed_buffer_and_stats_are_not():
    model = build_model(moe_cfg(), seed=0)
    keys = set(model.state_dict())
    assert "layers.1.feed_forward.expert_bias" in keys
    assert not any("tokens_per_expert" in k or "aux_sum" in k for k in keys)


def test_parameter_names_and_initialisation():
    cfg = moe_cfg(moe_shared_experts=1)
    model = build_model(cfg, seed=1)
    names = {n for n, _ in model.named_parameters()}
    assert {"layers.0.feed_forward.w1.weight", "layers.1.feed_forward.router.weight",
            "layers.1.feed_forward.experts.w1", "layers.1.feed_forward.experts.w2",
            "layers.1.feed_forward.experts.w3", "layers.2.feed_forward.shared.w2.weight"} <= names
    ex = model.layers["1"].feed_forward.experts
    assert ex.w1.shape == (4, 32, 16) and ex.w2.shape == (4, 16, 32)
    resid = cfg.init_std / (2 * cfg.n_layers) ** 0.5
    assert ex.w2.std().item() == pytest.approx(resid, rel=0.1)
    assert ex.w1.std().item() == pytest.approx(cfg.init_std, rel=0.1)
    again = build_model(cfg, seed=1)
    for (n, a), b in zip(model.named_parameters(), again.parameters()):
        assert torch.equal(a, b), n
    assert not torch.equal(ex.w1[0], ex.w1[1])  # experts differ


@pytest.mark.parametrize("kw", [dict(), dict(mlp="gelu", bias=True, norm="layernorm"),
                                dict(moe_shared_experts=2, moe_every=2),
                                dict(moe_first_dense_layers=0, tie_embeddings=True)])
def test_counts_match_the_built_model(kw):
    cfg = moe_cfg(**kw)
    model = build_model(cfg, "meta")
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    per_expert = (3 if cfg.mlp == "swiglu" else 2) * 32 * 16
    idle = cfg.n_moe_layers * (cfg.moe_experts - cfg.moe_top_k) * per_expert
    assert active_param_count(cfg) == param_count(cfg) - idle
    # FLOPs: 6 x active matmul weights (+ head) + attention; the dense model with the same
    # layers minus idle experts and norms gives the same matmul count.
    dense = ModelConfig(**{**cfg.model_dump(), "moe_experts": 0, "moe_shared_experts": 0,
                           "moe_ffn_hidden": None})
    fpt = flops_per_token(cfg, 16)
    mats = 3 if cfg.mlp == "swiglu" else 2
    moe_mm = 4 * 32 + cfg.moe_top_k * per_expert + mats * 32 * 16 * cfg.moe_shared_experts
    assert fpt - flops_per_token(dense, 16) == 6 * cfg.n_moe_layers * (moe_mm - mats * 32 * 64)


def test_flops_per_token_of_tiny_moe_counts_active_parameters_only():
    """MFU's FLOPs: 6 x the non-embedding parameters a token uses (top_k of the experts, the
    shared ones, the router, attention, the dense layers and the output projection; norms
    are not matmuls) + the attention term 12 x layers x d_model x seq_len."""
    cfg = ModelConfig(preset="tiny-moe")
    T = 32
    model = build_model(cfg, "meta")
    norms = sum(p.numel() for p in model.parameters() if p.ndim == 1)
    attention = 12 * cfg.n_layers * cfg.d_model * T
    assert not cfg.tie_embeddings and cfg.position == "rope"  # the head is counted, no table
    active = active_param_count(cfg, exclude_embeddings=True)
    assert flops_per_token(cfg, T) == 6 * (active - norms) + attention
    # The same from the built model's tensors: every matmul weight but the embedding, each
    # routed expert's at top_k / experts (a token visits top_k of them).
    used = sum(p.numel() * (cfg.moe_top_k / cfg.moe_experts if ".experts." in n else 1)
               for n, p in model.named_parameters() if p.ndim > 1 and n != "tok_embeddings.weight")
    assert flops_per_token(cfg, T) == 6 * used + attention
    # Not the total count: 6 of the 8 experts per MoE layer are idle for each token.
    idle = cfg.n_moe_layers * (cfg.moe_experts - cfg.moe_top_k) * 3 * cfg.d_model * cfg.moe_ffn_hidden
    assert 6 * (param_count(cfg, exclude_embeddings=True) - norms) + attention \
        == flops_per_token(cfg, T) + 6 * idle


def test_moe_presets():
    for name in ("tiny-moe", "mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v3"):
        assert ModelConfig(preset=name).moe_experts > 0
    mixtral = ModelConfig(preset="mixtral-8x7b", vocab_pad_to=1)
    # Mixtral-8x7B's published 46.7B total / 12.9B active: tessel's shape is exact.
    assert param_count(mixtral) == 46_702_792_704
    assert active_param_count(mixtral) == 12_879_925_248
    # Qwen3-30B-A3B's 30.5B / 3.3B (heads of 128 on d_model 2048, QK-norm): the count of
    # transformers' Qwen3MoeForCausalLM of the published config.json, exactly.
    qwen = ModelConfig(preset="qwen3-30b-a3b")
    assert param_count(qwen) == 30_532_122_624
    assert active_param_count(qwen) == 3_353_032_704
    tiny = ModelConfig(preset="tiny-moe")
    assert [tiny.is_moe_layer(i) for i in range(4)] == [False, True, True, True]
    assert "tiny-moe" in PRESETS


@pytest.mark.parametrize("override, message", [
    ("--model.moe_top_k=9", "moe_top_k=9 exceeds moe_experts=8"),
    ("--model.moe_capacity_factor=0", "moe_capacity_factor=0 must be > 0"),
    ("--model.moe_capacity_factor=-1.5", "moe_capacity_factor=-1.5 must be > 0"),
    ("--model.moe_first_dense_layers=4", "leaves no MoE layer"),
    ("--model.moe_router=topk", "model.moe_router"),
])
def test_bad_moe_config_is_one_line(override, message):
    with pytest.raises(ConfigError, match=message):
        Config.load(None, ["--model.preset=tiny-moe", override])


def test_shared_experts_need_routed_ones():
    with pytest.raises(ConfigError, match="moe_shared_experts=1 needs routed experts"):
        Config.load(None, ["--model.moe_shared_experts=1"])


def test_cli_refuses_bad_moe_config_with_exit_2():
    proc = subprocess.run(
        [sys.executable, "-m", "tessel", "train", "--model.preset=tiny-moe",
         "--model.moe_top_k=9"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "moe_top_k=9 exceeds moe_experts=8" in lines[0]



@pytest.mark.slow
@pytest.mark.parametrize("autocast", [None, torch.bfloat16], ids=["fp32-padded", "bf16-grouped"])
def test_layer_compiles_to_one_graph(autocast):
    """fullgraph=True: no graph break (fp32 on CPU takes the padded path: the meta kernel of
    _grouped_mm is bf16-only; bf16 takes _grouped_mm) and the compiled layer equals eager."""
    layer = moe_layer(moe_cfg(moe_shared_experts=1, moe_z_loss_coef=0.01,
                              moe_capacity_factor=1.5))
    compiled = torch.compile(layer, fullgraph=True)
    x = torch.randn(2, 8, 32)
    outs = []
    for fn in (layer, compiled):
        with torch.autocast("cpu", dtype=autocast or torch.float32, enabled=autocast is not None):
            outs.append(fn(x))
    tol = 1e-5 if autocast is None else 2e-2
    torch.testing.assert_close(outs[1].float(), outs[0].float(), rtol=tol, atol=tol)
