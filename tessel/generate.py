"""Sampling from a trained model: greedy (temperature 0) or temperature + top-k."""

from __future__ import annotations

from pathlib import Path

import torch

from tessel.checkpoint import CheckpointError, find_checkpoint, load_model
from tessel.checkpoint.errors import check_finite
from tessel.checkpoint.run_config import run_config
from tessel.config import Config, ConfigError, ModelConfig, read_saved
from tessel.config.load import validate
from tessel.data.chat_template import ChatTemplate, resolve_template
from tessel.data.tokenizer import Tokenizer, load_tokenizer
from tessel.models import Transformer, build_model


@torch.no_grad()
def sample(
    model: Transformer,
    prompt_ids: list[int],
    max_new_tokens: int,
    temperature: float = 0.8,
    top_k: int | None = 50,
    seed: int = 0,
    stop_id: int | None = None,
) -> list[int]:
    """Continue `prompt_ids`; returns only the new ids. The context is cropped to the
    model's max_seq_len (no KV cache: sampling is for inspection, not serving)."""
    model.eval()
    device = next(model.parameters()).device
    # An empty prompt starts a fresh document: condition on the end-of-document token.
    if not prompt_ids:
        if stop_id is None:
            raise ValueError("an empty prompt needs stop_id (the end-of-document token)")
        prompt_ids = [stop_id]
    gen = torch.Generator(device="cpu").manual_seed(seed)
    ids = torch.tensor([prompt_ids], dtype=torch.long, device=device)
    out: list[int] = []
    for _ in range(max_new_tokens):
        logits = model(ids[:, -model.cfg.max_seq_len :])[0, -1].float().cpu()  # (vocab,)
        if temperature == 0:
            nxt = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            nxt = int(torch.multinomial(torch.softmax(logits, -1), 1, generator=gen))
        if nxt == stop_id:
            break
        out.append(nxt)
        ids = torch.cat([ids, torch.tensor([[nxt]], device=device)], dim=1)
    return out


def load_run_for_inference(run_dir: str | Path, device: str = "cpu") -> tuple[Transformer, Tokenizer]:
    """The model of the run's latest checkpoint (or of a checkpoint directory) and the run's
    tokenizer; or of a model directory: `tessel convert hf-to-tessel` output or a Hugging Face
    model directory (read as `model.init_from` reads them)."""
    path = Path(run_dir)
    ckpt = find_checkpoint(path)
    if ckpt is None and ((path / "config.json").is_file() or
                         (path / "model.safetensors").is_file()):
        return _load_model_dir(path, device)
    if (path / "state.json").is_file():  # a checkpoint directory itself
        run = path.parent.parent
    else:
        run = path
        if not (path / "config.toml").is_file():
            raise ConfigError(f"{str(path)!r} is not a tessel run directory (no config.toml)")
    if ckpt is None:
        raise CheckpointError(f"run {str(path)!r} has no complete checkpoint yet")
    cfg = run_config(ckpt)  # config.toml, as the checkpoint recorded it
    if cfg.lora.enabled:  # the checkpoint holds adapters only: merge them into the base
        from tessel.checkpoint.lora import MergedSource
        from tessel.models.init import materialise

        with torch.device("meta"):
            model = Transformer(cfg.model)
        materialise(model, torch.device(device), cfg.train.seed,
                    MergedSource(cfg, ckpt, cfg.model).get)
        model.eval()
    else:
        model = build_model(cfg.model, device)
        load_model(ckpt, model)
        for name, tensor in model.state_dict().items():  # (LoRA: checked as MergedSource reads)
            check_finite(tensor, name, repr(str(ckpt)))
    return model, load_tokenizer(run / "tokenizer.json", cfg.data.eod_token)


def _load_model_dir(path: Path, device: str) -> tuple[Transformer, Tokenizer]:
    from tessel.checkpoint.init_from import WeightSource, model_fields_of
    from tessel.models.init import materialise

    # The model as its weights describe it, nothing else: a training config's defaults (e.g.
    # train.seq_len 256 for a model of a shorter context) have no say in sampling.
    m = validate(ModelConfig, {"preset": None, **model_fields_of(path)})
    source = WeightSource(path, m)
    if not source.tokenizer.is_file():
        raise ConfigError(f"{str(path)!r} holds a model but no tokenizer.json; sampling needs "
                          "the tokenizer it was trained with beside it")
    with torch.device("meta"):
        model = Transformer(m)
    materialise(model, torch.device(device), 0, source.get, source.buffer)
    return model.eval(), load_tokenizer(source.tokenizer, source.eod_token)


def chat_template_for(path: str | Path, spec: str | None, tok: Tokenizer) -> ChatTemplate:
    """The chat template `tessel generate --chat` applies for the run, checkpoint or model
    directory `path`: `spec` when given, else the one the model was fine-tuned with (saved
    beside the run's or the export's tokenizer), else the run's `data.chat_template`; "auto"
    finds the model's own beside its tokenizer files (the run's `data.tokenizer`, or the
    model directory itself), else ChatML."""
    from tessel.data.chat_files import saved_template

    path = Path(path)
    run = path.parent.parent if (path / "state.json").is_file() else path
    eod = str(tok.hf.id_to_token(tok.eod_id))
    trained = saved_template(run, eod) if spec is None else None
    if trained is not None:
        return trained
    configured, directory = "auto", path if (path / "tokenizer.json").is_file() else None
    if (run / "config.toml").is_file():
        d = Config.from_dict(read_saved(run / "config.toml")).data
        configured = d.chat_template
        given = Path(d.tokenizer)
        directory = given.parent if given.is_file() else None
    return resolve_template(spec or configured, directory, eod)


def chat_prompt(template: ChatTemplate, tok: Tokenizer, prompt: str) -> tuple[list[int], str, int]:
    """(ids of the one-user-message conversation with the generation prompt, the text that
    ends an assistant turn, the id to stop at): the id of that end text when it is one
    token, else the end-of-document id (the caller then cuts the text at the end text)."""
    from tessel.data.sft import assistant_spans, chat_encoder

    encoder = chat_encoder(tok)
    text = template.render([{"role": "user", "content": prompt}], add_generation_prompt=True)
    ids = encoder.encode(text, add_special_tokens=False).ids
    # What follows a reply: render one and look past its content.
    probe = [{"role": "user", "content": "x"}, {"role": "assistant", "content": "Y"}]
    full, spans = assistant_spans(template, probe)
    turn = full[spans[-1][0]:spans[-1][1]]
    end = turn[turn.rfind("Y") + 1:]
    end_ids = encoder.encode(end, add_special_tokens=False).ids if end else []
    return ids, end, end_ids[0] if len(end_ids) == 1 else tok.eod_id
