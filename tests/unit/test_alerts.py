"""Alert rules, spike detection and the watchdog's verdict, each on hand-made numbers."""

from __future__ import annotations

import math
import time

import pytest

from tessel.config import AlertConfig, RecoveryConfig
from tessel.errors import TesselError
from tessel.observe.alerts import AlertRules
from tessel.observe.watchdog import Watchdog
from tessel.train.faults import Fault, Faults, parse_faults
from tessel.train.recovery import SpikeDetector


def rule(**kw) -> AlertConfig:
    return AlertConfig(name=kw.pop("name", "r"), **kw)


def test_no_improvement_fires_after_patience_and_rearms():
    rules = AlertRules([rule(when="val_loss.no_improvement", patience=2, min_delta=0.1)])
    vals = [3.0, 2.95, 2.92, 2.5, 2.45, 2.46, 2.44]
    fired = [bool(rules.observe({"step": i, "val_loss": v})) for i, v in enumerate(vals)]
    # 2.95 and 2.92 do not beat 3.0 by 0.1 -> fires at the second; 2.5 is a new best; then
    # 2.45, 2.46 do not beat it by 0.1 -> fires; the counter restarts.
    assert fired == [False, False, True, False, False, True, False]


def test_threshold_rules_fire_once_per_episode():
    rules = AlertRules([rule(when="grad_norm.above", threshold=5.0)])
    seq = [1.0, 6.0, 7.0, 2.0, 9.0]
    assert [bool(rules.observe({"step": i, "grad_norm": g})) for i, g in enumerate(seq)] == \
        [False, True, False, False, True]


def test_exposed_communication_rules_judge_the_sampled_log_steps():
    rules = AlertRules([rule(name="comm", when="comm_exposed_share.above", threshold=0.3),
                        rule(name="wait", when="time_comm_exposed_s.above", threshold=0.5)])
    recs = [{"step": 1, "comm_exposed_share": 0.1, "time_comm_exposed_s": 0.05},
            {"step": 2},  # not sampled: neither rule judges it (nor re-arms)
            {"step": 3, "comm_exposed_share": 0.45, "time_comm_exposed_s": 0.6},
            {"step": 4},
            {"step": 5, "comm_exposed_share": 0.5, "time_comm_exposed_s": 0.4}]
    fired = [[f.rule.name for f in rules.observe(r)] for r in recs]
    assert fired == [[], [], ["comm", "wait"], [], []]  # once per episode
    (f,) = rules.observe({"step": 6, "comm_exposed_share": 0.2, "time_comm_exposed_s": 0.7})
    assert f.message == "time_comm_exposed_s 0.7 above 0.5"


def test_nan_rule_and_strings_from_jsonl():
    rules = AlertRules([rule(when="nan")])
    assert not rules.observe({"step": 1, "loss": 2.0, "grad_norm": 1.0})
    (f,) = rules.observe({"step": 2, "loss": "nan", "grad_norm": 1.0})
    assert f.message == "loss not finite" and f.values == {"loss": None}


def test_throughput_drop_against_the_moving_median():
    rules = AlertRules([rule(when="tokens_per_s.drop", fraction=0.5, window=6)])
    seq = [1000, 1010, 990, 1005, 400, 420, 1000, 300]
    fired = [bool(rules.observe({"step": i, "tokens_per_s": v})) for i, v in enumerate(seq)]
    assert fired == [False, False, False, False, True, False, False, True]


def test_stall_rule_fires_once_until_progress():
    rules = AlertRules([rule(when="step_time.stall", threshold=10.0)])
    assert not rules.stalled(5.0, 3)
    assert rules.stalled(11.0, 3) and not rules.stalled(20.0, 3)
    rules.progressed()
    assert rules.stalled(12.0, 4)


def test_rule_state_survives_a_checkpoint():
    a = AlertRules([rule(when="loss.no_improvement", patience=3)])
    for i, v in enumerate([2.0, 2.1, 2.2]):
        a.observe({"step": i, "loss": v})
    b = AlertRules([rule(when="loss.no_improvement", patience=3)])
    b.load_state_dict(a.state_dict())
    assert b.observe({"step": 3, "loss": 2.05})  # third without improvement


