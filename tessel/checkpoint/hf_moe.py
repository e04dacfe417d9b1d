"""Mixture-of-Experts architectures of Hugging Face `transformers`, on Llama's attention:
Mixtral (`MixtralForCausalLM`) and Qwen3-MoE (`Qwen3MoeForCausalLM`).

Routed experts are stored differently on each side. tessel keeps each MoE layer's experts as
3-D weights (experts, in, out): w1/w3 (E, d_model, hidden), w2 (E, hidden, d_model). The
Hub's on-disk format, which every transformers version loads and which 5.x still writes with
`save_pretrained`, has one nn.Linear weight (out, in) per expert:

    Mixtral    model.layers.N.block_sparse_moe.gate.weight            the router (E, d)
               model.layers.N.block_sparse_moe.experts.E.w1|w3|w2.weight
    Qwen3-MoE  model.layers.N.mlp.gate.weight
               model.layers.N.mlp.experts.E.gate_proj|up_proj|down_proj.weight

transformers 5 holds them fused in memory (a state_dict saved as it is has them):
`model.layers.N.mlp.experts.gate_up_proj` (E, 2 x hidden, d: gate rows, then up rows) and
`...experts.down_proj` (E, d, hidden), with the router at `mlp.gate.weight` for both.
Imports read either (per layer, by the names the checkpoint has); exports write the Hub's.
The balancing bias (`expert_bias`, a buffer) has no HF counterpart: zero on import; on
export refused where it changes routing, unless dropped on request (hf_bias).

What tessel's MoE layer cannot compute is refused in one line, naming the field: Mixtral
with one expert per token (HF normalises its weight to 1, tessel's top_k = 1 weighs by the
router score), Qwen3-MoE with norm_topk_prob=false and top_k > 1 (tessel always normalises
the chosen weights), sliding-window attention, and a Qwen3 layout of dense layers that is
not "the first N, then every k-th".
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

import torch

from tessel.checkpoint.hf_arch import HFError, Llama, Read, get_field, one_to_one

if TYPE_CHECKING:
    from tessel.config import ModelConfig

Build = Callable[[Read], torch.Tensor]
# tessel's expert weight -> its part of the fused gate_up_proj (None: down_proj)
_FUSED_PART = {"w1": 0, "w3": 1, "w2": None}


class MoEArchitecture(Llama):
    """Llama's attention and norms; MoE layers of a router (`gate`) and routed experts."""

    moe_prefix: str  # the MoE block's name in a layer of the Hub format
    expert_names: dict[str, str]  # tessel weight -> the Hub's per-expert name

    def moe_fields(self, hf: dict[str, Any], where: str, experts: int) -> dict[str, Any]:
        """The routing fields common to both (top_k, aux loss) and a window check."""
        top_k = get_field(hf, "num_experts_per_tok", where)
        window = hf.get("sliding_window")
        max_len = get_field(hf, "max_position_embeddings", where)
        if hf.get("use_sliding_window", True) and window is not None and window < max_len:
            raise HFError(f"{where}: sliding_window={window} is not supported (tessel's "
                          "attention is full causal); set it to null to import")
        if experts is None:
            raise HFError(f"{where}: missing field 'num_experts' (or 'num_local_experts')")
        if not isinstance(experts, int) or experts < 1:
            raise HFError(f"{where}: {experts!r} routed experts; tessel imports MoE models with "
                          "at least one expert per MoE layer")
        return {"moe_experts": experts, "moe_top_k": top_k, "moe_shared_experts": 0,
                "moe_router": "softmax",
                # HF adds it only with output_router_logits=true, as top_k x the mean over
                # layers; tessel adds coef x balance per layer: the number is carried as is.
                "moe_aux_loss_coef": float(get_field(hf, "router_aux_loss_coef", where, 0.001))}

    def check_exportable(self, m: ModelConfig) -> None:
        if not m.moe_experts:
            raise HFError(f"model: a dense model does not export as {self.hf_class}")
        if m.moe_shared_experts or m.moe_router != "softmax" or m.mlp != "swiglu":
            raise HFError(f"model: {self.hf_class} has softmax routing to SwiGLU experts and "
                          "no shared experts; this model (moe_shared_experts="
                          f"{m.moe_shared_experts}, moe_router={m.moe_router!r}, mlp={m.mlp!r}) "
                          "has no Hugging Face export")

    def moe_config(self, m: ModelConfig) -> dict[str, Any]:
        return {"num_experts_per_tok": m.moe_top_k, "router_aux_loss_coef": m.moe_aux_loss_coef,
                "output_router_logits": False, "sliding_window": None}

    def layer_names(self, m: ModelConfig, i: int) -> list[tuple[str, str, Any]]:
        names = super().layer_names(m, i)
        if m.is_moe_layer(i):
            names.append((f"layers.{i}.feed_forward.router.weight",
                          f"model.layers.{i}.{self.moe_prefix}.gate.weight", None))
        return names

    def tessel_from_hf(self, m: ModelConfig, names: Collection[str] = ()
                       ) -> dict[str, Build]:
        out = one_to_one(self._names(m), m, to_tessel=True)
        assert m.moe_ffn_hidden is not None
        E, d, f = m.moe_experts, m.d_model, m.moe_ffn_hidden
        for i in range(m.n_layers):
            if not m.is_moe_layer(i):
                continue
            fused = f"model.layers.{i}.mlp.experts"
            for w, hf_name in self.expert_names.items():
                target = f"layers.{i}.feed_forward.experts.{w}"
                if f"{fused}.gate_up_proj" in names:
                    part = _FUSED_PART[w]
                    out[target] = (_from_fused(f"{fused}.down_proj", None, (E, d, f))
                                   if part is None else
                                   _from_fused(f"{fused}.gate_up_proj", part, (E, 2 * f, d)))
                else:
                    hub = f"model.layers.{i}.{self.moe_prefix}.experts"
                    shape = (d, f) if w == "w2" else (f, d)
                    out[target] = _stacked([f"{hub}.{e}.{hf_name}.weight" for e in range(E)],
                                           shape)
        return out

    def hf_from_tessel(self, m: ModelConfig) -> dict[str, Build]:
        out = one_to_one(self._names(m), m, to_tessel=False)
        for i in range(m.n_layers):
            if not m.is_moe_layer(i):
                continue
            hub = f"model.layers.{i}.{self.moe_prefix}.experts"
            for w, hf_name in self.expert_names.items():
                one_expert = _expert_of(f"layers.{i}.feed_forward.experts.{w}")
                for e in range(m.moe_experts):
                    out[f"{hub}.{e}.{hf_name}.weight"] = one_expert(e)
        return out


