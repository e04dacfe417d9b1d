"""LoRA against `peft` itself: a small random HF Llama written by the test (no hub) is the
frozen base; tessel's adapters load into peft with the same logits, train as peft's do, and a
LoRA run's checkpoints hold only the adapters, resume exactly and refuse another base."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from conftest import write_corpus
from peft import LoraConfig as PeftLoraConfig
from peft import PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from test_cli import assert_one_line_error, tessel_here
from test_hf import VOCAB, hf_llama, save_hf, tessel_model
from transformers import AutoModelForCausalLM, LlamaForCausalLM

from tessel.checkpoint import latest_checkpoint, read_full
from tessel.checkpoint.hf_arch import one_to_one
from tessel.checkpoint.init_from import WeightSource, load_config
from tessel.cli import main
from tessel.data import build_data
from tessel.generate import load_run_for_inference
from tessel.models.init import materialise
from tessel.models.lora import TESSEL_TO_HF, add_lora
from tessel.models.transformer import Transformer
from tessel.train.trainer import Trainer

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_overrides(src: Path, run: Path, corpus: Path, **extra) -> dict:
    return {
        "model.init_from": str(src), "data.source": "files", "data.paths": [str(corpus)],
        "train.seq_len": 32, "train.steps": 4, "train.micro_batch_size": 2,
        "train.global_batch_size": 2, "train.eval_interval": 0, "train.eval_iters": 1,
        "train.grad_clip": 0.0, "optim.lr": 2e-2, "optim.warmup_steps": 0,
        "optim.schedule": "constant", "checkpoint.interval": 2, "metrics.log_interval": 1,
        "metrics.tensorboard": False, "run.dir": str(run), "run.sample_tokens": 0,
        "lora.enabled": True, "lora.rank": 4, "lora.alpha": 8.0, "lora.targets": ALL,
        **extra,
    }


def tessel_lora_model(src: Path, ckpt: Path, cfg) -> Transformer:  # noqa: ANN001
    """The base of `src` with the adapters of `ckpt`, plain (one process)."""
    m = cfg.model
    with torch.device("meta"):
        model = Transformer(m)
    add_lora(model, cfg.lora.targets, cfg.lora.rank, cfg.lora.alpha)
    materialise(model, torch.device("cpu"), 0, WeightSource(src, m).get)
    adapters = read_full(ckpt, "model")
    missing, _ = model.load_state_dict(adapters, strict=False)
    assert not [k for k in missing if "lora" in k]
    return model.eval()


@pytest.fixture(scope="module")
def shared_corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("lora-corpus") / "corpus")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, shared_corpus: Path):  # noqa: ANN201
    """A 4-step LoRA run on a small random HF Llama (checkpoints at steps 2 and 4, the peft
    export during training at 4): (base, run, config). Shared by the module: a test that
    changes anything works on a copy."""
    root = tmp_path_factory.mktemp("lora")
    src = save_hf(hf_llama(), root / "hf", shared_corpus)
    run = root / "run"
    # the peft export during training (lora.export) at the last step
    cfg = load_config(None, lora_overrides(src, run, shared_corpus, **{
        "checkpoint.hf_export_interval": 4, "lora.export": "peft"}))
    with pytest.MonkeyPatch.context() as mp:  # (the function-scoped cache fixture is not up yet)
        mp.setenv("TESSEL_CACHE", str(tmp_path_factory.getbasetemp() / "cache"))
        Trainer(cfg, console=False).train()
    return src, run, Config_of(run)


def Config_of(run: Path):  # noqa: ANN201, N802
    from tessel.config import Config

    return Config.load(run / "config.toml")


def test_peft_loads_the_adapters_and_the_merged_export_has_the_same_logits(trained, tmp_path):
    src, run, cfg = trained
    ckpt = latest_checkpoint(run / "checkpoints")
    ours = tessel_lora_model(src, ckpt, cfg)
    adapters = tmp_path / "adapter"
    assert main(["convert", "tessel-to-hf", str(run), str(adapters), "--peft"]) == 0
    written = json.loads((adapters / "adapter_config.json").read_text())
    assert written["r"] == 4 and written["lora_alpha"] == 8.0
    assert sorted(written["target_modules"]) == sorted(ALL)
    base = LlamaForCausalLM.from_pretrained(src).eval()
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        plain = base(x).logits
        theirs = PeftModel.from_pretrained(base, adapters).eval()(x).logits
        mine = ours(x)[..., :VOCAB]
    assert (mine - theirs).abs().max() <= 1e-5
    assert (plain - theirs).abs().max() > 1e-2  # the adapters matter: the test means something
    during = load_file(run / "checkpoints/step_00000004/hf/adapter_model.safetensors")
    after = load_file(adapters / "adapter_model.safetensors")
    assert during.keys() == after.keys() and all(torch.equal(during[k], after[k]) for k in after)
    sampler, _ = load_run_for_inference(run)  # tessel generate: the base + adapters, merged
    with torch.no_grad():
        assert (sampler(x)[..., :VOCAB] - mine).abs().max() <= 1e-4
    merged = tmp_path / "merged"
    assert main(["convert", "tessel-to-hf", str(run), str(merged)]) == 0
    with torch.no_grad():
        folded = AutoModelForCausalLM.from_pretrained(merged).eval()(x).logits
    assert (mine - folded).abs().max() <= 1e-4


def test_tessel_lora_trains_as_peft_does(tmp_path: Path, corpus: Path):
    """Same base, same adapter init (tessel's A copied into peft; B zero in both), same
    batches: tessel's LoRA steps and peft + torch.optim.AdamW give the same losses."""
    src = save_hf(hf_llama(), tmp_path / "hf", corpus)
    cfg = load_config(None, lora_overrides(src, tmp_path / "run", corpus))
    trainer = Trainer(cfg, console=False)
    ours = trainer.model.inner[0]
    data = build_data(trainer.cfg, 0, 1, console=lambda _: None)  # the same batches again

    peft_model = get_peft_model(LlamaForCausalLM.from_pretrained(src), PeftLoraConfig(
        r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ALL))
    theirs = dict(peft_model.named_parameters())
    m = cfg.model
    with torch.no_grad():
        for name, p in ours.named_parameters():
            if not p.requires_grad:
                continue
            _, i, rest = name.split(".", 2)
            path, _, kind = rest.removesuffix(".weight").rpartition(".")
            part, short = path.split(".")
            hf = (f"base_model.model.model.layers.{i}."
                  f"{'self_attn' if part == 'attention' else 'mlp'}.{TESSEL_TO_HF[short]}."
                  f"{kind}.default.weight")
            value = p.detach()
            if kind == "lora_B" and short in ("wq", "wk"):  # B's rows: HF's RoPE halves
                heads = "n_heads" if short == "wq" else "n_kv_heads"
                value = one_to_one([(name, "hf", heads)], m, False)["hf"](lambda _, v=value: v)
            theirs[hf].copy_(value)
    o = cfg.optim
    opt = torch.optim.AdamW([p for p in peft_model.parameters() if p.requires_grad], lr=o.lr,
                            betas=(o.beta1, o.beta2), eps=o.eps, weight_decay=o.weight_decay)
    mine, reference = [], []
    for _ in range(3):
        loss, _ = trainer.run_step()
        trainer.step += 1
        mine.append(loss.item())
        batch = data.train.next_batch()
        logits = peft_model(batch.inputs).logits
        ref = F.cross_entropy(logits.flatten(0, 1), batch.targets.flatten())
        ref.backward()
        opt.step()
        opt.zero_grad()
        reference.append(ref.item())
    trainer.close()
    assert mine == pytest.approx(reference, abs=1e-5)
    assert reference[-1] < reference[0]  # it learns


def test_checkpoints_hold_only_the_adapters_and_resume_exactly(trained, tmp_path: Path,
                                                               shared_corpus: Path):
    shared_src, run, cfg = trained
    corpus = shared_corpus
    src = Path(shutil.copytree(shared_src, tmp_path / "base"))  # replaced below
    ckpt = latest_checkpoint(run / "checkpoints")
    saved = read_full(ckpt, "model")
    assert saved and all(".lora_A." in k or ".lora_B." in k for k in saved)
    assert all(".lora_" in k for k in read_full(ckpt, "optim"))
    # (bytes on disk are dominated by DCP's per-tensor overhead at this size: count elements)
    base = sum(t.numel() for t in LlamaForCausalLM.from_pretrained(src).state_dict().values())
    assert sum(t.numel() for t in saved.values()) < base / 10

    # 2 steps, then a resume to 4, equals the 4 steps in one go (adapters, bit for bit).
    half = tmp_path / "half"
    Trainer(load_config(None, lora_overrides(src, half, corpus, **{"train.steps": 2})),
            console=False).train()
    out = tessel_here("train", "--resume", str(half), "--train.steps=4")
    assert out.returncode == 0, out.stderr
    resumed = read_full(latest_checkpoint(half / "checkpoints"), "model")
    assert saved.keys() == resumed.keys()
    assert all(torch.equal(saved[k], resumed[k]) for k in saved)
    losses = lambda r: [json.loads(line)["loss"] for line in  # noqa: E731
                        (r / "metrics.jsonl").read_text().splitlines() if '"loss"' in line]
    assert losses(half)[-2:] == losses(run)[-2:]

    # Another base under the same path: refused in one line, nothing written.
    torch.manual_seed(7)
    save_hf(hf_llama(), src)
    before = sorted(p.name for p in (half / "checkpoints").iterdir())
    out = tessel_here("train", "--resume", str(half), "--train.steps=6")
    assert_one_line_error(out, "adapters trained on another base model")
    assert sorted(p.name for p in (half / "checkpoints").iterdir()) == before


def test_lora_on_a_projection_that_does_not_exist_is_one_line(tmp_path: Path, corpus: Path):
    src = save_hf(hf_llama(), tmp_path / "hf", corpus)
    run = tmp_path / "run"
    args = ["train", f"--model.init_from={src}", f"--run.dir={run}", "--data.source=files",
            f"--data.paths=['{corpus}']", "--lora.enabled=true", "--train.steps=1"]
    assert_one_line_error(tessel_here(*args, "--lora.targets=['q_proj', 'qkv_proj']"),
                          "lora.targets: no projection named 'qkv_proj'")
    assert not run.exists()
    # A name tessel knows that this model lacks (GELU MLP: no w3) fails before any file too.
    out = tessel_here("train", "--model.preset=tiny", f"--run.dir={run}", "--data.source=synthetic",
                 "--lora.enabled=true", "--lora.targets=['up_proj']", "--train.steps=1")
    assert_one_line_error(out, "layers.0.feed_forward.w3 does not exist")
    assert not run.exists()


def _refused(capsys: pytest.CaptureFixture, argv: list[str], needle: str) -> str:
    """`tessel ARGV` in this process: exit code 2 and one line on stderr holding `needle`."""
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("tessel: error: ") and needle in err[0], err
    return err[0]


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and not p.is_symlink() and p.name != ".lock"}


