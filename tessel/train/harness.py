"""Benchmark scores during training through lm-evaluation-harness (`lm_eval`, optional).

`TesselLM` is an `lm_eval` language model running on the trainer's in-memory model, in its
current parallel layout, with the run's tokenizer. It scores requests exactly as lm_eval's
own `hf` model does on the same weights exported to Hugging Face (same tokenization of
context/continuation pairs, same left truncation to the model's context, same rolling
windows), so the scores equal `lm_eval --model hf` on `tessel convert tessel-to-hf` output.

Parallel layouts: every rank runs the whole evaluation on its replica, with the same
requests in the same order and batches of the same shapes, so all ranks call the model's
forward together the same number of times, as FSDP's all-gathers and tensor parallelism's
collectives need (data-parallel replicas compute the same scores; rank 0 writes them).
Pipeline and context parallelism are refused before launch, and every task is loaded and one
request built before training (`tessel.train.harness_check`).
"""

from __future__ import annotations

import contextlib
import math
import random
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

from tessel.parallel.dist import all_reduce_sum
from tessel.parallel.tensor import local_value
from tessel.train.harness_check import generation_limit, require_lm_eval

if TYPE_CHECKING:
    from tessel.config import Config
    from tessel.data.tokenizer import Tokenizer
    from tessel.train.step import TrainStep

def score_keys(results: dict[str, Any]) -> dict[str, float]:
    """lm_eval's results (`simple_evaluate(...)["results"]`) as metrics-record fields:
    `eval/<task>/<metric>` ("acc,none" -> acc; another filter is kept: "exact_match,strict"
    -> exact_match_strict); standard errors and non-numbers are left out."""
    out: dict[str, float] = {}
    for task, metrics in results.items():
        for key, value in metrics.items():
            if "," not in key or "_stderr" in key:
                continue
            if not isinstance(value, (int, float)) or isinstance(value, bool):
                continue
            metric, filt = key.split(",", 1)
            name = metric if filt == "none" else f"{metric}_{filt}"
            out[f"eval/{task}/{name}"] = float(value)
    return out


def _template_lm() -> type:
    require_lm_eval()
    from lm_eval.api.model import TemplateLM

    return TemplateLM


def build_lm(step: TrainStep, tokenizer: Tokenizer, batch_size: int, max_gen_tokens: int,
             beat: Callable[[str], None] | None = None) -> Any:
    """A `TesselLM` (defined when lm_eval is imported: it subclasses lm_eval's TemplateLM)."""
    global TesselLM
    if TesselLM is None:
        TesselLM = _define(_template_lm())
    return TesselLM(step, tokenizer, batch_size, max_gen_tokens, beat)


TesselLM: Any = None


