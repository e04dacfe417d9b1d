"""`tessel convert`: models between tessel and the Hugging Face format."""

from __future__ import annotations

from tessel.cli.args import Parser


def build_parser() -> Parser:
    p = Parser(prog="tessel convert", description="Convert models between tessel and the "
               "Hugging Face format\n(GPT2LMHeadModel, LlamaForCausalLM, MixtralForCausalLM, "
               "Qwen3MoeForCausalLM).")
    sub = p.add_subparsers(dest="direction", required=True, metavar="{hf-to-tessel,tessel-to-hf}")
    a = sub.add_parser(
        "hf-to-tessel", help="an HF model directory -> tessel weights, config and tokenizer",
        description="Convert a Hugging Face model directory (config.json, safetensors, "
                    "tokenizer.json)\ninto OUT_DIR: model.safetensors in tessel's names, a "
                    "config.toml that fine-tunes\nfrom it (model.init_from), tokenizer.json.")
    a.add_argument("source", metavar="HF_DIR",
                   help="a GPT-2, Llama, Mixtral or Qwen3-MoE model directory of Hugging Face")
    a.add_argument("output", metavar="OUT_DIR", help="directory to write")
    a.add_argument("--eod-token", default="auto", metavar="TOKEN",
                   help="the token that ends documents (data.eod_token) when the tokenizer "
                        "has no <|endoftext|>, </s>, ... (default: the EOS or pad token the "
                        "model's config.json, generation_config.json or tokenizer_config.json "
                        "names)")
    b = sub.add_parser(
        "tessel-to-hf", help="a run, checkpoint (any layout) or safetensors file -> HF directory",
        description="Write a Hugging Face model directory that transformers loads "
                    "(AutoModelForCausalLM,\nAutoTokenizer), reading the checkpoint tensor by "
                    "tensor whatever parallel layout\nsaved it. A LoRA run exports its "
                    "base with the adapters merged, or with\n--peft its adapters alone.")
    b.add_argument("source", metavar="RUN_DIR|CHECKPOINT|FILE",
                   help="a run directory (its latest checkpoint), a checkpoint, or a safetensors file")
    b.add_argument("output", metavar="HF_DIR", help="directory to write")
    b.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="weights' dtype in the export (default float32, as trained)")
    b.add_argument("--peft", action="store_true",
                   help="a LoRA run (lora.enabled): write its adapters as a peft adapter "
                        "directory (adapter_config.json, adapter_model.safetensors) instead "
                        "of the base with the adapters merged")
    b.add_argument("--max-shard-size", default="5GB", metavar="SIZE",
                   help="split the weights into files of at most this size (default 5GB)")
    b.add_argument("--drop-expert-bias", action="store_true",
                   help="an MoE model trained with a balancing bias (model.moe_bias_update_rate) "
                        "that changes routing: export it without the bias, which Mixtral and "
                        "Qwen3-MoE do not have (refused otherwise); the summary says how far "
                        "the logits move")
    return p


def cmd_convert(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)

    from pathlib import Path

    import torch

    from tessel.checkpoint.hf_convert import hf_to_tessel, parse_size, tessel_to_hf

    if args.direction == "hf-to-tessel":
        print(hf_to_tessel(Path(args.source), Path(args.output), args.eod_token))
    elif args.peft:
        from tessel.checkpoint.lora import export_peft

        print(export_peft(Path(args.source), Path(args.output)))
    else:
        dtype = torch.bfloat16 if args.dtype == "bfloat16" else None
        print(tessel_to_hf(Path(args.source), Path(args.output), dtype,
                           parse_size(args.max_shard_size), args.drop_expert_bias))
    return 0