@pytest.mark.parametrize("bad", [{"when": "loss.above"}, {"when": "step_time.stall", "threshold": 5.0,
                                                            "action": "pause"}])
def test_rules_that_cannot_work_are_refused(bad):
    with pytest.raises(ValueError):
        rule(**bad)


@pytest.mark.parametrize(("alert", "metrics", "needle"), [
    ({"when": "comm_exposed_share.above", "threshold": 1.5}, {},
     "comm_exposed_share is a share of the step (0 to 1), so threshold=1.5 can never be passed"),
    ({"when": "comm_exposed_share.above", "threshold": 1}, {}, "threshold=1 can never be passed"),
    ({"when": "comm_exposed_share.above", "threshold": 0.3}, {"comm_sample_interval": 0},
     "can never fire with metrics.comm_sample_interval = 0"),
    ({"when": "time_comm_exposed_s.above", "threshold": 2.0}, {"comm_sample_interval": 0},
     "set metrics.comm_sample_interval (e.g. 20) or drop the rule"),
])
def test_alert_rules_that_can_never_fire_are_refused_by_the_config(alert, metrics, needle):
    from tessel.bench import bench_config
    from tessel.config import Config, ConfigError

    with pytest.raises(ConfigError) as err:
        Config.from_dict({"alerts": [{"name": "comm", **alert}], "metrics": metrics})
    assert needle in str(err.value) and "\n" not in str(err.value)
    # what can fire is kept; `tessel bench` profiles no step, so it drops the comm rules
    ok = Config.from_dict({"alerts": [{"name": "comm", **alert, "threshold": 0.9},
                                      {"name": "loss", "when": "loss.above", "threshold": 9.0}]})
    assert [a.name for a in ok.alerts] == ["comm", "loss"]
    assert [a.name for a in bench_config(ok, "bench").alerts] == ["loss"]


def test_spike_detector_judges_against_the_window():
    d = SpikeDetector(RecoveryConfig(spike_sigma=6.0, min_history=3, window=5))
    for v in (3.0, 2.9, 3.1):
        assert d.judge(v, 1.0) is None
    assert "sigma above" in d.judge(9.0, 1.0)
    assert d.judge(3.05, 1.0) is None  # the spike did not join the window
    assert "not finite" in d.judge(math.nan, 1.0)
    assert "grad norm" in d.judge(3.0, 50.0)


def test_fault_specs():
    assert parse_faults("spike:batch=3:scale=10;kill:rank=1:step=2")[0].scale == 10.0
    f = Faults(rank=0, spec="spike:batch=3:scale=10;nan:batch=4")
    assert f.loss_factor(3) == 10.0 and math.isnan(f.loss_factor(4)) and f.loss_factor(5) == 1.0
    assert parse_faults("killsync:step=3") == [Fault("killsync", step=3)]
    with pytest.raises(TesselError, match="unknown fault"):
        parse_faults("explode:step=1")
    with pytest.raises(TesselError, match="bad value"):
        parse_faults("slow:seconds=fast")
    slow = Faults(rank=1, spec="slow:seconds=0.05")
    t0 = time.perf_counter()
    slow.at_step(1)
    slow.at_step(2)
    assert time.perf_counter() - t0 >= 0.1  # every step, not one
    later = Faults(rank=0, spec="slow:step=3:seconds=0.2")
    t0 = time.perf_counter()
    later.at_step(1)
    later.at_step(2)
    assert time.perf_counter() - t0 < 0.2  # not before step 3 ...
    later.at_step(3)
    later.at_step(4)
    assert time.perf_counter() - t0 >= 0.4  # ... and every step from it on


def test_watchdog_names_the_rank_that_is_not_in_a_collective(tmp_path):
    w = Watchdog(30, tmp_path / "watchdog", rank=0, world_size=3)
    ranks = [
        {"rank": 0, "step": 7, "phase": "collective: all-reduce of the stop flags", "in_collective": True,
         "idle_s": 31.0},
        {"rank": 1, "step": 7, "phase": "data", "in_collective": False, "idle_s": 31.0},
        {"rank": 2, "missing": True},
    ]
    msg = w._summary(ranks)
    assert "stuck: rank 1 (step 7, in data)" in msg
    assert "waiting for it in a collective: rank(s) 0" in msg
    assert "no report from rank(s) 2" in msg
