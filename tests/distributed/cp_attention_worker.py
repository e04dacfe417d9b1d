"""Run by torchrun --nproc-per-node=4 from test_context_attention.py: tessel's context-parallel
attention (tessel.parallel.context) against single-process attention on the whole sequence,
in float64, output and dQ/dK/dV. Writes {case: largest absolute difference} as JSON to the
path given (rank 0).

Also: a whole model placed on the cp mesh traces under torch.compile(fullgraph=True) (any
graph break is an error; backend "eager" keeps the check to Dynamo's tracing, where graph
breaks happen) and gives the eager result, forward and backward ("compiled-<mode>").

Cases: all-gather and Ulysses; cp 2 (two groups of the 4 ranks, each on its own data) and
cp 4; head-tail (load-balanced) and contiguous chunks; causal, and packed documents that
cross chunk boundaries; grouped-query attention (8 query heads on 4 KV heads).
"""

from __future__ import annotations

import json
import sys

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

from tessel.models.attention import attend, attention_mask
from tessel.parallel.context import ContextParallel, chunk_positions

B, T, H, H_KV, HD = 2, 16, 8, 4, 4
# Documents of 5, 7 and 4 tokens in the first sequence, one in the second: with 8 chunks of 2
# (cp 4, head-tail) or 4 of 4 (cp 2) every document crosses a chunk boundary.
DOCS = torch.tensor([[0] * 5 + [1] * 7 + [2] * 4, [0] * 16])


def case(cp: ContextParallel, docs: torch.Tensor | None, seed: int) -> float:
    gen = torch.Generator().manual_seed(seed)
    q, dy = (torch.randn(B, T, H, HD, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(B, T, H_KV, HD, generator=gen, dtype=torch.float64) for _ in range(2))

    # The reference: one process, the whole sequence.
    full = [t.clone().requires_grad_() for t in (q, k, v)]
    y = attend(*full, attention_mask(docs, None, T, q.device, flex=False, dtype=q.dtype))
    (y * dy).sum().backward()

    # This rank's part of the sequence through the exchange.
    pos = chunk_positions(T, cp.size, cp.rank, cp.balanced)
    local = [t[:, pos].clone().requires_grad_() for t in (q, k, v)]
    rows = pos.expand(B, -1) if cp.local_queries else None
    mask = attention_mask(docs, rows, T, q.device, flex=False, dtype=q.dtype)
    q_x, k_x, v_x = cp.exchange(*local)
    # Keys and values move before the grouped-query expansion: KV heads only (all-gather:
    # all of them, Ulysses: this rank's share).
    assert k_x.shape[2] == v_x.shape[2] == (H_KV if cp.local_queries else H_KV // cp.size)
    y_local = cp.restore(attend(q_x, k_x, v_x, mask))
    (y_local * dy[:, pos]).sum().backward()

    diffs = [(y_local - y[:, pos]).abs().max()]
    diffs += [(mine.grad - ref.grad[:, pos]).abs().max() for mine, ref in zip(local, full)]
    return max(d.item() for d in diffs)


def compiled_model_matches(mesh, mode: str) -> float:  # noqa: ANN001
    """The tiny Llama (GQA, RoPE) with documents, this rank's tokens, compiled vs eager."""
    from tessel.config import Config
    from tessel.models import build_model
    from tessel.parallel.context import apply_context_parallel

    cfg = Config.load(None, {"model.preset": "tiny-llama", "model.n_layers": 2}).model
    model = build_model(cfg, "cpu", seed=3)
    cp = apply_context_parallel(model, mesh, mode, balanced=True)
    gen = torch.Generator().manual_seed(5)
    x, y = torch.randint(0, 256, (B, T), generator=gen), torch.randint(0, 256, (B, T), generator=gen)
    x, y, positions = cp.shard(x, y)
    results = []
    for fn in (model, torch.compile(model, backend="eager", fullgraph=True)):
        model.zero_grad()
        loss = torch.nn.functional.cross_entropy(fn(x, DOCS, positions).flatten(0, 1), y.flatten())
        loss.backward()
        results.append([loss.detach()] + [p.grad.clone() for p in model.parameters()])
    return max((a - b).abs().max().item() for a, b in zip(*results))


def main(out: str) -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    meshes = {2: init_device_mesh("cpu", (2, 2), mesh_dim_names=("other", "cp"))["cp"],
              4: init_device_mesh("cpu", (4,), mesh_dim_names=("cp",))}
    results = {}
    seed = 0
    for mode in ("allgather", "ulysses"):
        for size, mesh in meshes.items():
            for balanced in (True, False):
                cp = ContextParallel(mesh, mode, balanced)
                for label, docs in (("causal", None), ("documents", DOCS)):
                    seed += 1
                    # cp 2: the two groups compute different cases (their own data)
                    err = case(cp, docs, seed * 10 + (rank // 2 if size == 2 else 0))
                    worst = torch.tensor([err], dtype=torch.float64)
                    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
                    name = f"{mode}-cp{size}-{'headtail' if balanced else 'contiguous'}-{label}"
                    results[name] = worst.item()
    for mode in ("allgather", "ulysses"):
        torch._dynamo.reset()
        worst = torch.tensor([compiled_model_matches(meshes[2], mode)], dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        results[f"compiled-{mode}"] = worst.item()
    if rank == 0:
        with open(out, "w") as f:
            json.dump(results, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