def test_a_resume_that_changes_the_adapters_is_refused(trained, tmp_path: Path, capsys):
    """Other targets dropped adapters, another alpha rescaled them, another rank did not fit
    (issue 27, item 7): each is refused in one line, nothing written; the same projections
    by their other names are the same adapters."""
    _, shared_run, _ = trained
    run = Path(shutil.copytree(shared_run, tmp_path / "run", symlinks=True))
    before = _files(run)
    resume = ["train", "--resume", str(run), "--train.steps=6", "--quiet"]
    for change, needle in [("--lora.targets=['q_proj']", "lora.targets was"),
                           ("--lora.alpha=16", "lora.alpha was 8.0 in the run, now 16.0"),
                           ("--lora.rank=8", "lora.rank was 4 in the run, now 8"),
                           ("--lora.enabled=false", "lora.enabled was True in the run")]:
        line = _refused(capsys, [*resume, change], needle)
        assert "resume without changing it" in line
        assert _files(run) == before, change
    from tessel.config import Config, read_saved
    from tessel.train.resume import resume_point
    from tessel.train.run_dir import RunDir

    tessel_names = ["wq", "wk", "wv", "wo", "w1", "w3", "feed_forward.w2"]  # = ALL, reordered
    same = Config.from_dict(read_saved(run / "config.toml"),
                            [f"--lora.targets={json.dumps(tessel_names)}"])
    found = resume_point(RunDir(run), same, True, False, print)
    assert found is not None and found[0].name == "step_00000004"


