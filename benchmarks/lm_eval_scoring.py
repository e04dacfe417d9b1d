"""What scoring a benchmark task costs during training, next to lm_eval's own `hf` model on the
same weights exported to Hugging Face, in one run.

    .venv/bin/python benchmarks/lm_eval_scoring.py [--preset tiny] [--questions 200] [--rounds 3]

Writes a local multiple-choice task (`questions` questions of 4 choices, about 20-token
contexts), trains the preset one step with that task configured, exports the checkpoint with
`tessel convert tessel-to-hf`, resumes the run in memory and times `Harness.scores()` (tessel's
TesselLM on the in-memory model: what an `lm_eval.interval` costs, lm_eval's own per-call
overhead included) and `simple_evaluate(model="hf", ...)` on the export `rounds` times, with the
same batch size, the two alternated. Prints the medians, their ratio, the scores of both (they
must be equal) and one training step's time for scale. CPU, fp32, offline.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import tempfile
import time
from pathlib import Path

WORDS = ("the model reads tokens and predicts the next token from the past while the optimizer "
         "updates weights with gradients computed by backpropagation through every layer").split()


def write_task(root: Path, questions: int) -> None:
    rng = random.Random(0)
    with open(root / "mc.jsonl", "w") as f:
        for _ in range(questions):
            q = " ".join(rng.choice(WORDS) for _ in range(18))
            choices = [" " + " ".join(rng.choice(WORDS) for _ in range(3)) for _ in range(4)]
            f.write(json.dumps({"question": q, "choices": choices, "answer": rng.randrange(4)}) + "\n")
    (root / "bench_mc.yaml").write_text(
        f"task: bench_mc\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {root / 'mc.jsonl'}\ntest_split: test\noutput_type: multiple_choice\n"
        'doc_to_text: "{{question}}"\ndoc_to_choice: "{{choices}}"\ndoc_to_target: answer\n'
        "metric_list:\n  - metric: acc\n  - metric: acc_norm\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--questions", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=8)
    args = ap.parse_args()
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    from tessel.cli import main as tessel
    from tessel.config import Config
    from tessel.observe.metrics import read_metrics
    from tessel.train import Trainer

    torch.set_num_threads(2)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        os.environ["HF_HOME"] = str(root / "hf-cache")
        os.environ["TESSEL_CACHE"] = str(root / "cache")
        write_task(root, args.questions)
        cfg = Config.load(None, {
            "model.preset": args.preset, "model.dropout": 0.0, "data.source": "synthetic",
            "data.tokenizer": "bytes", "train.steps": 1, "train.seq_len": 64,
            "train.micro_batch_size": 8, "train.global_batch_size": 8, "train.eval_interval": 0,
            "checkpoint.interval": 0, "metrics.tensorboard": False, "run.sample_tokens": 0,
            "run.dir": str(root / "run"), "lm_eval.tasks": ["bench_mc"],
            "lm_eval.include_path": str(root), "lm_eval.batch_size": args.batch_size})
        Trainer(cfg, console=False).train()  # one step and a checkpoint (the export reads it)
        step_s = [r for r in read_metrics(root / "run" / "metrics.jsonl")
                  if "step_time_s" in r][-1]["step_time_s"]
        assert tessel(["convert", "tessel-to-hf", str(root / "run"), str(root / "hf")]) == 0
        trainer = Trainer(cfg, resume=True, console=False)  # the same weights, in memory
        assert trainer.harness is not None
        manager = TaskManager(include_path=str(root), include_defaults=False)
        ours_t, hf_t, ours, theirs = [], [], {}, {}
        for _ in range(args.rounds):  # alternated: a shared machine's load hits both alike
            t0 = time.perf_counter()
            ours = trainer.harness.scores()
            ours_t.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            theirs = simple_evaluate(
                model="hf", model_args={"pretrained": str(root / "hf"), "device": "cpu",
                                        "dtype": "float32"},
                tasks=["bench_mc"], task_manager=manager, batch_size=args.batch_size,
                bootstrap_iters=0, log_samples=False)["results"]["bench_mc"]
            hf_t.append(time.perf_counter() - t0)
        trainer.close()
    a, b = statistics.median(ours_t), statistics.median(hf_t)
    print(f"preset {args.preset}, {args.questions} questions x 4 choices, batch {args.batch_size}, "
          f"{args.rounds} rounds, CPU fp32")
    print(f"tessel in-memory scoring: {a:.2f} s (median)   lm_eval hf on the export: {b:.2f} s "
          f"(median, model load included)   ratio {a / b:.2f}")
    print(f"one training step of the same model: {step_s:.3f} s")
    print(f"tessel: {ours}")
    print(f"hf:     acc {theirs['acc,none']} acc_norm {theirs['acc_norm,none']}")


if __name__ == "__main__":
    main()
