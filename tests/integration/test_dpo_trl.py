"""DPO against TRL's DPOTrainer itself (trl 1.16, the `dev` extra): a tiny transformers Llama
and a byte-level BPE made in the test, fp32 on CPU, the same pairs in the same order.

tessel's preference tokens equal the ids TRL's dataset preparation makes (text, conversations,
implicit prompts); the per-pair log-probabilities of the model converted into tessel
(model.init_from's Hugging Face import) equal those of TRL's fused LM head; each loss
variant equals TRL's `compute_loss` with a reference model that differs from the policy; and
five optimizer steps of tessel's DPO training leave the weights TRL's training loop leaves."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl")

from tessel.checkpoint.init_from import WeightSource, load_config  # noqa: E402
from tessel.data.chat_template import ChatTemplate  # noqa: E402
from tessel.data.preference import encode_record, to_record  # noqa: E402
from tessel.models.init import materialise  # noqa: E402
from tessel.models.transformer import Transformer  # noqa: E402
from tessel.train.dpo import pair_losses, row_logps, split_pairs, step_loss  # noqa: E402

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
LENGTH = 64  # rows of train.seq_len + 1 tokens (TRL's max_length)
LETTERS = "abcdefghijklmnopqrstuvwxyz"


def _chat_pairs(n: int) -> list[dict]:
    out = []
    for i in range(n):
        a, b = LETTERS[i % 25], LETTERS[i % 25 + 1]
        prompt = [{"role": "user", "content": f"Which letter comes after {a}?"}]
        if i % 3 == 0:
            prompt = [{"role": "system", "content": "Answer briefly."}, *prompt]
        out.append({"prompt": prompt,
                    "chosen": [{"role": "assistant", "content": f"After {a} comes {b}."}],
                    "rejected": [{"role": "assistant", "content": f"It is {LETTERS[(i * 7) % 26]}, "
                                  "I think." * (1 + i % 2)}]})
    return out


def _text_pairs() -> list[dict]:
    return [{"prompt": "Spell moon:", "chosen": " M-O-O-N", "rejected": " moon"},
            {"prompt": "2+2 =", "chosen": " 4", "rejected": " 5, or so I was told"}]


def _implicit_text() -> list[dict]:
    return [{"chosen": "Which letter comes after q? After q comes r.",
             "rejected": "Which letter comes after q? Maybe s."},
            {"chosen": "Spell sun: S-U-N", "rejected": "Spell sun: sun"}]


def _implicit_chat() -> list[dict]:
    user = {"role": "user", "content": "Spell wind."}
    return [{"chosen": [user, {"role": "assistant", "content": "W-I-N-D"}],
             "rejected": [user, {"role": "assistant", "content": "wind"}]}]


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random Llama and its tokenizer (ChatML, <|im_end|> the end of a turn)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("hf")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    texts = [json.dumps(r) for r in _chat_pairs(30) + _text_pairs() + _implicit_text()] * 4
    tok.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"]))
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=176,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        max_position_embeddings=128, tie_word_embeddings=False,
        eos_token_id=tok.token_to_id("<|im_end|>"))).save_pretrained(path)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": CHATML, "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
         "tokenizer_class": "PreTrainedTokenizerFast"}))
    return path


def _hf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


def _trainer(path: Path, records: list[dict], ref_model=None, steps: int = 1, **args):
    """TRL's DPOTrainer over `records` in their order (no shuffling), fp32 on CPU."""
    from datasets import Dataset
    from torch.utils.data import SequentialSampler
    from transformers import LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    class InOrder(DPOTrainer):
        def _get_train_sampler(self, *a, **k):  # the pairs in the order given
            return SequentialSampler(self.train_dataset)

    model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32)
    if ref_model is None:
        ref_model = copy.deepcopy(model)
    config = DPOConfig(
        output_dir=str(path.parent / "trl-out"), max_length=LENGTH, per_device_train_batch_size=4,
        gradient_accumulation_steps=1, max_steps=steps, learning_rate=1e-3,
        lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
        use_cpu=True, bf16=False, report_to=[], save_strategy="no", logging_steps=1, seed=0,
        dataloader_num_workers=0, disable_tqdm=True, **args)
    return InOrder(model=model, ref_model=ref_model, args=config,
                   train_dataset=Dataset.from_list(records),
                   processing_class=_hf_tokenizer(path))


def _tessel(path: Path) -> Transformer:
    m = load_config(None, {"model.init_from": str(path), "train.seq_len": LENGTH - 1}).model
    with torch.device("meta"):
        model = Transformer(m)
    materialise(model, torch.device("cpu"), 0, WeightSource(path, m).get)
    return model


