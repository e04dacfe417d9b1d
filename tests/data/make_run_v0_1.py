"""How tests/data/run_v0_1 was made: a run directory written by tessel at commit 3fadffb
(before the structure refactor), kept to prove that today's code resumes it.

    git archive 3fadffb | tar -x -C /tmp/oldcode
    PYTHONPATH=/tmp/oldcode:/tmp/oldcode/tests python tests/data/make_run_v0_1.py

It trains 3 steps (the shipped directory), then resumes a copy to step 5 and prints the
losses and the weight digest that tests/integration/test_compat.py expects; the step-5
weights themselves are tests/data/run_v0_1_step5.safetensors (made on 2026-11-25 by today's
code, which gives exactly that digest on the AMD machine the figures were taken on, with
OMP_NUM_THREADS=1 ATEN_CPU_CAPABILITY=default as the test runs it).
Not a test: pytest does not collect it.
"""

import hashlib
import json
import shutil
from pathlib import Path

from conftest import write_corpus

from tessel.checkpoint import latest_checkpoint, read_full
from tessel.config import Config
from tessel.observe.metrics import read_metrics
from tessel.train import Trainer

OUT = Path("/tmp/oldrun")
shutil.rmtree(OUT, ignore_errors=True)
corpus = write_corpus(OUT / "corpus", n_docs=4, words_per_doc=200)
overrides = {
    "model.preset": "tiny", "model.n_layers": 1, "model.d_model": 32, "model.n_heads": 2,
    "data.source": "files", "data.paths": [str(corpus)], "data.tokenizer": "bytes",
    "data.split": "90,10", "train.steps": 3, "train.seq_len": 32, "train.micro_batch_size": 2,
    "train.global_batch_size": 4, "train.eval_interval": 0, "train.eval_iters": 1,
    "optim.lr": 3e-3, "optim.warmup_steps": 1, "checkpoint.interval": 0,
    "metrics.log_interval": 1, "metrics.tensorboard": False, "run.dir": str(OUT / "run"),
    "run.sample_tokens": 0,
}
trainer = Trainer(Config.load(None, overrides), console=False)
trainer.train()
trainer.close()

resumed = OUT / "resumed"
shutil.copytree(OUT / "run", resumed, symlinks=True)
cfg = Config.load(resumed / "config.toml",
                  {"run.dir": str(resumed), "train.steps": 5, "data.paths": [str(corpus)]})
trainer = Trainer(cfg, resume=True, console=False)
trainer.train()
trainer.close()
print(json.dumps({m["step"]: m["loss"] for m in read_metrics(resumed / "metrics.jsonl") if "loss" in m}))
weights = read_full(latest_checkpoint(resumed / "checkpoints"), "model")
digest = hashlib.sha256()
for name in sorted(weights):
    digest.update(name.encode())
    digest.update(weights[name].contiguous().numpy().tobytes())
print(digest.hexdigest())
