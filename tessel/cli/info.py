"""`tessel presets` (the named model shapes) and `tessel config` (the resolved config, or
the reference of every key)."""

from __future__ import annotations

from tessel.cli.args import Parser, add_config_arguments, parse_config_args
from tessel.errors import TesselError


def presets_parser() -> Parser:
    return Parser(prog="tessel presets",
                  description="List the named model shapes with their exact parameter counts.")


def cmd_presets(argv: list[str]) -> int:
    presets_parser().parse_args(argv)
    from tessel.config import ModelConfig
    from tessel.models import PRESETS, active_param_count, flops_per_token, param_count

    head = f"{'preset':<14} {'params':>17} {'active':>17} {'layers':>6} {'d_model':>7} " \
           f"{'heads':>5} {'kv':>3} {'ffn':>6} {'experts':<16} {'vocab':>6} {'ctx':>6}  " \
           f"{'style':<26} {'GFLOP/token':>11}"
    print(head)
    for name in PRESETS:
        m = ModelConfig(preset=name)
        style = "/".join([m.position, m.norm, m.mlp, "tied" if m.tie_embeddings else "untied"])
        gflop = flops_per_token(m, m.max_seq_len) / 1e9
        experts = "-"
        if m.moe_experts:  # routed x hidden, top-k, shared, MoE layers
            experts = (f"{m.moe_experts}x{m.moe_ffn_hidden} k{m.moe_top_k}"
                       + (f" +{m.moe_shared_experts}" if m.moe_shared_experts else ""))
        print(f"{name:<14} {param_count(m):>17,} {active_param_count(m):>17,} {m.n_layers:>6} "
              f"{m.d_model:>7} {m.n_heads:>5} {m.n_kv_heads:>3} {m.ffn_hidden:>6} {experts:<16} "
              f"{m.vocab_size:>6} {m.max_seq_len:>6}  {style:<26} {gflop:>11.3g}")
    print("active: the parameters one token uses (MoE: the router, top_k routed experts and the "
          "shared experts of each MoE layer); experts: routed x hidden, top-k, +shared")
    print("GFLOP/token: training FLOPs per token at the preset's full context "
          "(6 x active matmul params + 12 x layers x n_heads x head_dim x seq_len)")
    print("params and GFLOP/token count the embedding and head padded to a multiple of "
          "model.vocab_pad_to (128) rows: 50257 -> 50304")
    print("deepseek-v3 differs from the published model in attention (tessel has no MLA; "
          "see tessel/models/presets.py)")
    return 0


def config_parser() -> Parser:
    p = Parser(prog="tessel config", allow_abbrev=False,
               description="Print the resolved config as TOML (what `tessel train` would run "
                           "with), or with --reference\nevery key as Markdown.")
    add_config_arguments(p)
    p.add_argument("--reference", action="store_true",
                   help="print every config key with its type, default and meaning (Markdown)")
    return p


def cmd_config(argv: list[str]) -> int:
    args, overrides = parse_config_args(config_parser(), argv, refused={
        "--resume": "tessel config takes no --resume; pass RUN_DIR/config.toml instead"})
    if args.reference:
        if args.config is not None or overrides:
            raise TesselError("tessel config --reference takes no config file or overrides")
        from tessel.config import reference_markdown

        print(reference_markdown(), end="")
        return 0
    import tomli_w

    from tessel.checkpoint.init_from import load_config
    from tessel.observe.secrets import redact_config

    cfg = load_config(args.config, overrides).to_dict()
    shown = redact_config(cfg)
    if shown != cfg:  # never print a secret; say so, so nobody trains on the printed copy
        print("# secrets are redacted below (webhook paths, passwords, tokens); keep them in\n"
              "# your own config file, or give them as env:NAME references")
    print(tomli_w.dumps(shown), end="")
    return 0