def _as_if_trained_on(run: Path, base: Path) -> None:
    """Make `run` a run trained on the (identical) copy `base` of its base: config.toml and
    every checkpoint's record of the config name it (an edit of config.toml alone is refused
    by every reader of the run)."""
    config = run / "config.toml"
    config.write_text(re.sub(r'(?m)^init_from = ".*"$', f"init_from = {json.dumps(str(base))}",
                             config.read_text()))
    for state_file in (run / "checkpoints").glob("step_*/state.json"):
        state = json.loads(state_file.read_text())
        state["config"]["model"]["init_from"] = str(base)
        state.pop("state_sha256")  # (its checksum of itself)
        state_file.write_text(json.dumps(state))


def test_an_edited_lora_alpha_is_refused_by_every_reader(trained, tmp_path: Path, capsys):
    """lora.alpha changed in a run's config.toml after training: exports and consolidate
    merged with the new alpha (weights moved by up to 0.048) while `train --resume` refused
    it (round 3, item 11). Every reader checks config.toml against the checkpoint's record
    with the resume's check: one line naming the change, nothing written."""
    _, shared_run, _ = trained
    run = Path(shutil.copytree(shared_run, tmp_path / "run", symlinks=True))
    config = run / "config.toml"
    text = config.read_text()
    lora = text.index("[lora]")
    edited = text[:lora] + re.sub(r"(?m)^alpha = 8\.0$", "alpha = 16.0", text[lora:], count=1)
    assert edited != text
    config.write_text(edited)
    before = _files(run)
    needle = "lora.alpha was 8.0 in the run, now 16.0"
    out = tmp_path / "out"
    for argv in (["convert", "tessel-to-hf", str(run), str(out)],
                 ["convert", "tessel-to-hf", str(run), str(out), "--peft"],
                 ["convert", "tessel-to-hf", str(run / "checkpoints/step_00000002"), str(out)],
                 ["checkpoint", "consolidate", str(run), f"--output={out}.safetensors"],
                 ["generate", str(run), "--max-new-tokens=2"]):
        assert "was changed after checkpoint" in _refused(capsys, argv, needle), argv
    assert "cannot resume" in _refused(
        capsys, ["train", "--resume", str(run), "--train.steps=6", "--quiet"], needle)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]
    assert _files(run) == before


