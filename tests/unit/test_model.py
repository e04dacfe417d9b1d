import itertools

import pytest
import torch

from tessel.config import ModelConfig
from tessel.models import PRESETS, build_model, flops_per_token, param_count
from tessel.models.transformer import apply_rope, rope_frequencies

VARIANTS = [
    dict(position=pos, norm=norm, mlp=mlp, n_kv_heads=kv, tie_embeddings=tie, bias=bias)
    for pos, norm, mlp, kv, tie, bias in itertools.product(
        ["learned", "rope"], ["layernorm", "rmsnorm"], ["gelu", "swiglu"], [4, 2, 1],
        [True, False], [True, False],
    )
]


def small(**kw) -> ModelConfig:
    base = dict(preset=None, n_layers=2, d_model=32, n_heads=4, vocab_size=97, max_seq_len=16)
    return ModelConfig(**{**base, **kw})


@pytest.mark.parametrize("variant", VARIANTS, ids=lambda v: "-".join(str(x) for x in v.values()))
def test_variant_shapes_and_param_count(variant):
    cfg = small(**variant)
    model = build_model(cfg, "cpu", seed=0)
    logits = model(torch.randint(0, 97, (3, 11)))
    assert cfg.padded_vocab_size == 128  # 97 ids padded to model.vocab_pad_to=128 rows
    assert logits.shape == (3, 11, 128)
    assert torch.isfinite(logits[..., :97]).all()
    assert (logits[..., 97:] == float("-inf")).all()  # padding ids are never predicted
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    attn = model.layers["0"].attention
    assert attn.wk.weight.shape == (cfg.n_kv_heads * 8, 32)  # grouped-query K/V
    assert (model.output.weight is model.tok_embeddings.weight) == cfg.tie_embeddings
    assert (model.pos_embeddings is None) == (cfg.position == "rope")
    assert (model.layers["0"].feed_forward.w3 is None) == (cfg.mlp == "gelu")
    assert (attn.wq.bias is None) == (not cfg.bias)
    norm_cls = torch.nn.RMSNorm if cfg.norm == "rmsnorm" else torch.nn.LayerNorm
    assert isinstance(model.norm, norm_cls)


@pytest.mark.parametrize("variant", [
    dict(position="rope", norm="rmsnorm", mlp="swiglu", n_kv_heads=2, bias=False),
    dict(position="learned", norm="layernorm", mlp="gelu", n_kv_heads=4, bias=True),
], ids=["llama", "gpt"])
def test_own_head_width_and_qk_norm(variant):
    """model.head_dim (heads wider than d_model / n_heads) and model.qk_norm (Qwen3): the
    shapes, the exact counts, and defaults that leave every other model as it was."""
    cfg = small(**variant, head_dim=12, qk_norm=True)
    assert (cfg.head_dim, cfg.q_dim) == (12, 48)
    model = build_model(cfg, "cpu", seed=0)
    attn = model.layers["0"].attention
    assert attn.wq.weight.shape == (48, 32) and attn.wo.weight.shape == (32, 48)
    assert attn.wk.weight.shape == (cfg.n_kv_heads * 12, 32)
    assert attn.q_norm.weight.shape == attn.k_norm.weight.shape == (12,)
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)
    assert torch.isfinite(model(torch.randint(0, 97, (2, 9)))[..., :97]).all()
    # FLOPs per layer: 6 x the wider q/o and k/v weights, and attention over 48-wide queries
    # (12 x q_dim x seq_len) instead of 32.
    base = small(**variant)
    kv = cfg.n_kv_heads * 12 - base.n_kv_heads * 8
    assert flops_per_token(cfg, 16) - flops_per_token(base, 16) == 2 * (
        6 * (2 * 32 * 16 + 2 * 32 * kv) + 12 * 16 * 16)
    # QK-norm normalises each head: scaling the query weights changes nothing (up to the
    # epsilon, made negligible here).
    model = build_model(cfg.model_copy(update={"norm_eps": 1e-12}), "cpu", seed=0)
    x = torch.randint(0, 97, (2, 9))
    with torch.no_grad():
        before = model(x)
        model.layers["0"].attention.wq.weight.mul_(3.0)
        torch.testing.assert_close(model(x), before, rtol=1e-5, atol=1e-6)
    # Defaults: the head width d_model / n_heads, no QK-norm parameters.
    plain = build_model(base, "cpu", seed=0)
    assert base.head_dim == 8 and plain.layers["0"].attention.q_norm is None
    assert not any("q_norm" in n for n, _ in plain.named_parameters())
    # Without divisibility the head width must be given.
    with pytest.raises(ValueError, match="or set model.head_dim"):
        small(d_model=30)
    assert small(d_model=30, head_dim=8).q_dim == 32