def _ours(path: Path, records: list[dict]) -> list[tuple[list[int], list[int], list[int]]]:
    from tokenizers import Tokenizer

    hf = Tokenizer.from_file(str(path / "tokenizer.json"))
    template = ChatTemplate(CHATML, "test", bos_token="", eos_token="<|im_end|>")
    return [encode_record(to_record(r, f"r{i}"), template, hf, "<|im_end|>")
            for i, r in enumerate(records)]


def _rows(encoded, pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's rows [chosen..., rejected...] as tessel's pair loader makes them."""
    rows, learned = [], []
    for j in (1, 2):
        for e in encoded:
            ids = (e[0] + e[j])[:LENGTH]
            rows.append(ids + [pad] * (LENGTH - len(ids)))
            learned.append([0] * len(e[0]) + [1] * (len(ids) - len(e[0])) + [0] * (LENGTH - len(ids)))
    tokens, mask = torch.tensor(rows), torch.tensor(learned, dtype=torch.bool)
    return tokens[:, :-1], tokens[:, 1:].masked_fill(~mask[:, 1:], -100)


@pytest.mark.parametrize("form", ["chat", "text", "implicit_text", "implicit_chat"])
def test_preference_tokens_equal_trls(hf_dir: Path, form: str):
    """The learned tokens of every pair, in every record form, are TRL's."""
    records = {"chat": _chat_pairs(6), "text": _text_pairs(), "implicit_text": _implicit_text(),
               "implicit_chat": _implicit_chat()}[form]
    trainer = _trainer(hf_dir, records)
    theirs = [(r["prompt_ids"], r["chosen_ids"], r["rejected_ids"]) for r in trainer.train_dataset]
    assert _ours(hf_dir, records) == theirs


def _trl_logps(trainer, batch: dict, model) -> torch.Tensor:
    """TRL's per-row reply log-probabilities (its _compute_loss's lines)."""
    labels = batch["input_ids"].masked_fill(batch["completion_mask"] == 0, -100)
    with torch.no_grad():
        out = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                    labels=labels, fused_lm_head=True, use_cache=False)
    return out.log_probs.sum(dim=1)


def _perturbed(hf_dir: Path, out: Path) -> Path:
    """The model of `hf_dir` with every weight moved a little: a reference that is not the
    policy."""
    from transformers import LlamaForCausalLM

    ref = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    torch.manual_seed(5)
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    ref.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((hf_dir / f).read_bytes())
    return out


VARIANTS = {"sigmoid": ({"loss_type": ["sigmoid"]}, {}),
            "ipo": ({"loss_type": ["ipo"], "beta": 0.5}, {"beta": 0.5}),
            "hinge": ({"loss_type": ["hinge"], "beta": 0.5}, {"beta": 0.5}),
            "robust": ({"loss_type": ["robust"], "label_smoothing": 0.2}, {"label_smoothing": 0.2}),
            "sigmoid+sft": ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]},
                            {"sft_weight": 0.5})}


class Settings:
    def __init__(self, loss: str, beta: float = 0.1, label_smoothing: float = 0.0,
                 loss_weight: float = 1.0, sft_weight: float = 0.0):
        self.loss, self.beta, self.label_smoothing = loss, beta, label_smoothing
        self.loss_weight, self.sft_weight = loss_weight, sft_weight


