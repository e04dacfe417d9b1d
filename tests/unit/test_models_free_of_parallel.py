"""tessel/models holds model definitions only (docs/DESIGN: "no parallel code"): no module
under it imports torch.distributed or names a DTensor, at module level, inside a function or
under TYPE_CHECKING; the parallel layer meets a model through ports the model defines
(attention's SequenceExchange, MoE's ExpertExchange, materialise's Placement)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from tessel.config import ModelConfig
from tessel.models.moe import LocalExperts, MoE
from tessel.models.transformer import FeedForward

MODELS = Path(__file__).resolve().parents[2] / "tessel" / "models"


def _dotted(node: ast.AST) -> str:
    """`a.b.c` of an attribute chain (or a name), "" for anything else."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return ""
    return ".".join([node.id, *reversed(parts)])


def parallel_code(source: str) -> list[str]:
    """Every import of torch.distributed (any form, anywhere in the file), every use of
    `torch.distributed.*` and every name `DTensor` in `source`, as 'line: what'."""
    found = []
    for node in ast.walk(ast.parse(source)):
        line = getattr(node, "lineno", 0)
        if isinstance(node, ast.Import):
            found += [f"{line}: import {a.name}" for a in node.names
                      if a.name == "torch.distributed" or a.name.startswith("torch.distributed.")]
        elif isinstance(node, ast.ImportFrom):
            module = node.module or ""
            names = {a.name for a in node.names}
            if (module == "torch.distributed" or module.startswith("torch.distributed.")
                    or (module == "torch" and "distributed" in names)):
                found.append(f"{line}: from {module} import {', '.join(sorted(names))}")
        elif isinstance(node, ast.Attribute):
            dotted = _dotted(node)
            if dotted == "torch.distributed" or node.attr == "DTensor":
                found.append(f"{line}: {dotted or node.attr}")
        elif isinstance(node, ast.Name) and node.id == "DTensor":
            found.append(f"{line}: DTensor")
    return sorted(set(found))


def test_no_model_module_imports_torch_distributed_or_dtensor():
    offenders = {str(path.relative_to(MODELS.parent.parent)): hits
                 for path in sorted(MODELS.rglob("*.py"))
                 if (hits := parallel_code(path.read_text()))}
    assert offenders == {}


def test_the_check_sees_function_level_type_checking_and_attribute_uses():
    source = ("from typing import TYPE_CHECKING\n"
              "import torch\n"
              "if TYPE_CHECKING:\n"
              "    from torch.distributed.tensor import DTensor\n"
              "def f(w):\n"
              "    import torch.distributed as dist\n"
              "    from torch import distributed\n"
              "    torch.distributed.all_reduce(w)\n"
              "    return isinstance(w, torch.distributed.tensor.DTensor)\n")
    hits = parallel_code(source)
    assert [h.split(":")[0] for h in hits] == ["4", "6", "7", "8", "9", "9"]
    assert parallel_code("import torch\nx = torch.zeros(1)  # DTensor in a comment\n"
                         "'''torch.distributed in a docstring'''\n") == []


class Recording(LocalExperts):
    """The local exchange, counting how the layer uses the port."""

    def __init__(self) -> None:
        self.calls: dict[str, int] = {"local": 0, "token_counts": 0, "experts": 0}

    def local(self, w: torch.Tensor) -> torch.Tensor:
        self.calls["local"] += 1
        return super().local(w)

    def token_counts(self, counts: torch.Tensor) -> torch.Tensor:
        self.calls["token_counts"] += 1
        return super().token_counts(counts)

    def experts(self, *args) -> torch.Tensor:  # noqa: ANN002
        self.calls["experts"] += 1
        return super().experts(*args)


def test_moe_meets_other_ranks_only_through_its_exchange():
    """A fresh layer holds the local exchange; an exchange put in its place is what the
    forward uses for the weights, the experts and the balance statistics, and the local one
    computes exactly what the layer does by default."""
    cfg = ModelConfig(preset="tiny-llama", moe_experts=4, moe_top_k=2, moe_ffn_hidden=32,
                      moe_shared_experts=1)
    torch.manual_seed(0)
    layer = MoE(cfg, FeedForward(cfg, 32))
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.1)
    assert isinstance(layer.exchange, LocalExperts) and layer.exchange.token_shards == 1
    x = torch.randn(2, 8, cfg.d_model)
    default = layer(x)
    stats = layer.aux_sum.clone()
    layer.reset_stats()
    layer.exchange = recording = Recording()
    assert torch.equal(layer(x), default)
    assert torch.equal(layer.aux_sum, stats)
    assert recording.calls["experts"] == 1 and recording.calls["token_counts"] == 1
    assert recording.calls["local"] >= 2  # the router's weight and the shared experts'
