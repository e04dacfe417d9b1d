"""How tessel's model maps onto Hugging Face `transformers` architectures, one place per
architecture: config fields both ways, tensor names, and the layout changes between them.

- GPT-2 (`GPT2LMHeadModel`): Conv1D weights are stored (in, out), so every matmul weight is
  transposed; queries, keys and values are one fused `c_attn` (q | k | v along the output).
- Llama (`LlamaForCausalLM`): HF rotates the two halves of each head (`rotate_half`), tessel
  (like Meta's original code) rotates interleaved pairs, so the rows of q_proj and k_proj are
  permuted per head (`_to_pairs` / `_to_halves`, exact inverses of each other), and so is
  each QK-norm weight (Qwen3), over one head's width.
- The Mixture-of-Experts architectures on Llama's attention (Mixtral, Qwen3-MoE) are in
  `tessel.checkpoint.hf_moe`; `tessel.checkpoint.hf_models` lists them all.

Tensors flow through generators, one (or, for GPT-2's fused attention, three) at a time, so
a conversion never holds the whole model twice. Needs only the standard library and torch.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING, Any

import torch

from tessel.errors import TesselError

if TYPE_CHECKING:
    from tessel.config import ModelConfig

Read = Callable[[str], torch.Tensor]  # a tensor by name, full and unsharded


class HFError(TesselError):
    """A Hugging Face checkpoint tessel cannot use, or cannot produce; names the field."""


class Architecture:
    """One HF architecture: its config and tensor mapping. `tessel_from_hf(m)` maps each
    tessel parameter name to a function that builds it from HF tensors (read by name), and
    `hf_from_tessel(m)` the reverse, so a conversion or a rank loading its shards asks for
    one tensor at a time."""

    model_type: str
    hf_class: str
    def alternatives(self, name: str) -> tuple[str, ...]:
        """Other names an HF tensor may be saved under."""
        return ()

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """tessel `model.*` fields from an HF config.json (`where` names it in errors)."""
        raise NotImplementedError

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        raise NotImplementedError

    def tessel_from_hf(self, m: ModelConfig, names: Collection[str] = ()
                       ) -> dict[str, Callable[[Read], torch.Tensor]]:
        """`names`: the tensor names the HF checkpoint has, where an architecture has more
        than one way to store a weight (MoE experts: one tensor each, or fused)."""
        raise NotImplementedError

    def hf_from_tessel(self, m: ModelConfig) -> dict[str, Callable[[Read], torch.Tensor]]:
        raise NotImplementedError

    def to_tessel(self, read: Read, m: ModelConfig, names: Collection[str] = ()
                  ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, build in self.tessel_from_hf(m, names).items():
            yield name, build(read)

    def to_hf(self, read: Read, m: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
        for name, build in self.hf_from_tessel(m).items():
            yield name, build(read)


def _same(name: str) -> Callable[[Read], torch.Tensor]:
    return lambda read: read(name)


def _transposed(name: str) -> Callable[[Read], torch.Tensor]:
    return lambda read: read(name).t().contiguous()


def get_field(hf: dict[str, Any], key: str, where: str, default: Any = ...) -> Any:
    if key in hf and hf[key] is not None:
        return hf[key]
    if default is ...:
        raise HFError(f"{where}: missing field {key!r}")
    return default


def require_value(hf: dict[str, Any], key: str, allowed: tuple, where: str, default: Any) -> Any:
    value = hf.get(key, default)
    if value not in allowed:
        raise HFError(f"{where}: {key}={value!r} is not supported (tessel supports "
                      f"{', '.join(repr(a) for a in allowed)})")
    return value


class GPT2(Architecture):
    model_type = "gpt2"
    hf_class = "GPT2LMHeadModel"
    def alternatives(self, name: str) -> tuple[str, ...]:
        # GPT2Model (no LM head) saves its tensors without the "transformer." prefix.
        return (name.removeprefix("transformer."),)

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        require_value(hf, "activation_function", ("gelu_new", "gelu_pytorch_tanh"), where, "gelu_new")
        require_value(hf, "scale_attn_weights", (True,), where, True)
        require_value(hf, "scale_attn_by_inverse_layer_idx", (False,), where, False)
        require_value(hf, "reorder_and_upcast_attn", (False,), where, False)
        d = get_field(hf, "n_embd", where)
        # tessel has one dropout rate for embeddings, attention and residuals; GPT2Config
        # defaults each to 0.1 (stock GPT-2 trains with it).
        rates = {k: float(hf.get(k, 0.1)) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
        if len(set(rates.values())) > 1:
            raise HFError(f"{where}: {', '.join(f'{k}={v}' for k, v in rates.items())} differ; "
                          "tessel has one model.dropout for all three: make them equal in "
                          "config.json to import")
        return {
            "dropout": rates["resid_pdrop"],
            "n_layers": get_field(hf, "n_layer", where), "d_model": d,
            "n_heads": get_field(hf, "n_head", where), "n_kv_heads": get_field(hf, "n_head", where),
            "ffn_hidden": get_field(hf, "n_inner", where, 4 * d),
            "vocab_size": get_field(hf, "vocab_size", where),
            "max_seq_len": get_field(hf, "n_positions", where), "position": "learned",
            "norm": "layernorm", "norm_eps": float(get_field(hf, "layer_norm_epsilon", where, 1e-5)),
            "mlp": "gelu", "bias": True,
            "tie_embeddings": bool(hf.get("tie_word_embeddings", True)),
        }

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        if not (m.position == "learned" and m.norm == "layernorm" and m.mlp == "gelu" and m.bias
                and m.n_kv_heads == m.n_heads and m.q_dim == m.d_model and not m.qk_norm
                and m.norm_placement == "pre"):
            raise HFError("model: only the GPT-2 shape (learned positions, LayerNorm, GELU, "
                          "biases, multi-head attention of d_model / n_heads per head, no "
                          "QK-norm, norms before the sub-layers) exports as GPT2LMHeadModel")
        return {
            "architectures": [self.hf_class], "model_type": self.model_type,
            "n_layer": m.n_layers, "n_embd": m.d_model, "n_head": m.n_heads,
            "n_inner": m.ffn_hidden, "vocab_size": m.vocab_size, "n_positions": m.max_seq_len,
            "layer_norm_epsilon": m.norm_eps, "activation_function": "gelu_new",
            "resid_pdrop": m.dropout, "embd_pdrop": m.dropout, "attn_pdrop": m.dropout,
            "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
            "reorder_and_upcast_attn": False, "tie_word_embeddings": m.tie_embeddings,
            "initializer_range": m.init_std, "use_cache": True,
        }

    # (tessel name, HF name without "transformer.", stored transposed in HF)
    _ROOT = (("tok_embeddings.weight", "wte.weight", False),
             ("pos_embeddings.weight", "wpe.weight", False),
             ("norm.weight", "ln_f.weight", False), ("norm.bias", "ln_f.bias", False))
    _BLOCK = (
        ("attention_norm.weight", "ln_1.weight", False),
        ("attention_norm.bias", "ln_1.bias", False),
        ("attention.wo.weight", "attn.c_proj.weight", True),
        ("attention.wo.bias", "attn.c_proj.bias", False),
        ("ffn_norm.weight", "ln_2.weight", False),
        ("ffn_norm.bias", "ln_2.bias", False),
        ("feed_forward.w1.weight", "mlp.c_fc.weight", True),
        ("feed_forward.w1.bias", "mlp.c_fc.bias", False),
        ("feed_forward.w2.weight", "mlp.c_proj.weight", True),
        ("feed_forward.w2.bias", "mlp.c_proj.bias", False),
    )

    def _names(self, m: ModelConfig) -> list[tuple[str, str, Any]]:
        names = [(t, "transformer." + h, "t" if tr else None) for t, h, tr in self._ROOT]
        for i in range(m.n_layers):
            names += [(f"layers.{i}.{t}", f"transformer.h.{i}.{h}", "t" if tr else None)
                      for t, h, tr in self._BLOCK]
        if not m.tie_embeddings:
            names.append(("output.weight", "lm_head.weight", None))
        return names

    def tessel_from_hf(self, m: ModelConfig, names: Collection[str] = ()
                       ) -> dict[str, Callable[[Read], torch.Tensor]]:
        out = one_to_one(self._names(m), m, to_tessel=True)
        d = m.d_model
        for i in range(m.n_layers):  # the fused c_attn holds q | k | v along its output
            h, t = f"transformer.h.{i}.attn.c_attn", f"layers.{i}.attention"
            for j, n in enumerate(("wq", "wk", "wv")):
                out[f"{t}.{n}.weight"] = _slice(h + ".weight", j * d, (j + 1) * d, transpose=True)
                out[f"{t}.{n}.bias"] = _slice(h + ".bias", j * d, (j + 1) * d, transpose=False)
        return out

    def hf_from_tessel(self, m: ModelConfig) -> dict[str, Callable[[Read], torch.Tensor]]:
        out = one_to_one(self._names(m), m, to_tessel=False)
        for i in range(m.n_layers):
            h, t = f"transformer.h.{i}.attn.c_attn", f"layers.{i}.attention"
            out[h + ".weight"] = _fused([f"{t}.{n}.weight" for n in ("wq", "wk", "wv")], True)
            out[h + ".bias"] = _fused([f"{t}.{n}.bias" for n in ("wq", "wk", "wv")], False)
        return out


def _slice(name: str, lo: int, hi: int, transpose: bool) -> Callable[[Read], torch.Tensor]:
    if transpose:
        return lambda read: read(name)[:, lo:hi].t().contiguous()
    return lambda read: read(name)[lo:hi].clone()


def _fused(names: list[str], transpose: bool) -> Callable[[Read], torch.Tensor]:
    if transpose:
        return lambda read: torch.cat([read(n).t() for n in names], dim=1)
    return lambda read: torch.cat([read(n) for n in names])


VOCAB_ROWS = ("tok_embeddings.weight", "output.weight")
"""tessel parameters with one row per vocabulary id: model.padded_vocab_size rows in tessel,
vocab_size in Hugging Face (whose config has no padding)."""


def fit_vocab_rows(t: torch.Tensor, vocab_size: int, rows: int) -> torch.Tensor:
    """The first `vocab_size` rows of `t` (the real ids), then zero rows up to `rows` (the
    padding: zero, as tessel initialises it and as it stays, having no gradient)."""
    real = t[:vocab_size]
    if rows == real.shape[0]:
        return real.contiguous()
    return torch.cat([real, real.new_zeros((rows - vocab_size, *t.shape[1:]))])


def one_to_one(names: list[tuple[str, str, Any]], m: ModelConfig, to_tessel: bool
                ) -> dict[str, Callable[[Read], torch.Tensor]]:
    """(tessel name, HF name, change) -> {target name: build from source tensors}; a change
    is None, "t" (transposed), or the head count whose rows are permuted (an int, or the
    config attribute that holds it); each change is its own inverse in the other direction. The vocabulary's
    padding rows are added on the way in and dropped on the way out."""
    out: dict[str, Callable[[Read], torch.Tensor]] = {}
    for t, h, change in names:
        src, dst = (h, t) if to_tessel else (t, h)
        if change is None:
            out[dst] = _same(src)
        elif change == "t":
            out[dst] = _transposed(src)
        else:
            heads = change if isinstance(change, int) else getattr(m, change)
            out[dst] = _permuted(src, heads, to_tessel)
        if t in VOCAB_ROWS:
            rows = m.padded_vocab_size if to_tessel else m.vocab_size
            out[dst] = lambda read, build=out[dst], rows=rows: fit_vocab_rows(
                build(read), m.vocab_size, rows)
    return out


def _permuted(name: str, heads: int, to_pairs: bool) -> Callable[[Read], torch.Tensor]:
    permute = _to_pairs if to_pairs else _to_halves
    return lambda read: permute(read(name), heads)


def _to_pairs(w: torch.Tensor, heads: int) -> torch.Tensor:
    """Rows of one head ordered [first half | second half] -> interleaved pairs."""
    rows = w.shape[0]
    return w.reshape(heads, 2, rows // heads // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _to_halves(w: torch.Tensor, heads: int) -> torch.Tensor:
    """The inverse of `_to_pairs`."""
    rows = w.shape[0]
    return w.reshape(heads, rows // heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


class Llama(Architecture):
    """LlamaForCausalLM; also the attention, norms and embeddings of the MoE architectures
    built on it (`tessel.checkpoint.hf_moe`), which override the MLP's fields and names."""

    model_type = "llama"
    hf_class = "LlamaForCausalLM"
    windows = False
    """Whether the architecture carries model.sliding_window (Mistral); others refuse a
    config that sets one (unless its use_sliding_window is false: Qwen2)."""
    checks_variants = False
    """Whether hf_config checks q/k/v biases, norm placement and QK-norm's scope itself
    (Qwen2, Qwen3, OLMo 2: tessel.checkpoint.hf_qwen_olmo); Llama's layers have none."""

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        if hf.get("mlp_bias", False):
            raise HFError(f"{where}: mlp_bias=true is not supported (tessel's Llama shape has "
                          "no biases)")
        return {**self.decoder_fields(hf, where),
                "ffn_hidden": get_field(hf, "intermediate_size", where)}

    def decoder_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        """The fields every Llama-like decoder has: all but the MLP's."""
        require_value(hf, "hidden_act", ("silu",), where, "silu")
        if hf.get("attention_bias", False):
            raise HFError(f"{where}: attention_bias=true is not supported (tessel's Llama "
                          "shape has no biases)")
        d, heads = get_field(hf, "hidden_size", where), get_field(hf, "num_attention_heads", where)
        rope = dict(hf.get("rope_parameters") or {})  # transformers 5
        legacy = hf.get("rope_scaling") or {}  # transformers 4
        rope.update({k: v for k, v in legacy.items() if k not in rope})
        theta = float(rope.get("rope_theta", hf.get("rope_theta", 10000.0)))
        kind = rope.get("rope_type", rope.get("type", "default"))
        fields: dict[str, Any] = {
            "n_layers": get_field(hf, "num_hidden_layers", where), "d_model": d, "n_heads": heads,
            "n_kv_heads": get_field(hf, "num_key_value_heads", where, heads),
            # null in config.json (Mixtral writes it) means hidden_size / heads, as in HF.
            "head_dim": hf.get("head_dim") or None,
            "vocab_size": get_field(hf, "vocab_size", where),
            "max_seq_len": get_field(hf, "max_position_embeddings", where), "position": "rope",
            "rope_theta": theta, "norm": "rmsnorm",
            "norm_eps": float(get_field(hf, "rms_norm_eps", where, 1e-6)), "mlp": "swiglu",
            "bias": False, "tie_embeddings": bool(hf.get("tie_word_embeddings", False)),
            "rope_scaling_factor": 1.0,
        }
        if float(hf.get("attention_dropout", 0.0)):
            raise HFError(f"{where}: attention_dropout={hf['attention_dropout']} cannot be "
                          "carried (tessel's model.dropout also drops the residual stream and "
                          "embeddings, which Llama does not); set it to 0.0 in config.json to "
                          "import, and model.dropout when fine-tuning")
        if kind == "llama3":
            fields.update({
                "rope_scaling_factor": float(get_field(rope, "factor", f"{where} rope scaling")),
                "rope_low_freq_factor": float(get_field(rope, "low_freq_factor", where)),
                "rope_high_freq_factor": float(get_field(rope, "high_freq_factor", where)),
                "rope_original_max_seq_len": int(get_field(
                    rope, "original_max_position_embeddings", where)),
            })
        elif kind == "linear":
            fields.update({"rope_scaling_type": "linear", "rope_scaling_factor": float(
                get_field(rope, "factor", f"{where} rope scaling"))})
        elif kind != "default":
            raise HFError(f"{where}: rope scaling {kind!r} is not supported (tessel supports "
                          "none, 'llama3' and 'linear')")
        window = hf.get("sliding_window")
        if window is not None and hf.get("use_sliding_window", True) and not self.windows:
            raise HFError(f"{where}: sliding_window={window} is not supported for "
                          f"{self.hf_class} (MistralForCausalLM and Gemma3ForCausalLM carry "
                          "windows); set it to null in config.json to import without one")
        return fields

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        if m.moe_experts or m.qk_norm:
            raise HFError("model: only dense models without QK-norm export as LlamaForCausalLM")
        return {**self.decoder_config(m), "intermediate_size": m.ffn_hidden,
                "attention_bias": False, "mlp_bias": False}

    def decoder_config(self, m: ModelConfig) -> dict[str, Any]:
        """The config.json keys of `decoder_fields`, for `m`."""
        if not (m.position == "rope" and m.norm == "rmsnorm" and m.mlp == "swiglu" and not m.bias):
            raise HFError(f"model: only the Llama shape (RoPE, RMSNorm, SwiGLU, no biases) "
                          f"exports as {self.hf_class}")
        if not self.checks_variants and (
                m.qkv_bias or m.norm_placement != "pre" or m.qk_norm_scope != "head"):
            raise HFError(f"model: {self.hf_class} has no q/k/v biases, norms after the "
                          f"sub-layers or projection-wide QK-norm; this model has qkv_bias="
                          f"{m.qkv_bias}, norm_placement={m.norm_placement!r}, qk_norm_scope="
                          f"{m.qk_norm_scope!r}")
        gemma = {"embed_scale": m.embed_scale, "norm_offset": m.norm_offset,
                 "query_scale": m.query_scale, "final_logit_softcap": m.final_logit_softcap,
                 "rope_local_theta": m.rope_local_theta, "layer_types": m.layer_types,
                 **({} if self.windows else {"sliding_window": m.sliding_window})}
        kept = {k: v for k, v in gemma.items() if v not in (None, False)}
        if kept:  # Gemma 3's (tessel.checkpoint.hf_mistral_gemma) or Mistral's, not Llama's
            raise HFError(f"model: {self.hf_class} cannot hold "
                          f"{', '.join(f'model.{k}={v!r}' for k, v in kept.items())}")
        out = {
            "architectures": [self.hf_class], "model_type": self.model_type,
            "num_hidden_layers": m.n_layers, "hidden_size": m.d_model,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads,
            "head_dim": m.head_dim, "vocab_size": m.vocab_size,
            "max_position_embeddings": m.max_seq_len, "rms_norm_eps": m.norm_eps,
            "rope_theta": m.rope_theta, "hidden_act": "silu",
            # Not m.dropout: Llama drops attention weights only; tessel_to_hf says so.
            "attention_dropout": 0.0, "tie_word_embeddings": m.tie_embeddings,
            "initializer_range": m.init_std, "use_cache": True, "rope_scaling": None,
        }
        if m.rope_scaling_factor != 1.0 and m.rope_scaling_type == "linear":
            out["rope_scaling"] = {"rope_type": "linear", "factor": m.rope_scaling_factor}
        elif m.rope_scaling_factor != 1.0:
            # Written the transformers-4 way (rope_theta + rope_scaling), which 5 also reads.
            out["rope_scaling"] = {
                "rope_type": "llama3", "factor": m.rope_scaling_factor,
                "low_freq_factor": m.rope_low_freq_factor,
                "high_freq_factor": m.rope_high_freq_factor,
                "original_max_position_embeddings": m.rope_original_max_seq_len,
            }
        return out

    # (tessel name in block, HF name in layer, the rows' head count for q/k, else None)
    ATTENTION = (
        ("attention_norm.weight", "input_layernorm.weight", None),
        ("attention.wq.weight", "self_attn.q_proj.weight", "n_heads"),
        ("attention.wk.weight", "self_attn.k_proj.weight", "n_kv_heads"),
        ("attention.wv.weight", "self_attn.v_proj.weight", None),
        ("attention.wo.weight", "self_attn.o_proj.weight", None),
        ("ffn_norm.weight", "post_attention_layernorm.weight", None),
    )
    # QK-norm's weights (Qwen3): one head's width, permuted like each head of q and k.
    QK_NORM = (
        ("attention.q_norm.weight", "self_attn.q_norm.weight", 1),
        ("attention.k_norm.weight", "self_attn.k_norm.weight", 1),
    )
    DENSE_MLP = (
        ("feed_forward.w1.weight", "mlp.gate_proj.weight", None),
        ("feed_forward.w3.weight", "mlp.up_proj.weight", None),
        ("feed_forward.w2.weight", "mlp.down_proj.weight", None),
    )

    def layer_names(self, m: ModelConfig, i: int) -> list[tuple[str, str, Any]]:
        """(tessel name, HF name, change) of layer `i`'s one-to-one tensors."""
        block = self.ATTENTION + (self.QK_NORM if m.qk_norm else ())
        if not m.is_moe_layer(i):
            block += self.DENSE_MLP
        return [(f"layers.{i}.{t}", f"model.layers.{i}.{h}", c) for t, h, c in block]

    def _names(self, m: ModelConfig) -> list[tuple[str, str, Any]]:
        names = [("tok_embeddings.weight", "model.embed_tokens.weight", None)]
        for i in range(m.n_layers):
            names += self.layer_names(m, i)
        names.append(("norm.weight", "model.norm.weight", None))
        if not m.tie_embeddings:
            names.append(("output.weight", "lm_head.weight", None))
        return names

    def tessel_from_hf(self, m: ModelConfig, names: Collection[str] = ()
                       ) -> dict[str, Callable[[Read], torch.Tensor]]:
        return one_to_one(self._names(m), m, to_tessel=True)

    def hf_from_tessel(self, m: ModelConfig) -> dict[str, Callable[[Read], torch.Tensor]]:
        return one_to_one(self._names(m), m, to_tessel=False)
