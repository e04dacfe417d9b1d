"""One tensor-parallel rank (gloo, tp = world size): the loss over pieces of the tokens
against the whole loss, fp32, with and without sequence parallelism, the model placed as the
trainer places it (tessel.parallel.tensor). Writes each case's largest relative differences
(loss, every gradient against the gradients' scale) to argv[1] from rank 0."""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

from tessel.config import ModelConfig
from tessel.models.init import materialise
from tessel.models.transformer import Transformer
from tessel.parallel.placement import MESH
from tessel.parallel.tensor import apply_tensor_parallel, loss_context

SHAPE = dict(preset="tiny-llama", n_layers=2, vocab_size=500, vocab_pad_to=128)


def run(mesh, sp: bool, chunks: int, x: torch.Tensor, y: torch.Tensor
        ) -> tuple[float, dict[str, torch.Tensor]]:
    with torch.device("meta"):
        model = Transformer(ModelConfig(**SHAPE))
    apply_tensor_parallel(model, mesh, sp)
    materialise(model, torch.device("cpu"), seed=0, placement=MESH)
    model.loss_chunks = chunks
    with loss_context(True):
        loss = model(x, targets=y).sum()
        loss.backward()
    loss = loss.full_tensor() if isinstance(loss, DTensor) else loss
    grads = {n: (p.grad.full_tensor() if isinstance(p.grad, DTensor) else p.grad)
             for n, p in model.named_parameters()}
    return loss.item(), grads


def main() -> None:
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    x = torch.randint(0, 500, (2, 32))
    y = torch.randint(0, 500, (2, 32))
    y[0, :5] = -100
    out = {}
    for sp in (True, False):
        whole, g0 = run(mesh, sp, 1, x, y)
        for chunks in (3, 64):
            loss, g = run(mesh, sp, chunks, x, y)
            scale = max(t.abs().max().item() for t in g0.values())
            out[f"sp={sp}-chunks={chunks}"] = {
                "loss": abs(loss / whole - 1),
                "grads": max(((g[n] - g0[n]).abs().max().item()
                              / max(g0[n].abs().max().item(), 1e-1 * scale)) for n in g0)}
    if dist.get_rank() == 0:
        with open(sys.argv[1], "w") as f:
            json.dump(out, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
