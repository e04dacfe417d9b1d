"""[fault_tolerance]: the section's checks, the layouts the mode refuses (one line, exit 2),
the replicas.* alert rules and report line, and one replica group against torchft's real
Lighthouse in this process (the whole path, no mocks): it trains exactly as the mode off does,
and a quorum that never forms ends in one line (exit 3). Three groups, one killed and
recovering from a peer: tests/distributed/test_fault_tolerance.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from tessel.cli import main
from tessel.config import AlertConfig, ConfigError
from tessel.errors import CollectiveTimeout, TesselError
from tessel.observe.alerts import AlertRules
from tessel.observe.metrics import read_metrics
from tessel.observe.report.run import read_run
from tessel.observe.report.summary import summary
from tessel.parallel.check import check_layout
from tessel.parallel.dims import ParallelDims, ParallelError
from tessel.parallel.replica_group import data_share
from tessel.train import Trainer
from tessel.train.replicas import MAX_DISCARDS

FT = {"fault_tolerance.enable": True, "fault_tolerance.group_size": 2,
      "fault_tolerance.lighthouse": "http://localhost:29510"}


@pytest.mark.parametrize(("fields", "says"), [
    ({"fault_tolerance.group_size": 0}, "fault_tolerance.enable needs fault_tolerance.group_size"),
    ({"fault_tolerance.replica_id": 2}, "fault_tolerance.replica_id=2 is not below "
                                        "fault_tolerance.group_size=2; number the groups 0 to 1"),
    ({"fault_tolerance.min_replica_size": 3}, "fault_tolerance.min_replica_size=3 exceeds "
                                              "fault_tolerance.group_size=2"),
])
def test_the_section_refuses_settings_that_cannot_work(tiny_config, fields, says):
    with pytest.raises(ConfigError, match=says):
        tiny_config(**{**FT, **fields})
    tiny_config(**{**fields, "fault_tolerance.enable": False})  # off: nothing is checked


@pytest.mark.parametrize(("world", "fields", "says"), [
    (2, {}, "runs each replica group as one process holding the whole model"),
    (1, {"recovery.spike_sigma": 3.0}, "does not combine with recovery.spike_sigma"),
    (1, {"fault_tolerance.group_size": 3},  # 16 sequences
     "train.global_batch_size=16 does not split over fault_tolerance.group_size=3 replica "
     "groups of micro-batches of 4; use a multiple of 12"),
    (1, {"fault_tolerance.lighthouse": ""}, "needs the torchft Lighthouse's address"),
])
def test_layouts_the_mode_cannot_run_are_refused_in_one_line(tiny_config, monkeypatch, world,
                                                             fields, says):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    cfg = tiny_config(**{**FT, "train.global_batch_size": 16, **fields})
    dims = ParallelDims.from_config(cfg.parallel, world)
    with pytest.raises(ParallelError, match=says) as info:
        check_layout(cfg, dims, "cpu", "fp32")
    assert "\n" not in str(info.value)
    cfg_off = cfg.with_overrides({"fault_tolerance.enable": False})
    if world == 1 and "recovery" not in str(fields) and "lighthouse" not in str(fields):
        check_layout(cfg_off, dims, "cpu", "fp32")  # the same layout without the mode runs


@pytest.mark.parametrize("address", ["not a url", "localhost:29510", "http://host",
                                     "ftp://host:29510", "http://:29510", "http://host:port"])
def test_a_lighthouse_address_that_is_no_address_is_refused_when_read(tiny_config, monkeypatch,
                                                                       address):
    """It waited timeout_s for a quorum and exited 3, as a Lighthouse that died does."""
    with pytest.raises(ConfigError, match="is not a Lighthouse address: give http://HOST:PORT"):
        tiny_config(**{**FT, "fault_tolerance.lighthouse": address})
    monkeypatch.setenv("TORCHFT_LIGHTHOUSE", address)  # the environment's, when the key is empty
    cfg = tiny_config(**{**FT, "fault_tolerance.lighthouse": ""})
    with pytest.raises(ParallelError, match="TORCHFT_LIGHTHOUSE .* is not a Lighthouse address"):
        check_layout(cfg, ParallelDims.from_config(cfg.parallel, 1), "cpu", "fp32")
    tiny_config(**{**FT, "fault_tolerance.lighthouse": "https://10.0.0.5:29510"})  # taken


def test_fp16_loss_scaling_is_refused(tiny_config):
    cfg = tiny_config(**FT)
    with pytest.raises(ParallelError, match="does not combine with fp16 loss scaling"):
        check_layout(cfg, ParallelDims.from_config(cfg.parallel, 1), "cpu", "fp16")


def test_without_torchft_the_mode_says_how_to_install_it(tmp_path, corpus, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "torchft" else real(name, *a))
    run = tmp_path / "run"
    code = main(["train", "--quiet", "--model.preset=tiny", "--data.source=files",
                 f"--data.paths=['{corpus}']", "--data.tokenizer=bytes", f"--run.dir={run}",
                 "--fault_tolerance.enable=true", "--fault_tolerance.group_size=2",
                 "--fault_tolerance.lighthouse='http://localhost:29510'",
                 "--train.micro_batch_size=4", "--train.global_batch_size=8"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "fault_tolerance.enable needs torchft, which is not installed: pip install " \
           "'tessel[ft]'" in err[0]
    assert not run.exists()  # nothing written


def test_each_group_takes_its_slice_of_every_global_batch(tiny_config):
    cfg = tiny_config(**{**FT, "fault_tolerance.replica_id": 1})
    assert data_share(cfg, 0, 1) == (1, 2)
    assert data_share(cfg.with_overrides({"fault_tolerance.enable": False}), 0, 1) == (0, 1)


def test_replica_rules_fire_on_their_events_only():
    rules = AlertRules([AlertConfig(name="lost", when="replicas.lost"),
                        AlertConfig(name="back", when="replicas.joined"),
                        AlertConfig(name="healed", when="replicas.healed")])
    lost = rules.replicas_changed("replicas_lost", 3, 2, step=7)
    assert [(f.rule.name, f.step, f.values) for f in lost] == [
        ("lost", 7, {"replicas": 2, "before": 3})]
    assert lost[0].message == "replica groups fell from 3 to 2"
    assert [f.rule.name for f in rules.replicas_changed("replicas_joined", 2, 3, 9)] == ["back"]
    healed = rules.replicas_changed("replica_healed", 3, 3, 9)
    assert [(f.rule.name, f.message) for f in healed] == [
        ("healed", "this replica group recovered from a peer at step 9")]
    assert AlertRules([AlertConfig(name="x", when="world_size.shrink")]).replicas_changed(
        "replicas_lost", 3, 2, 1) == []


def test_the_report_counts_lost_joined_and_healed_groups(tmp_path: Path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 2.0}) + "\n")
    events = [("start", 0), ("replicas_lost", 3), ("replicas_joined", 9), ("replicas_lost", 12),
              ("replica_healed", 12)]
    (tmp_path / "events.jsonl").write_text("".join(
        json.dumps({"time": 0, "step": s, "kind": k, "message": k}) + "\n" for k, s in events))
    rows = {key: value for key, _, value in summary(read_run(tmp_path))}
    assert rows["replica_changes"] == "2 lost, 1 joined, 1 recovered from a peer"
    (tmp_path / "events.jsonl").write_text("")
    assert "replica_changes" not in {key for key, _, _ in summary(read_run(tmp_path))}


# ---- one replica group against torchft's real Lighthouse, in this process --------------------


@pytest.fixture
def lighthouse():
    torchft = pytest.importorskip("torchft._torchft", reason="torchft is not installed")
    made = []

    def start(min_replicas: int) -> str:
        made.append(torchft.LighthouseServer(bind="[::]:0", min_replicas=min_replicas))
        return made[-1].address()

    yield start
    for server in made:
        server.shutdown()


def test_one_replica_group_trains_exactly_as_the_mode_off(tiny_config, lighthouse):
    plain = tiny_config("plain", **{"train.steps": 4})
    Trainer(plain, console=False).train()
    ft = {"fault_tolerance.enable": True, "fault_tolerance.group_size": 1,
          "fault_tolerance.lighthouse": lighthouse(1), "fault_tolerance.timeout_s": 20}
    cfg = tiny_config("ft", **{"train.steps": 4, **ft})
    trainer = Trainer(cfg, console=False)
    trainer.train()
    got = [r for r in read_metrics(Path(cfg.run.dir) / "metrics.jsonl") if "loss" in r]
    want = [r for r in read_metrics(Path(plain.run.dir) / "metrics.jsonl") if "loss" in r]
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in got] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in want]  # the mean over one group: bitwise
    assert {r["replicas"] for r in got} == {1} and all("replicas" not in r for r in want)


def test_a_quorum_that_never_forms_ends_in_one_line(tiny_config, lighthouse):
    cfg = tiny_config(**{"train.steps": 2, **FT, "fault_tolerance.lighthouse": lighthouse(2),
                         "fault_tolerance.timeout_s": 1})
    with pytest.raises(CollectiveTimeout) as info:
        Trainer(cfg, console=False).train()
    msg = str(info.value)
    assert "\n" not in msg and info.value.exit_code == 3
    assert msg.startswith("fault_tolerance: no quorum of replica groups within "
                          "fault_tolerance.timeout_s=1s (")
    assert "check that the Lighthouse at http://" in msg and "min_replica_size=1" in msg


def test_an_unreachable_lighthouse_is_one_line(tiny_config):
    pytest.importorskip("torchft")
    cfg = tiny_config(**{**FT, "fault_tolerance.lighthouse": "http://127.0.0.1:1",
                         "fault_tolerance.timeout_s": 1})
    with pytest.raises(CollectiveTimeout) as info:
        Trainer(cfg, console=False)
    msg = str(info.value)
    assert "\n" not in msg and msg.startswith("fault_tolerance: cannot reach the Lighthouse "
                                              "within fault_tolerance.timeout_s=1s (")
    assert "failed to connect to http://127.0.0.1:1" in msg
    assert "the Lighthouse at http://127.0.0.1:1 runs" in msg


def test_a_step_that_cannot_commit_is_discarded_and_its_data_taken_again(tiny_config, lighthouse,
                                                                         capsys):
    # One of two groups runs, and every step needs both (min_replica_size=2) while the
    # Lighthouse forms a quorum of one: torchft's commit says no at every step. Nothing may be
    # applied and the data position must not move; after MAX_DISCARDS the group stops.
    cfg = tiny_config(**{"train.steps": 3, **FT, "fault_tolerance.lighthouse": lighthouse(1),
                         "fault_tolerance.min_replica_size": 2, "fault_tolerance.timeout_s": 1})
    trainer = Trainer(cfg, console=True)
    fresh = trainer.data.train.state_dict()
    before = {k: v.clone() for k, v in trainer.model.inner[0].state_dict().items()}
    with pytest.raises(CollectiveTimeout) as info:
        trainer.train()
    assert str(info.value) == (
        f"fault_tolerance: step 1 was discarded {MAX_DISCARDS} times in a row (1 replica "
        "group(s) took part, min_replica_size=2): start the missing groups, and the Lighthouse "
        "with --min_replicas of at least 2 so that too few groups wait for more instead")
    out = capsys.readouterr().out
    assert out.count("tessel: fault tolerance: step 1 discarded (a replica group failed during "
                     "it); retrying it on the same data") == MAX_DISCARDS - 1
    assert trainer.step == 0 and trainer.batches_drawn == 0
    assert trainer.data.train.state_dict() == fresh
    after = trainer.model.inner[0].state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_peer_state_that_does_not_fit_is_one_line(tiny_config, lighthouse):
    cfg = tiny_config(**{**FT, "fault_tolerance.group_size": 1,
                         "fault_tolerance.lighthouse": lighthouse(1)})
    trainer = Trainer(cfg, console=False)
    try:
        state = trainer.replicas.state_dict()
        state["model"][0] = {k: v[:1] for k, v in state["model"][0].items()}  # another shape
        with pytest.raises(TesselError) as info:
            trainer.replicas.load_state_dict(state)
        msg = str(info.value)
        assert "\n" not in msg and msg.startswith("fault_tolerance: a peer's state does not "
                                                  "fit this replica group (")
        assert msg.endswith("; every group must run the same model, optimizer and data")
        trainer.replicas.load_state_dict(trainer.replicas.state_dict())  # its own: fits
    finally:
        trainer.replicas.close()


class _Payload:
    """What a hostile peer could send: unpickling it makes a directory (harmless code)."""

    def __init__(self, path: Path):
        self.path = path

    def __reduce__(self):
        import os

        return os.mkdir, (str(self.path),)


def test_a_peers_state_is_read_without_running_code(tiny_config, lighthouse, tmp_path: Path):
    from datetime import timedelta

    from torchft.checkpointing.http_transport import HTTPTransport

    from tessel.parallel.replica_group import weights_only_transport

    cfg = tiny_config(**{**FT, "fault_tolerance.group_size": 1,
                         "fault_tolerance.lighthouse": lighthouse(1)})
    trainer = Trainer(cfg, console=False)
    timeout = timedelta(seconds=30)
    sender, ours = HTTPTransport(timeout=timeout, num_chunks=0), weights_only_transport(timeout)
    try:
        # tessel's real state crosses whole through the weights-only reader ...
        state = trainer.replicas.state_dict()
        sender.send_checkpoint([1], 1, state, timeout)
        got = ours.recv_checkpoint(0, sender.metadata(), 1, timeout)
        assert got["trainer"] == state["trainer"]
        for a, b in zip(got["model"], state["model"], strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert got["optim"][0]["param_groups"] == state["optim"][0]["param_groups"]
        trainer.replicas.load_state_dict(got)
        # ... and a payload that runs code when unpickled is refused, where torchft's own
        # transport runs it.
        sender.send_checkpoint([1], 2, {"x": _Payload(tmp_path / "ran")}, timeout)
        with pytest.raises(Exception, match="unsupported GLOBAL posix.mkdir"):
            ours.recv_checkpoint(0, sender.metadata(), 2, timeout)
        assert not (tmp_path / "ran").exists()
        HTTPTransport(timeout=timeout, num_chunks=0).recv_checkpoint(0, sender.metadata(), 2,
                                                                     timeout)
        assert (tmp_path / "ran").is_dir()
    finally:
        sender.shutdown(wait=False)
        ours.shutdown(wait=False)
        trainer.replicas.close()


def test_every_group_evaluates_the_single_process_validation_batches(tiny_config, lighthouse):
    # Each group trains on its own share of every global batch, but its val_loss is the
    # single-process figure (the split's first eval_iters micro-batches): groups with equal
    # weights log the same value.
    want = Trainer(tiny_config("plain"), console=False).evaluate()
    for replica in (0, 1):
        cfg = tiny_config(f"group{replica}", **{**FT, "fault_tolerance.replica_id": replica,
                                                "fault_tolerance.lighthouse": lighthouse(1),
                                                "fault_tolerance.timeout_s": 1})
        trainer = Trainer(cfg, console=False)
        try:
            assert trainer.evaluate() == want, replica
        finally:
            trainer.replicas.close()


def test_a_peers_state_carries_what_a_checkpoint_restore_does(tiny_config, lighthouse):
    # A group that heals from a peer must end up where a resume from the peer's checkpoint
    # would: the step and data position, and also the training time, the last validation
    # loss and the alert rules' memory (a plateau rule's best value, a drop rule's window).
    rules = {"alerts": [AlertConfig(name="plateau", when="val_loss.no_improvement", patience=10),
                        AlertConfig(name="slow", when="tokens_per_s.drop")]}
    ft = {"fault_tolerance.enable": True, "fault_tolerance.group_size": 1,
          "fault_tolerance.lighthouse": lighthouse(1), "fault_tolerance.timeout_s": 20}
    peer_cfg = tiny_config("peer", **{**ft, "train.steps": 3, "train.eval_interval": 1}
                           ).model_copy(update=rules)
    peer = Trainer(peer_cfg, console=False)
    peer.train()
    resumed = Trainer(peer_cfg, resume=True, console=False)  # from the peer's checkpoint
    healed = Trainer(tiny_config("healed", **ft).model_copy(update=rules), console=False)
    try:
        healed.replicas.load_state_dict(peer.replicas.state_dict())
        healed.replicas.load_state_dict(peer.replicas.state_dict())  # a second time: the same
        assert resumed.step == healed.step == 3 and healed.tokens_seen == resumed.tokens_seen
        assert healed.batches_drawn == resumed.batches_drawn == 3
        assert healed.data.train.state_dict() == resumed.data.train.state_dict()
        assert healed.last_val_loss == resumed.last_val_loss is not None
        assert healed.elapsed_prev >= resumed.elapsed_prev > 0  # the peer trained on since
        assert healed.alerts.rules.state_dict() == resumed.alerts.rules.state_dict()
        assert resumed.alerts.rules.state_dict()[0]["best"] == resumed.last_val_loss
    finally:
        resumed.replicas.close()
        healed.replicas.close()


def test_a_group_started_with_a_taken_replica_id_is_refused(lighthouse):
    # Groups 0 and 1 train; a second group 0 joins their quorum: it is refused in one line
    # (exit 2), they are not. Its request may miss a round: they take quorums until it ends.
    import threading

    from tessel.config import FaultToleranceConfig
    from tessel.parallel.replica_group import ReplicaGroup

    address = lighthouse(2)

    def group(replica: int) -> ReplicaGroup:
        cfg = FaultToleranceConfig(enable=True, replica_id=replica, group_size=2,
                                   lighthouse=address, timeout_s=30)
        return ReplicaGroup(cfg, torch.device("cpu"), 0, dict, lambda state: None)

    def quorums(groups: list[ReplicaGroup]) -> list[int]:
        got: list[int] = [0] * len(groups)

        def take(i: int) -> None:
            got[i] = groups[i].quorum()

        threads = [threading.Thread(target=take, args=(i,)) for i in range(len(groups))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return got

    first, second = group(0), group(1)
    again = group(0)
    refused: list[BaseException] = []

    def join() -> None:
        try:
            again.quorum()
        except BaseException as exc:  # noqa: BLE001 (what the test inspects)
            refused.append(exc)

    try:
        assert quorums([first, second]) == [2, 2]  # admitted together
        joining = threading.Thread(target=join)
        joining.start()
        seen = []
        while joining.is_alive():
            seen.append(quorums([first, second]))  # the two keep taking quorums, as steps do
        joining.join()
        # The newcomer was in a quorum of theirs (not necessarily the last: they may take one
        # more, of two, between its refusal and the end of its thread).
        assert [3, 3] in seen and all(sizes in ([2, 2], [3, 3]) for sizes in seen), seen
        assert len(refused) == 1 and type(refused[0]) is TesselError, refused
        msg = str(refused[0])
        assert "\n" not in msg and refused[0].exit_code == 2
        assert msg == (f"fault_tolerance: replica group 0 is already running: another `tessel "
                       f"train` with fault_tolerance.replica_id=0 joined the Lighthouse at "
                       f"{address} (both would train the same share of every global batch); "
                       "give each group its own replica_id, 0 to 1")
    finally:
        for g in (first, second, again):
            g.close()