class _TesselLMMethods:
    """lm_eval's language-model interface on a tessel model in any data- or tensor-
    parallel layout (see the module docstring). A mixin: `_define` puts it before
    lm_eval's TemplateLM, which is imported only when scoring is asked for."""

    def __init__(self, step: TrainStep, tokenizer: Tokenizer, batch_size: int,
                 max_gen_tokens: int, beat: Callable[[str], None] | None = None):
        super().__init__()
        self.step = step
        self.tok = tokenizer
        self.batch_size = batch_size
        self.max_gen_tokens = max_gen_tokens
        self.beat = beat or (lambda _what: None)
        self.cfg = step.model.inner[0].cfg
        self.max_length = self.cfg.max_seq_len
        self._calls = 0

    # ---- tokenization: as lm_eval's `hf` model on the exported tokenizer -----------

    @property
    def eot_token_id(self) -> int:
        return self.tok.eod_id

    @property
    def prefix_token_id(self) -> int:
        # The exported config's BOS: the template's first token (Llama 3), else the eod.
        return self.tok.prefix_ids[0] if self.tok.prefix_ids else self.tok.eod_id

    def tok_encode(self, string: str, add_special_tokens: bool | None = None,
                   **kwargs: Any) -> list[int]:
        # As lm_eval's `hf` model (add_bos_token unset): the tokenizer's template applies
        # (a Llama 3 BOS) unless asked otherwise or the text already starts with it.
        if add_special_tokens is None:
            add_special_tokens = not string.startswith(self.tok_decode([self.prefix_token_id]))
        return self.tok.hf.encode(string, add_special_tokens=add_special_tokens).ids

    def tok_decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        return self.tok.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def loglikelihood(self, requests: list[Any], disable_tqdm: bool = False
                      ) -> list[tuple[float, bool]]:
        # No progress bars in the training log (simple_evaluate does not ask).
        return super().loglikelihood(requests, disable_tqdm=True)

    # ---- the model call -------------------------------------------------------------

    @torch.no_grad()
    def _logits(self, rows: list[list[int]]) -> torch.Tensor:
        """Logits (B, T, vocab) on the device of `rows` right-padded to one length
        (causal: padding never changes the positions before it), over the real
        vocabulary (the padding ids of model.vocab_pad_to left out)."""
        s = self.step
        width = max(len(r) for r in rows)
        width = math.ceil(width / s.dims.tp) * s.dims.tp  # sequence parallelism splits T
        x = torch.full((len(rows), width), self.tok.eod_id, dtype=torch.long)
        for i, r in enumerate(rows):
            x[i, : len(r)] = torch.tensor(r, dtype=torch.long)
        self._calls += 1
        self.beat(f"lm_eval forward {self._calls}")
        was_training = s.model.parts[0].training
        s.model.train(False)
        try:
            with s.precision.autocast():
                logits = s.model.parts[0](x.to(s.device), None)  # (B, T, padded vocab)
        finally:
            s.model.train(was_training)
        # Tensor parallelism: logits are sharded over the vocabulary; gather them.
        return local_value(logits)[..., : self.cfg.vocab_size]

    @staticmethod
    def _log_probs(logits: torch.Tensor) -> torch.Tensor:
        """float32 log-softmax on the CPU of the positions asked for only (a whole
        batch's would be B x T x vocab floats: gigabytes for a 128k vocabulary)."""
        return F.log_softmax(logits.float(), dim=-1).cpu()

    def _loglikelihood_tokens(self, requests: list[Any], disable_tqdm: bool = False,
                              **kwargs: Any) -> list[tuple[float, bool]]:
        """(log-likelihood of the continuation, whether greedy decoding gives it) per
        ((context, continuation), context ids, continuation ids) request."""
        rows = []
        for _key, context, continuation in requests:
            # Left-truncated to the context length, the last token is never an input.
            ids = (context + continuation)[-(self.max_length + 1):][:-1]
            rows.append((ids, len(continuation)))
        # Longest first: fewer pads per batch; answers go back in request order.
        order = sorted(range(len(rows)), key=lambda i: -len(rows[i][0]))
        out: list[tuple[float, bool] | None] = [None] * len(rows)
        for start in range(0, len(order), self.batch_size):
            chunk = order[start : start + self.batch_size]
            logits = self._logits([rows[i][0] for i in chunk])
            for b, i in enumerate(chunk):
                ids, n = rows[i]
                cont = torch.tensor(requests[i][2][-n:], dtype=torch.long)
                lp = self._log_probs(logits[b, len(ids) - n : len(ids)])  # (n, vocab)
                greedy = bool((lp.argmax(-1) == cont).all())
                out[i] = (float(lp.gather(-1, cont[:, None]).sum()), greedy)
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
        return [o for o in out if o is not None]

    def loglikelihood_rolling(self, requests: list[Any], disable_tqdm: bool = False
                              ) -> list[float]:
        """Whole-text log-likelihoods (perplexity tasks), in disjoint windows of the
        model's context, each predicting its tokens from the window before."""
        from lm_eval import utils

        out = []
        for req in requests:
            (text,) = req.args
            windows = [utils.make_disjoint_window(w) for w in utils.get_rolling_token_windows(
                token_list=self.tok_encode(text), prefix_token=self.prefix_token_id,
                max_seq_len=self.max_length, context_len=1)]
            scores = self._loglikelihood_tokens([(None, c, t) for c, t in windows])
            total = sum(lp for lp, _ in scores)
            self.cache_hook.add_partial("loglikelihood_rolling", (text,), total)
            out.append(total)
        return out

    def generate_until(self, requests: list[Any], disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations (sampling settings are ignored), stopped at the task's
        `until` strings, the end-of-text token or `max_gen_toks`. No KV cache: each token
        is one forward pass. Rank 0's token is every rank's (one all-reduce per token),
        so the ranks stop together even if their float results ever differed in a tie."""
        from lm_eval.models.utils import handle_stop_sequences, postprocess_generated_text

        eos = self.tok_decode([self.eot_token_id])
        out = []
        for req in requests:
            context, gen_kwargs = req.args
            kwargs, limit = generation_limit(gen_kwargs, self.max_gen_tokens, self.max_length)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            ids = self.tok_encode(context)[-(self.max_length - limit):]
            new: list[int] = []
            for _ in range(limit):
                last = self._logits([ids + new])[0, len(ids) + len(new) - 1]  # (vocab,)
                nxt = self._agree(int(self._log_probs(last).argmax()))
                if nxt == self.eot_token_id:
                    break
                new.append(nxt)
                if any(u in self.tok_decode(new, skip_special_tokens=True) for u in until):
                    break
            text = postprocess_generated_text(
                self.tok_decode(new, skip_special_tokens=True), until, None)
            self.cache_hook.add_partial("generate_until", (context, gen_kwargs), text)
            out.append(text)
        return out

    def _agree(self, token: int) -> int:
        if not self.step.distributed:
            return token
        import torch.distributed as dist

        t = torch.tensor([token if dist.get_rank() == 0 else 0], dtype=torch.long,
                         device=self.step.device)
        return int(all_reduce_sum(t).item())



def _define(base: type) -> type:
    """TesselLM: the methods above on lm_eval's `base` (TemplateLM)."""
    return type("TesselLM", (_TesselLMMethods, base), {"__doc__": _TesselLMMethods.__doc__})


class Harness:
    """Runs the configured lm_eval tasks on the trainer's model; every rank calls `scores`
    together."""

    def __init__(self, cfg: Config, manager: Any, step: TrainStep, tokenizer: Tokenizer,
                 beat: Callable[[str], None] | None = None):
        self.cfg = cfg.lm_eval
        self.seed = cfg.train.seed
        self.last = cfg.train.steps
        self.failure: str | None = None  # why scoring failed, once it has: no more of it
        self.manager = manager
        self.lm = build_lm(step, tokenizer, self.cfg.batch_size, self.cfg.max_gen_tokens, beat)

    def due(self, step: int) -> bool:
        """Whether to score after optimizer step `step`: every lm_eval.interval steps and
        after the run's last one, until scoring failed."""
        if self.failure is not None:
            return False
        return step == self.last or bool(self.cfg.interval and step % self.cfg.interval == 0)

    def scores(self) -> dict[str, float]:
        """`eval/<task>/<metric>` of every configured task on the model as it is now."""
        from lm_eval import simple_evaluate

        e = self.cfg
        with random_state_kept(), environment_report_skipped():
            results = simple_evaluate(
                model=self.lm, tasks=list(e.tasks), num_fewshot=e.num_fewshot,
                limit=e.limit or None, task_manager=self.manager, log_samples=False,
                bootstrap_iters=0, random_seed=self.seed, numpy_random_seed=self.seed,
                torch_random_seed=self.seed, fewshot_random_seed=self.seed)
        return score_keys(results["results"]) if results is not None else {}


@contextlib.contextmanager
def environment_report_skipped() -> Iterator[None]:
    """simple_evaluate ends by describing the environment in its results: torch's
    `collect_env` (which runs pip, gcc, nvidia-smi and more) and the git hashes of the working
    directory and its parent. That took 2.4 s of every call on a 2-core CPU machine, on every
    rank at every scoring; tessel keeps only `results["results"]`, so both are skipped while
    it scores (lm_eval's own runs, outside this, keep them)."""
    import lm_eval.evaluator as evaluator

    stubs: dict[str, Callable[..., None]] = {"add_env_info": lambda storage: None,
                                             "get_git_commit_hash": lambda: None}
    kept = {name: getattr(evaluator, name) for name in stubs if hasattr(evaluator, name)}
    for name in kept:
        setattr(evaluator, name, stubs[name])
    try:
        yield
    finally:
        for name, function in kept.items():
            setattr(evaluator, name, function)


@contextlib.contextmanager
def random_state_kept() -> Iterator[None]:
    """simple_evaluate seeds Python's, NumPy's and torch's global generators (its few-shot
    samples are reproducible that way); training goes on from the states it had (dropout
    draws from torch's), so a run scores without changing what it trains."""
    import numpy as np

    state = (random.getstate(), np.random.get_state(), torch.get_rng_state(),
             torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None)
    try:
        yield
    finally:
        random.setstate(state[0])
        np.random.set_state(state[1])
        torch.set_rng_state(state[2])
        if state[3] is not None:
            torch.cuda.set_rng_state_all(state[3])