def test_a_changed_base_is_refused_by_exports_and_sampling(trained, tmp_path: Path, capsys):
    """The adapters' base is read from model.init_from again by every reader of a LoRA run:
    with other weights there, each refuses in one line (issue 27, item 7), as a resume does."""
    src, shared_run, _ = trained
    base = Path(shutil.copytree(src, tmp_path / "base"))
    run = Path(shutil.copytree(shared_run, tmp_path / "run", symlinks=True))
    _as_if_trained_on(run, base)
    assert main(["convert", "tessel-to-hf", str(run), str(tmp_path / "ok"), "--peft"]) == 0
    torch.manual_seed(7)
    save_hf(hf_llama(), base)  # other weights under the same path
    needle = "holds adapters trained on another base model"
    out = tmp_path / "out"
    _refused(capsys, ["convert", "tessel-to-hf", str(run), str(out)], needle)
    _refused(capsys, ["convert", "tessel-to-hf", str(run), str(out), "--peft"], needle)
    _refused(capsys, ["convert", "tessel-to-hf", str(run / "checkpoints/step_00000002"),
                      str(out)], needle)
    _refused(capsys, ["generate", str(run), "--max-new-tokens=2"], needle)
    _refused(capsys, ["checkpoint", "consolidate", str(run), f"--output={out}.safetensors"],
             needle)
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("out")]


def test_consolidating_a_lora_run_writes_the_merged_model(trained, tmp_path: Path, capsys):
    """`tessel checkpoint consolidate` of a LoRA run wrote its adapters alone, which
    model.init_from and `convert` then read with a SafetensorError traceback (issue 27, item
    14): it writes the base with the adapters merged, a model like any other; adapters alone
    (a file written before, or the LoRA run itself) given as weights are one line."""
    src, run, cfg = trained
    ckpt = latest_checkpoint(run / "checkpoints")
    merged = tmp_path / "merged" / "model.safetensors"
    capsys.readouterr()
    assert main(["checkpoint", "consolidate", str(run), f"--output={merged}"]) == 0
    printed = capsys.readouterr().out
    x = torch.randint(0, VOCAB, (2, 40))
    with torch.no_grad():
        want = tessel_lora_model(src, ckpt, cfg)(x)[..., :VOCAB]  # (the rest: padding, -inf)
        got = tessel_model(merged)(x)[..., :VOCAB]  # as model.init_from reads it
    assert (got - want).abs().max() <= 1e-5
    assert not [k for k in load_file(merged) if ".lora_" in k]
    assert "LoRA adapters merged into the base" in printed and "--peft" in printed
    assert main(["convert", "tessel-to-hf", str(merged), str(tmp_path / "hf")]) == 0


def test_adapters_alone_given_as_weights_are_one_line(trained, tmp_path: Path, capsys):
    """What consolidate wrote of a LoRA run before (its adapters alone, as a tessel file),
    and the LoRA run itself, given as a model's weights: one line, nothing written, never a
    SafetensorError traceback (issue 27, item 14)."""
    _, run, cfg = trained
    ckpt = latest_checkpoint(run / "checkpoints")
    adapters = tmp_path / "adapters.safetensors"
    model_config = json.dumps(cfg.model.model_dump())
    save_file(read_full(ckpt, "model"), str(adapters),
              metadata={"format": "tessel", "step": "4", "model_config": model_config})
    needle = "holds LoRA adapters only"
    _refused(capsys, ["convert", "tessel-to-hf", str(adapters), str(tmp_path / "out")], needle)
    assert not (tmp_path / "out").exists()
    for weights in (adapters, run):  # as the base of a new run: before anything is written
        new_run = tmp_path / "new-run"
        _refused(capsys, ["train", f"--model.init_from={weights}", f"--run.dir={new_run}",
                          "--data.source=synthetic", "--train.steps=1", "--quiet"], needle)
        assert not new_run.exists()