def _stacked(names: list[str], shape: tuple[int, int]) -> Build:
    """tessel's (E, in, out) from E nn.Linear weights of `shape` (out, in), one per expert."""
    def build(read: Read) -> torch.Tensor:
        out = []
        for name in names:
            t = read(name)
            if tuple(t.shape) != shape:
                raise HFError(f"tensor {name!r} has shape {tuple(t.shape)}; the model's "
                              f"config.json needs {shape}")
            out.append(t.t())
        return torch.stack(out)
    return build


def _from_fused(name: str, part: int | None, shape: tuple[int, int, int]) -> Build:
    """tessel's (E, in, out) from transformers 5's fused (E, out, in) `name`; `part` 0 or 1:
    the first or second half of its rows (gate_up_proj's gate and up)."""
    def build(read: Read) -> torch.Tensor:
        t = read(name)
        if tuple(t.shape) != shape:
            raise HFError(f"tensor {name!r} has shape {tuple(t.shape)}; the model's "
                          f"config.json needs {shape}")
        if part is not None:
            half = shape[1] // 2
            t = t[:, part * half:(part + 1) * half]
        return t.transpose(1, 2).contiguous()
    return build


def _expert_of(name: str) -> Callable[[int], Build]:
    """Builders of expert e's nn.Linear weight (out, in) from tessel's 3-D `name`. The 3-D
    tensor is read once for all its experts (the export asks for them in a row), and only
    the last one read is held."""
    held: dict[str, torch.Tensor] = {}

    def one(e: int) -> Build:
        def build(read: Read) -> torch.Tensor:
            if name not in held:
                held.clear()
                held[name] = read(name)
            return held[name][e].t().contiguous()
        return build
    return one


