"""`tessel generate`: sample text from a trained run or a model directory."""

from __future__ import annotations

import math

from tessel.cli.args import Parser
from tessel.errors import TesselError


def build_parser() -> Parser:
    p = Parser(prog="tessel generate", description="Sample text from a trained run or a model.")
    p.add_argument("run_dir", metavar="RUN_DIR|CHECKPOINT_DIR|MODEL_DIR",
                   help="run directory (its latest checkpoint), a checkpoint dir, a `tessel "
                        "convert hf-to-tessel` output or a Hugging Face model directory")
    p.add_argument("--prompt", default="", metavar="TEXT", help="text to continue (default: empty)")
    p.add_argument("--max-new-tokens", type=int, default=100, metavar="N", help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, metavar="T",
                   help="0 is greedy decoding")
    p.add_argument("--top-k", type=int, default=50, metavar="K",
                   help="sample among the k most likely (0: all)")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="sampling seed")
    p.add_argument("--chat", action="store_true",
                   help="apply the chat template: the prompt is one user message and the model "
                        "writes the assistant's reply (printed alone, up to its end of turn)")
    p.add_argument("--chat-template", default=None, metavar="SPEC",
                   help="with --chat: auto (the model's own), chatml, plain or a .jinja file "
                        "(default: the run's data.chat_template)")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto (CUDA when present), cpu or cuda")
    return p


def cmd_generate(argv: list[str]) -> int:
    args = build_parser().parse_args(argv)
    if args.max_new_tokens <= 0:
        raise TesselError("--max-new-tokens must be positive")
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise TesselError("--temperature must be >= 0 (0 is greedy decoding)")
    if args.top_k < 0:
        raise TesselError("--top-k must be >= 0 (0 disables top-k)")

    from tessel.generate import load_run_for_inference, sample
    from tessel.train.device import pick_device

    if args.chat_template is not None and not args.chat:
        raise TesselError("--chat-template applies with --chat only")
    model, tok = load_run_for_inference(args.run_dir, pick_device(args.device))
    if args.chat:
        from tessel.generate import chat_prompt, chat_template_for

        template = chat_template_for(args.run_dir, args.chat_template, tok)
        prompt_ids, end, stop_id = chat_prompt(template, tok, args.prompt)
        ids = sample(model, prompt_ids, args.max_new_tokens, args.temperature,
                     args.top_k or None, args.seed, stop_id=stop_id)
        reply = tok.hf.decode(ids, skip_special_tokens=False)
        print(reply.split(end, 1)[0] if end else reply)  # the reply up to its end of turn
        return 0
    ids = sample(model, tok.encode(args.prompt), args.max_new_tokens, args.temperature,
                 args.top_k or None, args.seed, stop_id=tok.eod_id)
    print(args.prompt + tok.decode(ids))
    return 0
