"""The sample a run that finished prints (`run.sample_tokens` tokens after
`run.sample_prompt`): a part with its own cadence, due once, after the run's last step."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from tessel.generate import sample


class FinalSample:
    def __init__(self, cfg: Any, model: Any, tokenizer: Any, run_dir: Path, distributed: bool):
        """`cfg`: the run's Config; `model`: the (first) model part to sample from."""
        self.cfg, self.model, self.tokenizer = cfg, model, tokenizer
        self.run_dir, self.distributed = run_dir, distributed

    def due(self, step: int) -> bool:
        return bool(self.cfg.run.sample_tokens) and step >= self.cfg.train.steps

    def text(self) -> str:
        """The sample (a chat reply for a fine-tune), or why there is none."""
        cfg, tok, n = self.cfg, self.tokenizer, self.cfg.run.sample_tokens
        prompt = cfg.run.sample_prompt
        if self.distributed:
            return (f"(no sample under a parallel layout; `tessel generate {self.run_dir}` "
                    "samples from the checkpoint)")
        if cfg.data.source == "sft":  # a reply to the prompt as a user message
            from tessel.generate import chat_prompt, chat_template_for

            template = chat_template_for(self.run_dir, None, tok)
            ids, end, stop_id = chat_prompt(template, tok, prompt)
            reply = tok.hf.decode(sample(self.model, ids, n, seed=cfg.train.seed,
                                         stop_id=stop_id), skip_special_tokens=False)
            return (f"sample (chat):\nuser: {prompt}\nassistant: "
                    + (reply.split(end, 1)[0] if end else reply))
        ids = sample(self.model, tok.encode(prompt), n, seed=cfg.train.seed,
                     stop_id=tok.eod_id)
        return "sample:\n" + prompt + tok.decode(ids)
