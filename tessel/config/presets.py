"""Named model shapes.

A preset is a partial set of `model.*` fields; fields the user sets explicitly win over the
preset (see `tessel.config.ModelConfig`). Shapes follow the published architectures:
GPT-2 (Radford et al. 2019), GPT-3 (Brown et al. 2020, table 2.1, with the head counts
Megatron-LM uses for the sizes whose published head dim does not divide d_model) and Llama 3
(Meta 2024; `llama3-1b` is the Llama 3.2 1B shape). The Mixture-of-Experts shapes follow the
published Hugging Face config.json of each model; what tessel cannot express yet is said at
each of them, and `tessel presets` prints tessel's own exact total and active counts.

Data only, in the config layer (which validates preset names without importing torch);
`tessel.models.presets` re-exports it.
"""

from __future__ import annotations

from typing import Any

_GPT2: dict[str, Any] = dict(
    vocab_size=50257,
    max_seq_len=1024,
    position="learned",
    norm="layernorm",
    norm_eps=1e-5,
    mlp="gelu",
    tie_embeddings=True,
    bias=True,
)
_GPT3: dict[str, Any] = {**_GPT2, "max_seq_len": 2048}
_LLAMA3: dict[str, Any] = dict(
    vocab_size=128256,
    max_seq_len=8192,
    position="rope",
    rope_theta=500000.0,
    norm="rmsnorm",
    norm_eps=1e-5,
    mlp="swiglu",
    tie_embeddings=False,
    bias=False,
    n_kv_heads=8,
)

_MISTRAL: dict[str, Any] = {**_LLAMA3, "vocab_size": 32768, "max_seq_len": 32768,
                            "rope_theta": 1e6, "norm_eps": 1e-5}


def _gemma3(n_layers: int, **shape: Any) -> dict[str, Any]:
    """A Gemma 3 text model (the published Gemma3TextConfig of google/gemma-3-*-pt): five
    local layers of a 1024-token window to one global; local RoPE base 10000, global 1e6
    with linear scaling 8; vocabulary 262,208 padded to a multiple of 64 (no extra rows:
    parameter counts are transformers' own)."""
    kinds = ["sliding_attention" if (i + 1) % 6 else "full_attention" for i in range(n_layers)]
    return dict(
        vocab_size=262208, vocab_pad_to=64, max_seq_len=131072, position="rope",
        rope_theta=1e6, rope_scaling_factor=8.0, rope_scaling_type="linear",
        rope_local_theta=10000.0, sliding_window=1024, layer_types=kinds, norm="rmsnorm",
        norm_eps=1e-6, norm_offset=True, norm_placement="sandwich", mlp="geglu",
        tie_embeddings=True, bias=False, qk_norm=True, embed_scale=True,
        n_layers=n_layers, **{"head_dim": 256, "query_scale": 256 ** -0.5, **shape})