@pytest.mark.budget(40)  # five TRL trainers built (23 s measured)
def test_log_probs_and_every_loss_equal_trls(hf_dir: Path, tmp_path: Path):
    """Per-pair chosen/rejected log-probabilities within 1e-6 relative, and each loss variant
    within 1e-6, against a reference model that is not the policy."""
    from transformers import LlamaForCausalLM

    records = _chat_pairs(4)
    ref_dir = _perturbed(hf_dir, tmp_path / "ref")
    x, y = _rows(_ours(hf_dir, records), pad=0)
    with torch.no_grad():
        ours = split_pairs(row_logps(_tessel(hf_dir)(x), y)[0])
        ours_ref = split_pairs(row_logps(_tessel(ref_dir)(x), y)[0])
    counts = split_pairs((y != -100).sum(1))
    for name, (trl_args, settings) in VARIANTS.items():
        trainer = _trainer(hf_dir, records, ref_model=LlamaForCausalLM.from_pretrained(ref_dir),
                           **trl_args)
        batch = trainer.data_collator([trainer.train_dataset[i] for i in range(len(records))])
        theirs = split_pairs(_trl_logps(trainer, batch, trainer.model))
        theirs_ref = split_pairs(_trl_logps(trainer, batch, trainer.ref_model))
        torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=0)
        torch.testing.assert_close(ours_ref, theirs_ref, rtol=1e-6, atol=0)
        with torch.no_grad():
            want = trainer.compute_loss(trainer.model, batch)
        s = Settings(name.split("+")[0], **settings)
        got = step_loss(ours, ours_ref, counts, s, len(records), float(counts[:, 0].sum()))
        print(f"{name}: log-probs {float(((ours - theirs) / theirs).abs().max()):.2g}, reference "
              f"{float(((ours_ref - theirs_ref) / theirs_ref).abs().max()):.2g} relative, "
              f"loss {abs(float(got) - float(want)):.2g}")  # the figures, with pytest -s
        assert abs(float(got) - float(want)) <= 1e-6, (name, float(got), float(want))
        assert pair_losses(ours, ours_ref, counts, s.loss, s.beta, s.label_smoothing).shape == (4,)


@pytest.mark.budget(80)  # TRL's five steps and tessel's (43 s measured, 10 s fixture)
def test_five_steps_leave_trls_weights(hf_dir: Path, tmp_path: Path):
    """Five AdamW steps of 4 pairs (sigmoid DPO with the SFT term, the reference the initial
    model, its log-probabilities computed once before training as tessel does): the weights
    after them equal those TRL's training loop leaves, within float noise."""
    records = _chat_pairs(20)
    trainer = _trainer(hf_dir, records, steps=5, loss_type=["sigmoid", "sft"],
                       loss_weights=[1.0, 0.5], beta=0.5)
    trainer.train()
    out = tmp_path / "trl"
    trainer.model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((hf_dir / f).read_bytes())

    model = _tessel(hf_dir)
    encoded = _ours(hf_dir, records)
    batches = [_rows(encoded[k:k + 4], pad=0) for k in range(0, 20, 4)]
    with torch.no_grad():  # the reference: the initial model, once
        refs = [split_pairs(row_logps(model(x), y)[0]) for x, y in batches]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.0)
    settings = Settings("sigmoid", beta=0.5, sft_weight=0.5)
    for (x, y), ref in zip(batches, refs):
        logps, _ = row_logps(model(x), y)
        counts = split_pairs((y != -100).sum(1))
        loss = step_loss(split_pairs(logps), ref, counts, settings, 4, float(counts[:, 0].sum()))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
    theirs = _tessel(out).state_dict()
    start = _tessel(hf_dir).state_dict()
    worst = 0.0
    for name, value in model.state_dict().items():
        if not value.is_floating_point():
            continue
        moved = (theirs[name] - start[name]).abs().max()
        diff = (value - theirs[name]).abs().max()
        assert float(moved) > 0 or float(diff) == 0, name  # every weight trained
        worst = max(worst, float(diff))
    print(f"five steps: largest weight difference from TRL's {worst:.3g}")  # pytest -s
    # A step moves a weight by up to lr = 1e-3. Measured: 8.0e-6 with AdamW's eps = 1e-8, where
    # Adam divides the float noise of near-zero gradients by their tiny root mean square;
    # 1.2e-7 with eps = 1e-3 on both sides (the same run otherwise).
    assert worst < 1e-5, worst


