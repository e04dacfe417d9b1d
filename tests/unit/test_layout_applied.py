"""The planner checks a layout on the real config type: `Layout.applied` is the config a run
of the layout takes (as `with_overrides(layout.overrides())` validates it), and the
trainer's one layout check (`tessel.parallel.check.check_layout`) judges it."""

from __future__ import annotations

from tessel.config import Config
from tessel.planner.layout import Layout
from tessel.planner.search import trainer_refusal


def config(**overrides: object) -> Config:
    return Config.load(None, {"model.preset": "tiny", "train.seq_len": 64,
                              "train.global_batch_size": 16, "train.micro_batch_size": 1,
                              **overrides})


def test_applied_is_the_config_the_overrides_give():
    cfg = config()
    for layout in (Layout(1, 2, 2, 2, 1, 3, 2, "selective", pp_layers_first=1, pp_layers_last=1),
                   Layout(2, 1, 1, 1, 2, 1, 1, cp_mode="ulysses", cp_load_balance=False),
                   Layout(1, 4, 1, 1, 1, 3, 4, "full", "optimizer")):
        light = layout.applied(cfg)
        assert type(light) is Config
        full = cfg.with_overrides(layout.overrides())
        assert light.parallel == full.parallel.model_copy(update={"auto": False})
        assert light.train == full.train
        assert light.model is cfg.model and light.optim is cfg.optim
        assert Layout.from_config(light, layout.world) == layout


def test_applied_leaves_the_config_it_was_given_alone():
    cfg = config()
    before = cfg.to_dict()
    Layout(1, 2, 2, 1, 1, 3, 1).applied(cfg)
    assert cfg.to_dict() == before


def test_the_refusal_is_the_trainers_own_words():
    cfg = config()
    bad = Layout(1, 1, 3, 1, 1, 0, 8)  # tiny's heads do not split 3 ways
    light, full = trainer_refusal(cfg, bad), trainer_refusal(cfg, bad, full=True)
    assert light is not None and light == full
    assert trainer_refusal(cfg, Layout(1, 2, 1, 1, 1, 3, 4)) is None
    # The config's own combination rules, which a copy skips, are checked too.
    offload = Layout(2, 1, 1, 1, 1, 1, 4, offload="params")
    assert "needs parallel.zero=3" in trainer_refusal(cfg, offload)