PRESETS: dict[str, dict[str, Any]] = {
    # debug model: trains in seconds on a laptop CPU (bytes or a 512-token BPE)
    "tiny": {**_GPT2, "n_layers": 2, "d_model": 64, "n_heads": 4, "vocab_size": 512,
             "max_seq_len": 256},
    # the embedded demo's model: a few minutes on two CPU cores, with a 2048-token BPE
    "demo": {**_GPT2, "n_layers": 4, "d_model": 192, "n_heads": 6, "vocab_size": 2048,
             "max_seq_len": 256},
    # a Llama-shaped debug model: RoPE, RMSNorm, SwiGLU, GQA, untied, no biases
    "tiny-llama": {**_LLAMA3, "n_layers": 2, "d_model": 64, "n_heads": 4, "n_kv_heads": 2,
                   "ffn_hidden": 192, "vocab_size": 512, "max_seq_len": 256,
                   "rope_theta": 10000.0},
    "gpt2-124m": {**_GPT2, "n_layers": 12, "d_model": 768, "n_heads": 12},
    "gpt2-350m": {**_GPT2, "n_layers": 24, "d_model": 1024, "n_heads": 16},
    "gpt2-774m": {**_GPT2, "n_layers": 36, "d_model": 1280, "n_heads": 20},
    "gpt2-1.5b": {**_GPT2, "n_layers": 48, "d_model": 1600, "n_heads": 25},
    "gpt3-1.3b": {**_GPT3, "n_layers": 24, "d_model": 2048, "n_heads": 16},
    "gpt3-2.7b": {**_GPT3, "n_layers": 32, "d_model": 2560, "n_heads": 32},
    "gpt3-6.7b": {**_GPT3, "n_layers": 32, "d_model": 4096, "n_heads": 32},
    "gpt3-13b": {**_GPT3, "n_layers": 40, "d_model": 5120, "n_heads": 40},
    "gpt3-175b": {**_GPT3, "n_layers": 96, "d_model": 12288, "n_heads": 96},
    "llama3-1b": {**_LLAMA3, "n_layers": 16, "d_model": 2048, "n_heads": 32,
                  "ffn_hidden": 8192, "tie_embeddings": True},
    "llama3-8b": {**_LLAMA3, "n_layers": 32, "d_model": 4096, "n_heads": 32,
                  "ffn_hidden": 14336},
    "llama3-70b": {**_LLAMA3, "n_layers": 80, "d_model": 8192, "n_heads": 64,
                   "ffn_hidden": 28672},
    "llama3-405b": {**_LLAMA3, "n_layers": 126, "d_model": 16384, "n_heads": 128,
                    "ffn_hidden": 53248},
    # ---- sliding-window families (Hugging Face config.json values) ------------------------
    # mistralai/Mistral-7B-v0.3: Llama's layout, no sliding window (v0.1 had 4096)
    "mistral-7b": {**_MISTRAL, "n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8,
                   "ffn_hidden": 14336},
    # google/gemma-3-{4b,12b,27b}: the text models (Gemma3ForCausalLM; no vision tower)
    "gemma-3-4b": _gemma3(34, d_model=2560, n_heads=8, n_kv_heads=4, ffn_hidden=10240),
    "gemma-3-12b": _gemma3(48, d_model=3840, n_heads=16, n_kv_heads=8, ffn_hidden=15360),
    # heads of 128, scores scaled by query_pre_attn_scalar 168 (= d_model / n_heads) ** -0.5
    "gemma-3-27b": _gemma3(62, d_model=5376, n_heads=32, n_kv_heads=16, ffn_hidden=21504,
                           head_dim=128, query_scale=168 ** -0.5),
    # ---- Qwen2.5, Qwen3, OLMo 2 (Hugging Face config.json values; tessel's counts equal
    # transformers' own: 7,615,616,512, 8,190,735,360 and 7,298,617,344) -------------------
    # Qwen/Qwen2.5-7B: biases on q/k/v only; context of the instruct model (base: 131072)
    "qwen2.5-7b": {**_LLAMA3, "n_layers": 28, "d_model": 3584, "n_heads": 28, "n_kv_heads": 4,
                   "ffn_hidden": 18944, "vocab_size": 152064, "max_seq_len": 32768,
                   "rope_theta": 1e6, "norm_eps": 1e-6, "qkv_bias": True},
    # Qwen/Qwen3-8B: heads of 128, per-head QK-norm
    "qwen3-8b": {**_LLAMA3, "n_layers": 36, "d_model": 4096, "n_heads": 32, "n_kv_heads": 8,
                 "head_dim": 128, "ffn_hidden": 12288, "vocab_size": 151936,
                 "max_seq_len": 40960, "rope_theta": 1e6, "norm_eps": 1e-6, "qk_norm": True},
    # allenai/OLMo-2-1124-7B: multi-head, QK-norm over each projection, norms after the
    # sub-layers
    "olmo-2-7b": {**_LLAMA3, "n_layers": 32, "d_model": 4096, "n_heads": 32, "n_kv_heads": 32,
                  "ffn_hidden": 11008, "vocab_size": 100352, "max_seq_len": 4096,
                  "rope_theta": 500000.0, "norm_eps": 1e-6, "qk_norm": True,
                  "qk_norm_scope": "projection", "norm_placement": "post"},
    # ---- Mixture-of-Experts ------------------------------------------------------------
    # a CPU-trainable MoE: tiny-llama's attention, 8 experts (top-2) + 1 shared expert in
    # layers 1-3, layer 0 dense (DeepSeek-style)
    "tiny-moe": {**_LLAMA3, "n_layers": 4, "d_model": 64, "n_heads": 4, "n_kv_heads": 2,
                 "ffn_hidden": 192, "vocab_size": 512, "max_seq_len": 256,
                 "rope_theta": 10000.0, "moe_experts": 8, "moe_top_k": 2,
                 "moe_shared_experts": 1, "moe_ffn_hidden": 64, "moe_first_dense_layers": 1},
    # mistralai/Mixtral-8x7B-v0.1: every layer MoE, 8 experts of 14336, top-2, softmax
    "mixtral-8x7b": {**_LLAMA3, "n_layers": 32, "d_model": 4096, "n_heads": 32,
                     "n_kv_heads": 8, "ffn_hidden": 14336, "vocab_size": 32000,
                     "max_seq_len": 32768, "rope_theta": 1e6, "moe_experts": 8,
                     "moe_top_k": 2, "moe_ffn_hidden": 14336, "moe_aux_loss_coef": 0.02},
    # Qwen/Qwen3-30B-A3B: 128 experts of 768, top-8, no shared expert; attention of 32 query
    # heads of 128 on d_model 2048 (q_proj 2048 -> 4096) with QK-norm: the published shape.
    "qwen3-30b-a3b": {**_LLAMA3, "n_layers": 48, "d_model": 2048, "n_heads": 32,
                      "n_kv_heads": 4, "head_dim": 128, "qk_norm": True,
                      "ffn_hidden": 6144, "vocab_size": 151936,
                      "max_seq_len": 40960, "rope_theta": 1e6, "norm_eps": 1e-6,
                      "moe_experts": 128, "moe_top_k": 8, "moe_ffn_hidden": 768,
                      "moe_aux_loss_coef": 0.001},
    # deepseek-ai/DeepSeek-V3: 3 dense layers (18432), then 256 routed experts of 2048, top-8,
    # 1 shared expert, sigmoid router with the auxiliary-loss-free bias. DeepSeek-V3's
    # attention is MLA (low-rank compressed Q and KV), which tessel lacks: this shape uses
    # plain attention with the same 128 heads on d_model 7168 (tessel's head_dim 56, no
    # compression), and has no multi-token-prediction module, so its counts differ from the
    # published 671B total / 37B active (`tessel presets` prints tessel's). Balancing: the
    # paper's bias update speed 0.001 and its sequence-wise balance factor 0.0001 (tessel's
    # balance loss is per micro-batch, not per sequence).
    "deepseek-v3": {**_LLAMA3, "n_layers": 61, "d_model": 7168, "n_heads": 128,
                    "n_kv_heads": 128, "ffn_hidden": 18432, "vocab_size": 129280,
                    "max_seq_len": 163840, "rope_theta": 10000.0, "norm_eps": 1e-6,
                    "moe_experts": 256, "moe_top_k": 8, "moe_shared_experts": 1,
                    "moe_ffn_hidden": 2048, "moe_first_dense_layers": 3, "moe_router": "sigmoid",
                    "moe_aux_loss_coef": 0.0001, "moe_bias_update_rate": 0.001},
}
