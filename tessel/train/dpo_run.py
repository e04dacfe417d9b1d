"""train.objective = "dpo" in `tessel train`: the loss hook TrainStep calls instead of the
token cross-entropy, the reference log-probabilities (computed once, kept in the run
directory), the held-out evaluation and the metrics (tessel.train.dpo's formulas).

The step's divisors are the step's pair count and chosen-reply token count over every
data-parallel rank, all-reduced once per step before the backward passes (as TrainStep's
counted targets), so N processes compute what one does with the same pairs.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from tessel.config import ConfigError
from tessel.data import Batch
from tessel.data.cache import data_cache_dir
from tessel.errors import DataError
from tessel.fileio import write_text_atomic
from tessel.models.loss import IGNORE_INDEX
from tessel.parallel.dist import all_reduce_sum, broadcast_from_main
from tessel.parallel.tensor import local_value, loss_context
from tessel.train.dpo import PairStats, pair_losses, row_logps, split_pairs, step_loss
from tessel.train.reference_cache import (
    entry_dir,
    npy_bytes,
    read_cached,
    reference_key,
    write_cached,
)

REFERENCE_FILE = "reference_logps.npy"
"""In the run directory: the reference log-probabilities of the train then validation pairs
(N, 2) float64; beside it REFERENCE_FILE + ".json" names the pairs they were made for and
where they came from (a pass or the data cache)."""


def check_dpo(cfg: Any, dims: Any) -> None:
    """Refuse, before anything is written, what a DPO run cannot do yet (one line)."""
    if cfg.train.objective != "dpo":
        return
    if cfg.fault_tolerance.enable:
        raise ConfigError("train.objective = \"dpo\" does not run with fault_tolerance.enable "
                          "yet; leave it out (every layout runs, LoRA included)")


def logps_of(logits: torch.Tensor, targets: torch.Tensor, context: Any = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """tessel.train.dpo.row_logps of whole rows as plain tensors; `logits` (R, T, V), or
    (R,) the rows' summed losses the model computed itself over pieces of the logits
    (parallel.loss_chunks > 1, `use_loss_pieces`). Under tensor parallelism
    (loss_parallel, the logits sharded over the vocabulary) the per-row sums come out
    replicated DTensors, taken whole here (differentiably) so the loss mixes them with the
    reference's. Under context parallelism (`context`) each rank holds a part of every row:
    the parts are summed over its group, differentiably, so every rank computes the pairs'
    loss from whole replies; each rank's gradient is then cp times its part's, and the mean
    over the cp ranks TrainStep's gradient averaging takes is the whole gradient."""
    if logits.dim() == 1:  # the model's own per-row losses
        logps, counts = -logits, (targets != IGNORE_INDEX).sum(1)
    else:
        logps, counts = row_logps(logits, targets)
    logps, counts = local_value(logps), local_value(counts)
    if context is not None:
        from torch.distributed.nn.functional import all_reduce

        logps = all_reduce(logps, group=context.group)
        counts = counts.clone()
        torch.distributed.all_reduce(counts, group=context.group)
    return logps, counts