class Mixtral(MoEArchitecture):
    model_type = "mixtral"
    hf_class = "MixtralForCausalLM"
    moe_prefix = "block_sparse_moe"
    expert_names = {"w1": "w1", "w3": "w3", "w2": "w2"}

    def alternatives(self, name: str) -> tuple[str, ...]:
        # transformers 5 names the block `mlp` (its router then at mlp.gate.weight).
        return (name.replace(".block_sparse_moe.", ".mlp."),) if ".block_sparse_moe." in name else ()

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        fields = self.decoder_fields(hf, where)
        hidden = get_field(hf, "intermediate_size", where)
        fields.update(self.moe_fields(hf, where, get_field(hf, "num_local_experts", where)))
        if fields["moe_top_k"] == 1:
            raise HFError(f"{where}: num_experts_per_tok=1 is not supported: Mixtral normalises "
                          "the one chosen expert's weight to 1, tessel's top_k=1 weighs it by "
                          "the router score (Switch)")
        # Every layer is an MoE layer; ffn_hidden (a dense MLP's) is unused, set alike.
        return {**fields, "ffn_hidden": hidden, "moe_ffn_hidden": hidden,
                "moe_first_dense_layers": 0, "moe_every": 1}

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        self.check_exportable(m)
        if m.qk_norm or m.n_moe_layers != m.n_layers or m.moe_top_k == 1:
            raise HFError("model: MixtralForCausalLM has every layer MoE, top_k > 1 and no "
                          "QK-norm; this model has "
                          f"{m.n_layers - m.n_moe_layers} dense layers, moe_top_k="
                          f"{m.moe_top_k}, qk_norm={m.qk_norm}")
        return {**self.decoder_config(m), **self.moe_config(m),
                "intermediate_size": m.moe_ffn_hidden, "num_local_experts": m.moe_experts,
                "router_jitter_noise": 0.0}


class Qwen3Moe(MoEArchitecture):
    model_type = "qwen3_moe"
    hf_class = "Qwen3MoeForCausalLM"
    moe_prefix = "mlp"
    expert_names = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}

    def model_fields(self, hf: dict[str, Any], where: str) -> dict[str, Any]:
        fields = self.decoder_fields(hf, where)
        n_layers = fields["n_layers"]
        # transformers 4 and the Hub write num_experts; 5.x num_local_experts.
        experts = hf.get("num_experts", hf.get("num_local_experts"))
        fields.update(self.moe_fields(hf, where, experts))
        top_k, normalised = fields["moe_top_k"], bool(hf.get("norm_topk_prob", False))
        if top_k > 1 and not normalised:
            raise HFError(f"{where}: norm_topk_prob=false is not supported with "
                          f"num_experts_per_tok={top_k}: tessel always normalises the chosen "
                          "experts' weights to sum to 1 (norm_topk_prob=true)")
        if top_k == 1 and normalised:
            raise HFError(f"{where}: norm_topk_prob=true with num_experts_per_tok=1 is not "
                          "supported: tessel's top_k=1 weighs the expert by its router score")
        step, dense = hf.get("decoder_sparse_step", 1), hf.get("mlp_only_layers") or []
        if not (isinstance(step, int) and step >= 1 and isinstance(dense, list)
                and all(isinstance(i, int) for i in dense)):
            raise HFError(f"{where}: decoder_sparse_step={step!r} / mlp_only_layers={dense!r}: "
                          "expected an integer >= 1 and a list of layer numbers")
        moe = [i not in dense and (i + 1) % step == 0 for i in range(n_layers)]
        first, every = _first_and_every(moe)
        if not any(moe) or [i >= first and (i - first) % every == 0
                            for i in range(n_layers)] != moe:
            raise HFError(f"{where}: MoE layers {[i for i in range(n_layers) if moe[i]]} "
                          f"(decoder_sparse_step={step}, mlp_only_layers={dense}) are not "
                          "'the first N layers dense, then every k-th MoE', the layouts "
                          "model.moe_first_dense_layers / moe_every express")
        return {**fields, "qk_norm": True,
                "ffn_hidden": get_field(hf, "intermediate_size", where),
                "moe_ffn_hidden": get_field(hf, "moe_intermediate_size", where),
                "moe_first_dense_layers": first, "moe_every": every}

    def hf_config(self, m: ModelConfig) -> dict[str, Any]:
        self.check_exportable(m)
        if not m.qk_norm:
            raise HFError("model: Qwen3MoeForCausalLM has QK-norm; this model has "
                          "model.qk_norm=false (Mixtral is the MoE export without it)")
        return {**self.decoder_config(m), **self.moe_config(m),
                "intermediate_size": m.ffn_hidden, "moe_intermediate_size": m.moe_ffn_hidden,
                "num_experts": m.moe_experts, "norm_topk_prob": m.moe_top_k > 1,
                "decoder_sparse_step": 1,
                "mlp_only_layers": [i for i in range(m.n_layers) if not m.is_moe_layer(i)],
                "use_sliding_window": False, "attention_bias": False}


def _first_and_every(moe: list[bool]) -> tuple[int, int]:
    """tessel's (moe_first_dense_layers, moe_every) that the MoE layers `moe` would have if
    they follow its rule (the caller checks that they do)."""
    layers = [i for i, is_moe in enumerate(moe) if is_moe]
    if not layers:
        return 0, 1
    gap = layers[1] - layers[0] if len(layers) > 1 else len(moe)
    return layers[0], gap