@pytest.mark.parametrize("variant", VARIANTS[::7])
def test_causal_future_tokens_do_not_change_past_logits(variant):
    model = build_model(small(**variant), "cpu", seed=1).eval()
    x = torch.randint(0, 97, (2, 12))
    y = x.clone()
    y[:, 7:] = torch.randint(0, 97, (2, 5))  # change only positions >= 7
    with torch.no_grad():
        a, b = model(x), model(y)
    torch.testing.assert_close(a[:, :7], b[:, :7], rtol=0, atol=1e-6)
    assert not torch.allclose(a[:, 7:], b[:, 7:])


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_param_count_matches_formula_on_meta(name):
    cfg = ModelConfig(preset=name)
    model = build_model(cfg, "meta")  # 405B shapes cost no memory on meta
    assert all(p.is_meta for p in model.parameters())
    assert sum(p.numel() for p in model.parameters()) == param_count(cfg)


def test_published_parameter_counts():
    # Published counts are of the unpadded vocabulary; the default padding (50257 -> 50304
    # rows) adds 47 real rows of d_model each, counted like Megatron counts them.
    assert param_count(ModelConfig(preset="gpt2-124m", vocab_pad_to=1)) == 124_439_808
    assert param_count(ModelConfig(preset="gpt2-350m", vocab_pad_to=1)) == 354_823_168
    assert param_count(ModelConfig(preset="gpt2-124m")) == 124_439_808 + 47 * 768
    assert param_count(ModelConfig(preset="gpt2-350m")) == 354_823_168 + 47 * 1024
    assert param_count(ModelConfig(preset="llama3-8b")) == 8_030_261_248
    assert param_count(ModelConfig(preset="llama3-70b")) == 70_553_706_496
    assert param_count(ModelConfig(preset="llama3-1b")) == 1_235_814_400


def test_flops_per_token_formula():
    cfg = ModelConfig(preset="gpt2-124m")
    d, L, V, T = 768, 12, 50304, 1024  # the padded vocabulary: its rows are computed
    matmul = L * (4 * d * d + 8 * d * d) + V * d
    assert flops_per_token(cfg, T) == 6 * matmul + 12 * L * d * T
    unpadded = ModelConfig(preset="gpt2-124m", vocab_pad_to=1)
    assert flops_per_token(cfg, T) - flops_per_token(unpadded, T) == 6 * (50304 - 50257) * d
    # attention term grows with the sequence, the rest does not
    assert flops_per_token(cfg, 2048) - flops_per_token(cfg, 1024) == 12 * L * d * 1024


def test_init_is_deterministic_and_seeded():
    cfg = small()
    a, b, c = build_model(cfg, seed=5), build_model(cfg, seed=5), build_model(cfg, seed=6)
    for (n, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters()):
        assert torch.equal(pa, pb), n
        if pa.ndim == 2:
            assert not torch.equal(pa, pc), n
    wo = a.layers["0"].attention.wo.weight
    assert wo.std() < a.layers["0"].attention.wq.weight.std()  # residual projections scaled down


def test_rope_rotates_pairs_and_preserves_norm():
    freqs = rope_frequencies(8, 16, 10000.0)
    x = torch.randn(2, 16, 3, 8)
    y = apply_rope(x, freqs)
    torch.testing.assert_close(y.norm(dim=-1), x.norm(dim=-1))
    torch.testing.assert_close(y[:, 0], x[:, 0])  # position 0 is not rotated
    # relative property: <R_m q, R_n k> depends only on m - n
    q, k = torch.randn(8), torch.randn(8)
    def rot(v, pos):
        return apply_rope(v.expand(1, 16, 1, 8).contiguous(), freqs)[0, pos, 0]
    torch.testing.assert_close(rot(q, 5) @ rot(k, 3), rot(q, 9) @ rot(k, 7))