@pytest.mark.budget(60)  # TRL's five steps and tessel train's (15 s measured, 7 s fixture)
def test_tessel_train_dpo_equals_trl(hf_dir: Path, tmp_path: Path):
    """`tessel train` with train.objective = "dpo" (the model and tokenizer of model.init_from,
    its chat template, 20 chat pairs read from JSONL, reference log-probabilities precomputed)
    against TRL's DPOTrainer over the pairs in the order tessel's loader deals them: each of
    the five steps' losses, and the weights after them."""
    from tessel.train.trainer import Trainer

    records = _chat_pairs(20)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(None, {
        "model.init_from": str(hf_dir), "train.objective": "dpo", "dpo.paths": [str(pairs)],
        "dpo.beta": 0.5, "dpo.sft_weight": 0.5, "data.chat_template": "auto",
        "data.split": "100,0", "train.seq_len": LENGTH - 1, "train.steps": 5,
        "train.micro_batch_size": 2, "train.global_batch_size": 4,  # 2 micro-batches a step
        "train.grad_clip": 1.0, "train.precision": "fp32", "train.device": "cpu",
        "train.eval_interval": 0, "optim.lr": 1e-3, "optim.schedule": "constant",
        "optim.warmup_steps": 0, "optim.weight_decay": 0.0, "optim.beta2": 0.999,
        "metrics.log_interval": 1, "run.dir": str(tmp_path / "run"), "run.sample_tokens": 0})
    trainer = Trainer(cfg, console=False)
    schedule = copy.deepcopy(trainer.data.train.schedule)
    order = [schedule.next()[1] for _ in range(20)]  # the pairs the five steps read
    assert sorted(order) == list(range(20))
    trainer.train()
    ours = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ours = [r for r in ours if "loss" in r]
    assert (tmp_path / "run" / "reference_logps.npy").is_file()

    trl = _trainer(hf_dir, [records[i] for i in order], steps=5, loss_type=["sigmoid", "sft"],
                   loss_weights=[1.0, 0.5], beta=0.5)
    trl.train()
    theirs = [r for r in trl.state.log_history if "loss" in r]
    assert [r["step"] for r in ours] == [r["step"] for r in theirs] == [1, 2, 3, 4, 5]
    losses = [abs(a["loss"] - b["loss"]) for a, b in zip(ours, theirs)]
    for key in ("rewards/chosen", "rewards/margins", "logps/rejected"):
        assert abs(ours[0][key] - theirs[0][key]) <= 1e-4 * max(1.0, abs(theirs[0][key])), key
    state = trainer.model.inner[0].state_dict()
    out = tmp_path / "trl"
    trl.model.save_pretrained(out)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        (out / f).write_bytes((hf_dir / f).read_bytes())
    theirs_w = _tessel(out).state_dict()
    worst = max(float((v - theirs_w[k]).abs().max()) for k, v in state.items()
                if v.is_floating_point())
    print(f"tessel train vs TRL: step losses {max(losses):.2g}, weights {worst:.3g}")  # -s
    # measured: 4.8e-7 and 1.5e-6 (two micro-batches a step; a step moves a weight by up to
    # lr = 1e-3, and Adam divides the float noise of near-zero gradients by their tiny root
    # mean square, as in the hand loop above)
    assert max(losses) <= 1e-6, losses
    assert worst < 1e-5, worst


@pytest.mark.budget(45)  # TRL's two steps and tessel train's (fixture shared)
def test_tessel_train_with_another_reference_model_equals_trl(hf_dir: Path, tmp_path: Path):
    """dpo.reference_model (TRL's ref_model): a model that is not the initial policy as the
    reference; two steps of `tessel train` equal TRL's, loss for loss."""
    from transformers import LlamaForCausalLM

    from tessel.train.trainer import Trainer

    ref_dir = _perturbed(hf_dir, tmp_path / "ref")
    records = _chat_pairs(8)
    pairs = tmp_path / "pairs.jsonl"
    pairs.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = load_config(None, {
        "model.init_from": str(hf_dir), "train.objective": "dpo", "dpo.paths": [str(pairs)],
        "dpo.reference_model": str(ref_dir), "data.chat_template": "auto",
        "data.split": "100,0", "train.seq_len": LENGTH - 1, "train.steps": 2,
        "train.micro_batch_size": 4, "train.global_batch_size": 4, "train.grad_clip": 1.0,
        "train.precision": "fp32", "train.device": "cpu", "train.eval_interval": 0,
        "optim.lr": 1e-3, "optim.schedule": "constant", "optim.warmup_steps": 0,
        "optim.weight_decay": 0.0, "optim.beta2": 0.999, "metrics.log_interval": 1,
        "run.dir": str(tmp_path / "run"), "run.sample_tokens": 0})
    trainer = Trainer(cfg, console=False)
    schedule = copy.deepcopy(trainer.data.train.schedule)
    order = [schedule.next()[1] for _ in range(8)]
    trainer.train()
    ours = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trl = _trainer(hf_dir, [records[i] for i in order], steps=2,
                   ref_model=LlamaForCausalLM.from_pretrained(ref_dir, dtype=torch.float32))
    trl.train()
    theirs = [r for r in trl.state.log_history if "loss" in r]
    losses = [abs(a["loss"] - b["loss"]) for a, b in zip([r for r in ours if "loss" in r], theirs)]
    print(f"another reference: step losses {max(losses):.2g}")  # -s
    assert len(losses) == 2 and max(losses) <= 1e-6, losses
    # the reference's rewards are not 0 at the first step (it is not the policy)
    assert abs(theirs[0]["rewards/chosen"]) > 1e-3
