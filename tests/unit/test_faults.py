"""TESSEL_FAULT's grammar (tessel/train/faults.py): a fire drill that could never fire, or
would fail inside the run, is refused in one line before the run starts."""

from __future__ import annotations

import pytest

from tessel.errors import TesselError
from tessel.train.faults import Fault, Faults, check_faults, parse_faults


@pytest.mark.parametrize(("spec", "needle"), [
    ("kill:rank=1", "'kill:rank=1' does nothing without step="),
    ("hang:rank=0", "does nothing without step="),
    ("killsync:rank=0", "does nothing without step="),
    ("nan", "'nan' does nothing without batch="),
    ("spike:batch=3", "does nothing without scale="),
    ("spike:batch=3:scale=1", "scale=1 leaves the loss as it is"),
    ("slow", "does nothing without seconds="),
    ("netdelay:rank=1", "does nothing without seconds="),
    ("slow:seconds=-1", "seconds must be a number above 0"),
    ("slow:seconds=0", "seconds must be a number above 0"),
    ("slow:seconds=nan", "seconds must be a number above 0"),
    ("netdelay:seconds=inf", "seconds must be a number above 0"),
    ("netdelay:seconds=-0.05", "seconds must be a number above 0"),
    ("slow:seconds=1e12", "at most 86400 (a day)"),
    ("spike:batch=3:scale=nan", "scale must be a number >= 0"),
    ("spike:batch=3:scale=-inf", "scale must be a number >= 0"),
    ("kill:rank=-1:step=2", "rank must be a whole number >= 0"),
    ("kill:step=2.5", "step must be a whole number >= 0"),
    ("nan:batch=x", "batch must be a whole number >= 0"),
    ("kill:step=2:step=3", "kill takes step= [rank=], each once"),
    ("spike:rank=1:batch=3:scale=10", "bad field 'rank=1'"),  # the loss of every rank
    ("netdelay:seconds=0.1:step=2", "bad field 'step=2'"),  # from the first step on
    ("nan:batch=3:seconds=1", "bad field 'seconds=1'"),
    ("slow:seconds", "bad field 'seconds'"),
    ("explode:step=1", "unknown fault 'explode'"),
    ("slow:seconds=0.1;kill:rank=1", "'kill:rank=1' does nothing without step="),
])
def test_a_fault_that_cannot_fire_is_refused(spec, needle):
    with pytest.raises(TesselError, match="^TESSEL_FAULT: ") as err:
        parse_faults(spec)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_ranks_and_steps_the_run_does_not_have_are_refused(monkeypatch):
    with pytest.raises(TesselError, match=r"names rank 5, but the run has 2 processes \(ranks 0 to 1\)"):
        parse_faults("netdelay:seconds=0.1:rank=5", world_size=2)
    with pytest.raises(TesselError, match="names rank 1, but the run has 1 process "):
        Faults(0, "kill:rank=1:step=2", world_size=1)
    with pytest.raises(TesselError, match="never fires: .* train.steps=10; use a step below 10"):
        Faults(0, "hang:step=10", world_size=1, steps=10)
    monkeypatch.setenv("TESSEL_FAULT", "slow:seconds=0.1:rank=2")
    with pytest.raises(TesselError, match="names rank 2"):
        check_faults(2, steps=10)  # `tessel train --nproc 2`, before torchrun starts
    check_faults(3, steps=10)
    # A restarted elastic job may have fewer processes; `kill` fires in the first attempt only.
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    assert Faults(0, "kill:rank=3:step=2", world_size=2).faults == [Fault("kill", rank=3, step=2)]


def test_every_kind_in_its_documented_form_is_accepted():
    spec = ("spike:batch=7:scale=1000;nan:batch=7;kill:rank=1:step=5;hang:rank=1:step=3;"
            "term:rank=0:step=2;killsync:step=3;slow:seconds=0.1:step=2;"
            "netdelay:seconds=0.05:rank=1;spike:batch=2:scale=0")
    faults = parse_faults(spec, world_size=2, steps=6)
    assert [f.kind for f in faults] == ["spike", "nan", "kill", "hang", "term", "killsync",
                                        "slow", "netdelay", "spike"]
    assert faults[6] == Fault("slow", step=2, seconds=0.1)


def test_term_sends_this_process_sigterm_at_its_step_only(monkeypatch):
    import signal

    got: list[int] = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: got.append(signum))
    try:
        faults = Faults(0, "term:step=2;term:rank=1:step=1", world_size=2)
        for step in range(4):
            faults.at_step(step)
        assert got == [signal.SIGTERM]  # step 2, this rank; rank 1's is not ours
        monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")  # a restarted job: no more
        Faults(0, "term:step=2").at_step(2)
        assert got == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_slow_for_the_first_attempts_counts_torchrun_restarts_and_slurm_requeues(monkeypatch):
    """`attempts=N` slows the job's first N attempts only; a requeued SLURM job (which starts
    torchrun afresh, at restart 0) is a later attempt, as a torchrun restart is."""
    slept: list[float] = []
    monkeypatch.setattr("tessel.train.faults.time.sleep", slept.append)
    for env, expect in (({}, [0.5]), ({"SLURM_RESTART_COUNT": "1"}, []),
                        ({"TORCHELASTIC_RESTART_COUNT": "1"}, []),
                        ({"SLURM_RESTART_COUNT": "0", "TORCHELASTIC_RESTART_COUNT": "0"}, [0.5])):
        for name in ("SLURM_RESTART_COUNT", "TORCHELASTIC_RESTART_COUNT"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        slept.clear()
        Faults(0, "slow:seconds=0.5:attempts=1").at_step(3)
        assert slept == expect, env
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    slept.clear()
    Faults(0, "slow:seconds=0.5:attempts=2").at_step(3)  # the second attempt: still slowed
    Faults(0, "slow:seconds=0.25").at_step(3)  # no attempts=: every attempt
    assert slept == [0.5, 0.25]
    with pytest.raises(TesselError, match="never fires: attempts=N slows the job's first N"):
        parse_faults("slow:seconds=0.1:attempts=0")
    with pytest.raises(TesselError, match="bad field 'attempts=1'"):
        parse_faults("netdelay:seconds=0.1:attempts=1")


def test_a_requeued_slurm_job_does_not_kill_or_signal_itself_again(monkeypatch):
    import signal

    got: list[int] = []
    monkeypatch.setattr("tessel.train.faults.os.kill", lambda pid, sig: got.append(sig))
    monkeypatch.delenv("TORCHELASTIC_RESTART_COUNT", raising=False)
    monkeypatch.setenv("SLURM_RESTART_COUNT", "2")
    Faults(0, "kill:step=2;term:step=2").at_step(2)
    assert got == []
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    Faults(0, "kill:step=2;term:step=2").at_step(2)
    assert got == [signal.SIGKILL, signal.SIGTERM]