@pytest.mark.parametrize("variant", VARIANTS[::11])
def test_document_mask_keeps_attention_inside_documents(variant):
    model = build_model(small(**variant), "cpu", seed=2).eval()
    x = torch.randint(0, 97, (2, 12))
    docs = torch.tensor([[0] * 5 + [1] * 7, [0] * 12])
    y = x.clone()
    y[0, :5] = torch.randint(0, 97, (5,))  # change document 0 of the first row only
    with torch.no_grad():
        a, b = model(x, docs), model(y, docs)
        plain = model(x)
    torch.testing.assert_close(a[0, 5:], b[0, 5:], rtol=0, atol=1e-6)
    assert not torch.allclose(a[0, :5], b[0, :5])
    torch.testing.assert_close(a[1], plain[1], rtol=1e-5, atol=1e-6)  # one document == causal
    assert not torch.allclose(a[0, 5:], plain[0, 5:])


@pytest.mark.parametrize("position", ["learned", "rope"])
def test_a_packed_step_equals_the_sum_of_its_documents_run_alone(position):
    """What shows the document mask and the position restart are right: the summed loss and
    every gradient of one packed sequence equal those of its documents run separately
    (float64 but for RoPE's rotation, which is float32: compared to float32's precision)."""
    import torch.nn.functional as F

    model = build_model(small(position=position, mlp="swiglu", n_kv_heads=2), "cpu",
                        seed=3).double()
    lengths = [5, 7, 4]  # three documents packed into one sequence of 16
    tokens = torch.randint(0, 97, (1, 16))
    targets = torch.randint(0, 97, (1, 16))
    docs = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))[None]

    def loss_and_grads(x, y, d):
        model.zero_grad()
        loss = F.cross_entropy(model(x, d)[0], y[0], reduction="sum")
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    packed, packed_grads = loss_and_grads(tokens, targets, docs)
    alone, alone_grads = torch.zeros((), dtype=torch.float64), None
    start = 0
    for n in lengths:
        loss, grads = loss_and_grads(tokens[:, start:start + n], targets[:, start:start + n], None)
        alone += loss
        alone_grads = grads if alone_grads is None else [a + g for a, g in zip(alone_grads, grads)]
        start += n
    torch.testing.assert_close(packed, alone, rtol=1e-7, atol=1e-7)
    for (name, _), a, b in zip(model.named_parameters(), packed_grads, alone_grads):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8, msg=name)
    if position == "rope":  # relative: a shift inside a document changes no score
        return
    # Learned positions without the restart (running on across documents) differ.
    from tessel.models import transformer

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(transformer, "document_positions",
                   lambda d: torch.arange(d.shape[1]).expand_as(d))
        running_on, _ = loss_and_grads(tokens, targets, docs)
    assert not torch.allclose(running_on, alone, rtol=1e-7, atol=1e-7)


def test_document_positions_restart_at_each_document():
    from tessel.models.transformer import document_positions

    docs = torch.tensor([[0, 0, 1, 1, 1, 2], [3, 3, 3, 3, 3, 3]])
    assert document_positions(docs).tolist() == [[0, 1, 0, 1, 2, 0], [0, 1, 2, 3, 4, 5]]


def test_flex_attention_block_mask_equals_the_dense_document_mask():
    """The CUDA path (FlexAttention with a block mask) against the CPU path (SDPA with the
    dense mask), forward on CPU: FlexAttention has no CPU backward in torch 2.13, so the
    training step on CPU always takes the dense mask."""
    import warnings

    from tessel.models.transformer import document_block_mask, document_causal_mask

    model = build_model(small(position="rope", n_kv_heads=2), "cpu", seed=4).eval()
    x = torch.randint(0, 97, (2, 16))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])
    freqs = model.rope_freqs[torch.zeros(2, 16, dtype=torch.long)]
    h = model.tok_embeddings(x)
    block = model.layers["0"]
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        dense = block(h, freqs, document_causal_mask(docs))
        flex = block(h, freqs, document_block_mask(docs))
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)