class PreferenceObjective:
    """The DPO loss of TrainStep's micro-batches, and the pair metrics of the logged steps."""

    def __init__(self, settings: Any, distributed: bool, device: torch.device,
                 context: Any = None):
        self.settings = settings  # the [dpo] section
        self.context = context  # context parallelism's sharding (its group), or None
        self.distributed, self.device = distributed, device
        self.stats = PairStats()
        self.eval_metrics: dict[str, float] = {}
        self.collect: list[Any] | None = None  # forward_logps's, through a pipeline
        self.pending: list[tuple[Any, tuple[float, float]] | None] = []  # expect's

    def divisors(self, batches: list[Batch], dp: int) -> tuple[float, float]:
        """(pairs, chosen-reply tokens) of the step on all data-parallel ranks, each over
        the data-parallel degree (DDP/FSDP average the gradients over it)."""
        pairs = sum(b.targets.shape[0] // 2 for b in batches)
        tokens = sum(int((b.targets[:b.targets.shape[0] // 2] != IGNORE_INDEX).sum())
                     for b in batches)
        local = torch.tensor([pairs, tokens], dtype=torch.float64, device=self.device)
        if self.distributed:
            world = torch.distributed.get_world_size()
            local = all_reduce_sum(local) * dp / world  # every rank of a replica counted
        return max(float(local[0]), 1.0) / dp, max(float(local[1]), 1.0) / dp

    def loss(self, logits: torch.Tensor, targets: torch.Tensor, ref: torch.Tensor | None,
             divisors: tuple[float, float]) -> torch.Tensor:
        """This micro-batch's share of the step's loss (tessel.train.dpo.step_loss)."""
        if ref is None:
            raise RuntimeError("a DPO micro-batch without reference log-probabilities")
        logps, counts = logps_of(logits, targets, self.context)
        policy, counts = split_pairs(logps), split_pairs(counts)
        ref = ref.to(policy.device)
        self.stats.add(policy, ref, self.settings.beta)
        return step_loss(policy, ref, counts, self.settings, *divisors)

    def forward_logps(self, step: Any, batches: list[Batch]
                      ) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
        """(reply log-probabilities, token counts) of each micro-batch's rows, without
        gradients: one forward each, or through the pipeline schedule `step.accum` at a time
        (then None except on the last stage)."""
        if step.schedule is None:
            model, out = step.model.parts[0], []
            for batch in batches:
                x, y, docs, positions = step.shard(*step.on_device(batch)[:3])
                with loss_context(step.dims.tp > 1), step.precision.autocast():
                    out.append(logps_of(model(x, docs, positions, **step.loss_inputs(y)),
                                        y, self.context))
            return out
        from tessel.train.step import concat, model_kwargs

        found: list[Any] = []
        for lo in range(0, len(batches), step.accum):
            self.collect = []
            x, y, docs, positions = step.shard(*step.on_device(
                concat(batches[lo:lo + step.accum]))[:3])
            step._pipeline_infers = True  # the next training step re-initialises the stages
            with loss_context(step.dims.tp > 1), step.precision.autocast():
                step.schedule.eval(*((x,) if step.model.has_first else ()),
                                   target=y if step.model.has_last else None, losses=[],
                                   **model_kwargs(docs, positions), **step.loss_inputs(y))
            found += self.collect or [None] * step.accum
        self.collect = None
        return found

    def pipeline_loss(self, out: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """The pipeline schedule's loss of one micro-batch on the last stage (they come in
        order): in `forward_logps`, its log-probabilities kept; in training, the loss with
        the reference and divisors `expect` queued."""
        if self.collect is not None:
            logps, counts = logps_of(out, targets, self.context)
            self.collect.append((logps.detach(), counts))
            return logps.sum() * 0
        entry = self.pending.pop(0)
        if entry is None:  # the schedule's backward metadata inference: no micro-batch
            return logps_of(out, targets, self.context)[0].sum() * 0
        return self.loss(out, targets, *entry)

    def expect(self, batches: list[Batch], divisors: tuple[float, float], probe: bool) -> None:
        """The references and divisors of a pipeline step's micro-batches, in order; `probe`:
        the schedule first calls the loss once more to infer the backward's shapes (on the
        first step, and the first after an evaluation)."""
        self.pending = [None] * probe + [(b.ref, divisors) for b in batches]

    def metrics(self) -> dict[str, float]:
        """TRL's rewards/* and logps/* over the pairs since the last call, on all ranks
        (every rank calls it: one all-reduce)."""
        vector = self.stats.vector()
        self.stats = PairStats()
        if self.distributed:  # a replica's ranks count alike: the means are unchanged
            vector = all_reduce_sum(torch.tensor(vector, dtype=torch.float64,
                                                 device=self.device)).tolist()
        return PairStats.means(vector)

    @torch.no_grad()
    def evaluate(self, step: Any, draw: Any, iters: int) -> float:
        """The held-out loss (the training loss's formula, means over the counted pairs and
        chosen tokens) over `iters` micro-batches `draw()` gives as (batch, counted); sets
        `eval_metrics` (eval_rewards/*, eval_logps/*)."""
        s, group = self.settings, step.accum if step.schedule is not None else 1
        stats, sums = PairStats(), torch.zeros(3, dtype=torch.float64, device=step.device)
        drawn = [draw() for _ in range(math.ceil(iters / group) * group)]
        for (batch, counted), found in zip(drawn, self.forward_logps(step, [b for b, _ in drawn])):
            if not counted or found is None:  # run (collectives stay in step), count nothing
                continue  # (None: not the last pipeline stage, which holds the log-probs)
            policy, counts = split_pairs(found[0]).double(), split_pairs(found[1])
            ref = batch.ref.to(policy.device)
            stats.add(policy, ref, s.beta)
            losses = pair_losses(policy, ref, counts, s.loss, s.beta, s.label_smoothing)
            sums += torch.stack([losses.sum(), -policy[:, 0].sum(),
                                 counts[:, 0].sum().double()])
        vector = torch.tensor(stats.vector(), dtype=torch.float64, device=step.device)
        if self.distributed:
            vector, sums = all_reduce_sum(vector), all_reduce_sum(sums)
        self.eval_metrics = {f"eval_{k}": v for k, v in PairStats.means(vector.tolist()).items()}
        pairs = float(vector[0])
        if not pairs:
            return math.nan
        loss = s.loss_weight * float(sums[0]) / pairs
        if s.sft_weight:
            loss += s.sft_weight * float(sums[1]) / max(float(sums[2]), 1.0)
        return loss


@torch.no_grad()
def reference_logps(step: Any, datasets: list[Any], mbs: int, dp_rank: int = 0,
                    dp_size: int = 1) -> np.ndarray:
    """(pairs, 2) log-probabilities of (chosen, rejected) of every pair of `datasets`, in
    order, by one forward of `step`'s model without gradients, on every rank. The
    micro-batches of `mbs` pairs are dealt out over the `dp_size` data-parallel replicas
    (this one is `dp_rank`), each replica's ranks running the same ones, as many on each (the
    last filled up with copies of the first), then summed everywhere: the pass costs 1/dp of
    what every replica running every pair would."""
    from tessel.data.preference_data import pair_batch

    # micro-batches of `mbs` pairs (the last one filled up with pair 0, then cut)
    picks = [[i if i < ds.n_samples else 0 for i in range(lo, lo + mbs)]
             for ds in datasets for lo in range(0, ds.n_samples, mbs)]
    owners = [ds for ds in datasets for _ in range(0, ds.n_samples, mbs)]
    batches = [pair_batch(ds, p) for ds, p in zip(owners, picks)]
    mine = list(range(dp_rank, len(batches), dp_size))
    # as many on every replica (FSDP's gathers run in step), whole pipeline steps of them
    rounds = -(-len(batches) // dp_size)
    rounds += -rounds % (step.accum if step.schedule is not None else 1)
    step.model.train(False)
    found = step.objective.forward_logps(
        step, [batches[k] for k in mine] + [batches[0]] * (rounds - len(mine)))
    step.model.train(True)
    ours = dict(zip(mine, found))  # the fillers' dropped
    out = np.zeros((sum(ds.n_samples for ds in datasets), 2))
    lo, row = 0, 0
    for ds in datasets:
        for start in range(0, ds.n_samples, mbs):
            n = min(mbs, ds.n_samples - start)
            if ours.get(row) is not None:  # None: not the last pipeline stage
                out[lo + start:lo + start + n] = split_pairs(ours[row][0]).double().cpu().numpy()[:n]
            row += 1
        lo += ds.n_samples
    if dp_size > 1 or step.schedule is not None:
        # each pair's on its replica's last-stage ranks (all of them without a pipeline)
        holders = torch.distributed.get_world_size() / (dp_size * step.dims.pp)
        out = (all_reduce_sum(torch.from_numpy(out).to(step.device)) / holders).cpu().numpy()
    return out


def attach_reference(cfg: Any, step: Any, data: Any, run_path: Path, resumed: bool, is_main: bool,
                     say: Any, reference_step: Any = None) -> None:
    """Give the train and validation pairs their reference log-probabilities: those of the
    run directory on a resume (refused when missing or made for other pairs); else those the
    data cache holds for exactly this pass (tessel.train.reference_cache: rank 0 reads them
    and sends them to the others), else one pass of the initial policy (or of
    `reference_step()`'s model), kept in the cache and the run directory by the main rank."""
    sets = [data.train.dataset] + ([data.val.dataset] if data.val is not None else [])
    key = {"pairs": [ds.n_samples for ds in sets], "fingerprints": [ds.fingerprint for ds in sets]}
    path = run_path / REFERENCE_FILE
    if resumed:
        ref = _read_reference(path, key)
    else:
        ref, origin, blob = _cached_or_computed(cfg, step, data, sets, key, is_main, say,
                                                reference_step, path)
        if is_main:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.tmp")
            tmp.write_bytes(blob)
            tmp.replace(path)
            # where they came from beside what they are for (a resume checks the latter)
            write_text_atomic(path.with_name(path.name + ".json"),
                              json.dumps({**key, "origin": origin}))
    lo = 0
    for ds in sets:
        ds.ref, lo = ref[lo:lo + ds.n_samples], lo + ds.n_samples


def _cached_or_computed(cfg: Any, step: Any, data: Any, sets: list[Any], key: dict[str, Any],
                        is_main: bool, say: Any, reference_step: Any, path: Path
                        ) -> tuple[np.ndarray, str, bytes]:
    """(a fresh run's reference log-probabilities, where they came from, their .npy bytes on
    the main rank, serialised once for the cache and the run directory): the data cache's
    entry for exactly this pass, else one pass (then kept in the cache by the main rank)."""
    rows = sum(key["pairs"])
    cache = data_cache_dir(cfg.data)
    world = {"precision": step.precision.name, "device": step.device.type,
             "dims": dataclasses.asdict(step.dims)}
    cache_key = reference_key(cfg, list(zip(key["pairs"], key["fingerprints"])), world)
    found = read_cached(cache, cache_key, rows, say) if is_main else None
    ref = _from_main(found, rows, step.device, step.distributed)
    if ref is not None:
        origin = f"the data cache {entry_dir(cache, cache_key)}"
        say(f"tessel: reference log-probabilities of {rows:,} pairs from {origin} (the "
            f"same pairs, weights, settings and layout); kept in {path}")
        return ref, origin, npy_bytes(ref) if is_main else b""
    which = "dpo.reference_model" if reference_step else "the initial model"
    runner = reference_step() if reference_step else step  # (refusals first)
    say(f"tessel: reference log-probabilities of {rows:,} pairs (one pass of {which}; "
        f"kept in {path} and the data cache)")
    ref = reference_logps(runner, sets, data.train.mbs, data.train.dp_rank, data.train.dp_size)
    del runner  # another model's copy is freed now: FSDP's module-state cycles need
    gc.collect()  # the collector (seen: a ZeRO-3 copy alive through training without it)
    blob = npy_bytes(ref) if is_main else b""
    if is_main:
        try:
            write_cached(cache, cache_key, blob)
        except OSError as exc:  # a full or read-only cache costs the next run a pass
            say(f"tessel: warning: the reference log-probabilities could not be kept in the "
                f"data cache {cache} ({exc.strerror or exc}); the run goes on")
    return ref, f"one pass of {which}", blob


def _from_main(found: np.ndarray | None, rows: int, device: torch.device,
               distributed: bool) -> np.ndarray | None:
    """Rank 0's cached log-probabilities on every rank (None everywhere when rank 0 has none):
    every rank must agree on whether the pass runs, since it is collective."""
    if not distributed:
        return found
    hit = torch.tensor([0.0 if found is None else 1.0], device=device)
    broadcast_from_main(hit)
    if hit.item() == 0:
        return None
    values = (torch.from_numpy(found) if found is not None
              else torch.empty(rows, 2, dtype=torch.float64)).to(device)
    return broadcast_from_main(values).cpu().numpy()


def _read_reference(path: Path, key: dict[str, Any]) -> np.ndarray:
    try:
        saved = json.loads(path.with_name(path.name + ".json").read_text())
        ref = np.load(path, allow_pickle=False)
    except (OSError, ValueError):
        raise DataError(f"the run's reference log-probabilities ({path}) are missing or damaged; "
                        "a DPO run resumes only with them: start a new run") from None
    if {k: saved.get(k) for k in key} != key or ref.shape != (sum(key["pairs"]), 2):
        raise DataError(f"the reference log-probabilities in {path} were made for other "
                        "preference pairs; resume with the dpo.paths, data.split and "
                        "train.seq_len the run started with")
    return ref


def dpo_objective(cfg: Any, step: Any, data: Any, run_path: Path, resumed: bool, proc: Any,
                  say: Any, reference_step: Any = None) -> PreferenceObjective:
    """The DPO loss hook of a run, its pairs given their reference log-probabilities;
    `reference_step()`: a TrainStep of dpo.reference_model's weights for the reference pass
    (None: the policy's own)."""
    use_loss_pieces(step)
    objective = PreferenceObjective(cfg.dpo, proc.distributed, step.device, step.context)
    step.objective = objective  # before the reference pass: a pipeline's loss asks for it
    made = None
    if reference_step is not None and not resumed:
        def made() -> Any:  # the reference model's step, sharing the loss hook
            other = reference_step()
            other.objective = objective
            use_loss_pieces(other)
            return other
    attach_reference(cfg, step, data, run_path, resumed, proc.is_main, say, made)
    return objective


def use_loss_pieces(step: Any) -> None:
    """Make `step`'s last stage compute each row's summed loss itself where it runs the loss
    in pieces of the logits (parallel.loss_chunks, the pieces counted for both rows of a
    pair: TrainConfig.rows_per_micro_batch; `logps_of` then takes the rows' sums), else
    return whole logits."""
    last = step.model.inner[-1]
    last.row_losses = last.loss_chunks > 1


def reference_model_step(cfg: Any, step: Any, mesh: Any, say: Any) -> Any:
    """A TrainStep (no optimizer) of dpo.reference_model's weights in the run's layout, for
    the reference pass; freed after it. A model of another shape is one line (exit 2)."""
    from tessel.checkpoint.init_from import WeightSource, load_config
    from tessel.config.model import SHAPE_FIELDS
    from tessel.parallel.apply import build_parallel_model
    from tessel.train.step import TrainStep

    path = Path(cfg.dpo.reference_model)
    theirs = load_config(None, {"model.init_from": str(path),
                                "train.seq_len": cfg.train.seq_len}).model
    differ = [f"{k} {getattr(theirs, k)} (the policy's {getattr(cfg.model, k)})"
              for k in SHAPE_FIELDS if getattr(theirs, k) != getattr(cfg.model, k)]
    if differ:
        raise ConfigError(f"dpo.reference_model={str(path)!r} is not of the policy's shape: "
                          f"{', '.join(differ)}; use a model of the same shape")
    ref_cfg = cfg.with_overrides({"lora.enabled": False, "model.init_from": str(path)})
    source = WeightSource(path, ref_cfg.model)
    say(f"tessel: reference model {source.kind} {path}")
    dtype = torch.bfloat16 if step.precision.name == "bf16" else None
    model = build_parallel_model(ref_cfg, step.dims, mesh, step.device, dtype, source.get,
                                 source.buffer)
    return TrainStep(model, [], step.dims, mesh, step.device, step.precision, accum=step.accum,
                     grad_clip=0.0, parallel_cfg=cfg.parallel, distributed=step.distributed)
