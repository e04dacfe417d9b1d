"""The suite's time budgets (tests/conftest.py): scaled with the machine, waits not."""

from conftest import over_budget


def test_waits_are_added_on_any_machine_and_the_rest_scales():
    budgets = {"hung": (28.0, 30.0), "plain": (70.0, 0.0)}
    # at machine factor 0.5: hung's budget is 14 + 30 = 44 s, plain's 35 s, the default's 10 s
    durations = {"hung": 40.0, "plain": 40.0, "unmarked": 11.0}
    assert over_budget(durations, budgets, 0.5) == [(40.0, "plain", 35.0), (11.0, "unmarked", 10.0)]
    # on the reference machine nothing is over; a hung rank taking 60 s is, by 2 s
    assert over_budget(durations, budgets, 1.0) == []
    assert over_budget({"hung": 60.0}, budgets, 1.0) == [(60.0, "hung", 58.0)]