def test_the_model_with_a_flex_document_mask_compiles_without_graph_breaks():
    """The CUDA document path traced by torch.compile on CPU (no backward: see above): the
    block mask is built and used inside one graph. backend="eager" keeps the check to
    Dynamo's tracing, which is where graph breaks happen."""
    from tessel.models import transformer

    model = build_model(small(position="rope"), "cpu", seed=5).eval()
    x = torch.randint(0, 97, (2, 16))
    docs = torch.tensor([[0] * 9 + [1] * 7, [0] * 16])

    def forward(tokens, doc_ids):
        mask = transformer.document_block_mask(doc_ids)
        freqs = model.rope_freqs[transformer.document_positions(doc_ids)]
        h = model.tok_embeddings(tokens)
        for block in model.layers.values():
            h = block(h, freqs, mask)
        return model.output(model.norm(h))

    torch._dynamo.reset()
    with torch.no_grad():
        want = model(x, docs)  # the dense CPU path
        # fullgraph=True: any graph break is an error
        got = torch.compile(forward, backend="eager", fullgraph=True)(x, docs)
    torch.testing.assert_close(got[..., :97], want[..., :97], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("with_docs", [False, True])
def test_flex_block_mask_of_context_parallel_rows_equals_the_dense_mask(with_docs):
    """The CUDA path of context parallelism (query rows at their global positions against
    every key, FlexAttention's block mask) against the CPU path (the dense additive mask),
    forward on CPU; both against the whole sequence's attention at those rows."""
    import warnings

    from tessel.models.attention import attend, attention_mask
    from tessel.parallel.context import chunk_positions

    B, T, H, hd = 2, 16, 4, 8
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, H, hd, generator=gen) for _ in range(3))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16]) if with_docs else None
    rows = chunk_positions(T, 4, 1, balanced=True).expand(B, -1)  # chunks 1 and 6 of 8
    whole = attend(q, k, v, attention_mask(docs, None, T, q.device, flex=False, dtype=q.dtype))
    dense = attend(q.gather(1, rows[..., None, None].expand(-1, -1, H, hd)), k, v,
                   attention_mask(docs, rows, T, q.device, flex=False, dtype=q.dtype))
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is unfused
        flex = attend(q[:, rows[0]], k, v,
                      attention_mask(docs, rows, T, q.device, flex=True, dtype=q.dtype))
    torch.testing.assert_close(dense, whole[:, rows[0]], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(flex, dense, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("autocast", [False, True], ids=["fp32", "bf16-autocast"])
def test_every_layer_keeps_the_one_dense_mask_and_computes_what_a_boolean_mask_does(autocast):
    """The dense (CPU) mask is made once per forward, additive in the queries' dtype, and
    every layer keeps that one tensor for backward. Handed a boolean mask, SDPA converts it
    in every layer and autograd keeps each copy: under context parallelism at 8,192 tokens
    that was more memory than the rank's whole share of activations. The values are what
    SDPA's own conversion gives (bit for bit)."""
    from tessel.models.transformer import document_causal_mask, document_positions

    T = 16
    model = build_model(small(position="rope", n_layers=4), "cpu", seed=6)
    x = torch.randint(0, 97, (2, T))
    docs = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 9 + [1] * 7])
    masks: set[int] = set()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.shape[-2:] == (T, T):  # nothing else the model saves is positions x positions
            masks.add(t.untyped_storage().data_ptr())
        return t

    with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = model(x, docs)
        h = model.tok_embeddings(x)
        freqs = model.rope_freqs[document_positions(docs)]
        for block in model.layers.values():  # each layer handed the boolean mask
            h = block(h, freqs, document_causal_mask(docs))
        want = model.output(model.norm(h))
    assert len(masks) == 1, f"{len(masks)} dense masks kept for 4 layers"
    torch.testing.assert_close(got[..., :97], want[..., :97], rtol=0, atol=0)
