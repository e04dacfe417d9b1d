"""Multi-node and elastic launching without a cluster: `tessel train --nnodes N|MIN:MAX
--rdzv-endpoint HOST:PORT` (the torchrun command, the checks before it), the micro-batch
re-planned for another data-parallel size, and a world-size change as an event and an alert.
The runs across network namespaces are tests/distributed/test_multinode.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from conftest import forge_state

from tessel.checkpoint import latest_checkpoint
from tessel.cli import main
from tessel.config import AlertConfig, Config
from tessel.errors import TesselError
from tessel.launch import local
from tessel.launch.elastic import check_node_counts, micro_batch_for, replan, replan_if_elastic
from tessel.launch.rendezvous import (
    ELASTIC_ENV,
    SEPARATE_STORE_EXPORT,
    NodeRange,
    Rendezvous,
    is_local,
    multinode_command,
)
from tessel.observe.alerts import AlertRules
from tessel.observe.events import read_events
from tessel.parallel.dims import ParallelDims
from tessel.train import Trainer

ROOT = Path(__file__).resolve().parents[2]
CONFIG = str(ROOT / "configs/tiny.toml")


def one_line_error(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("tessel: error: "), err
    return err[0]


@pytest.fixture
def launched(monkeypatch):
    """What `tessel train` would start: (command, env) of each torchrun, none started."""
    calls: list[tuple[list[str], dict | None]] = []
    monkeypatch.setattr(local, "run_torchrun", lambda cmd, env=None: calls.append((cmd, env)) or 0)
    monkeypatch.setattr(local, "run_local", lambda *a: pytest.fail("must not launch locally"))
    return calls


def test_node_ranges():
    assert NodeRange.parse("2") == NodeRange(2, 2) and not NodeRange.parse("2").elastic
    assert NodeRange.parse("1:4").elastic and list(NodeRange.parse("1:4").counts()) == [1, 2, 3, 4]
    assert str(NodeRange.parse("1:4")) == "1:4" and str(NodeRange.parse("3")) == "3"


@pytest.mark.parametrize("argv, needle", [
    (["--nnodes", "0", "--rdzv-endpoint", "h:1"], "--nnodes needs N or MIN:MAX"),
    (["--nnodes", "3:2", "--rdzv-endpoint", "h:1"], "--nnodes needs N or MIN:MAX"),
    (["--nnodes=x", "--rdzv-endpoint", "h:1"], "--nnodes needs N or MIN:MAX"),
    (["--nnodes", "2"], "needs --nnodes N (or MIN:MAX) and --rdzv-endpoint"),
    (["--rdzv-endpoint", "h:1"], "needs --nnodes N (or MIN:MAX) and --rdzv-endpoint"),
    (["--nnodes", "2", "--rdzv-endpoint", "host"], "--rdzv-endpoint needs HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--max-restarts", "-1"], "--max-restarts"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-id", "a b"], "--rdzv-id"),
    # Unicode digits pass str.isdigit() and crashed int()
    (["--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:²"], "--rdzv-endpoint needs HOST:PORT"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--max-restarts", "²"],
     "--max-restarts needs a whole number >= 0 (got '²')"),
    (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--rdzv-timeout", "²"], "--rdzv-timeout needs"),
    (["--nnodes", "٢", "--rdzv-endpoint", "h:1"], "--nnodes needs N or MIN:MAX"),
])
def test_bad_multinode_options_are_one_line(capsys, launched, argv, needle):
    assert needle in one_line_error(capsys, ["train", CONFIG, *argv])
    assert launched == []


def test_multinode_options_are_refused_inside_torchrun(capsys, launched, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    err = one_line_error(capsys, ["train", CONFIG, "--nnodes", "2", "--rdzv-endpoint", "h:1"])
    assert "drop the multi-node options" in err


def test_a_layout_that_cannot_shrink_is_refused_naming_the_node_counts_it_fits(capsys, launched):
    # tp=2 needs an even number of processes: with one per node, 2 or 4 nodes of 1:4.
    err = one_line_error(capsys, ["train", CONFIG, "--nnodes", "1:4", "--rdzv-endpoint",
                                  "127.0.0.1:29500", "--parallel.tp=2"])
    assert "cannot run on 1 node(s) x 1 processes" in err
    assert "node counts allowed for this layout in 1:4: 2, 4" in err
    assert launched == []
    # ... and a global batch no node count of the range divides.
    err = one_line_error(capsys, ["train", CONFIG, "--nnodes", "3:3", "--rdzv-endpoint",
                                  "127.0.0.1:29500"])
    assert "no node count in 3:3 fits this layout" in err


def test_an_elastic_launch_runs_torchrun_with_the_c10d_rendezvous(launched, monkeypatch):
    monkeypatch.setenv("PET_RDZV_CONF", "keep_alive_interval=1")
    assert main(["train", CONFIG, "--nproc", "2", "--nnodes", "1:2", "--rdzv-endpoint",
                 "127.0.0.1:29511", "--max-restarts=5", "--train.steps=3"]) == 0
    (cmd, env), = launched
    assert env is not None and env[ELASTIC_ENV] == "1:2"
    # every rendezvous round publishes its own store (a returning node meets the others)
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
    i = cmd.index("-m", 3)  # the workers: tessel train with the other arguments only
    assert cmd[i:] == ["-m", "tessel", "train", CONFIG, "--train.steps=3"]
    opts = dict(zip(cmd[3:i:2], cmd[4:i:2]))
    assert opts["--nnodes"] == "1:2" and opts["--nproc-per-node"] == "2"
    assert opts["--rdzv-backend"] == "c10d" and opts["--rdzv-endpoint"] == "127.0.0.1:29511"
    assert opts["--max-restarts"] == "5" and opts["--local-addr"] == "127.0.0.1"
    conf = dict(kv.split("=") for kv in opts["--rdzv-conf"].split(","))
    # this machine holds the endpoint's address: it hosts the rendezvous
    assert conf == {"keep_alive_interval": "1", "last_call_timeout": "5", "is_host": "1"}


def test_a_fixed_size_multinode_launch_sets_no_elastic_environment(launched):
    assert main(["train", CONFIG, "--nnodes", "2", "--rdzv-endpoint", "127.0.0.1:29511"]) == 0
    (cmd, env), = launched
    assert ELASTIC_ENV not in env and cmd[cmd.index("--nnodes") + 1] == "2"
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"  # a restarted node meets the others


def test_only_the_node_holding_the_endpoint_hosts_the_rendezvous():
    assert is_local("127.0.0.1")
    assert not is_local("192.0.2.1")  # TEST-NET-1: no machine holds it
    cmd = multinode_command(1, Rendezvous(NodeRange(2, 2), "127.0.0.1:29512"), [])
    assert "is_host=1" in cmd[cmd.index("--rdzv-conf") + 1]


@pytest.mark.parametrize("global_batch, micro, dp, want", [
    (8, 4, 2, 4), (8, 4, 1, 4), (8, 8, 2, 4), (24, 8, 2, 6), (12, 5, 2, 3), (8, 2, 3, None),
])
def test_micro_batch_for(global_batch, micro, dp, want):
    assert micro_batch_for(global_batch, micro, dp) == want


def test_replan_keeps_the_global_batch_and_changes_only_the_split(monkeypatch):
    cfg = Config.load(CONFIG, {"train.global_batch_size": 16, "train.micro_batch_size": 8})
    dims = ParallelDims.from_config(cfg.parallel, 4)
    new, note = replan(cfg, dims)
    assert new.train.micro_batch_size == 4 and new.train.global_batch_size == 16
    assert "micro-batch 8 -> 4, accumulation 1, global batch 16 kept" in note
    assert replan(cfg, ParallelDims.from_config(cfg.parallel, 2)) == (cfg, None)
    with pytest.raises(TesselError, match="cannot be split over 3 data-parallel ranks"):
        replan(cfg, ParallelDims.from_config(cfg.parallel, 3))
    # only an elastic run's workers re-plan: a fixed-size run keeps what it was given
    said: list[str] = []
    assert replan_if_elastic(cfg, dims, said.append) is cfg and said == []
    monkeypatch.setenv(ELASTIC_ENV, "1:4")
    assert replan_if_elastic(cfg, dims, said.append).train.micro_batch_size == 4 and said
    with pytest.raises(TesselError, match="node counts allowed for this layout in 1:4: 1, 2, 4;"):
        check_node_counts(cfg, 1, range(1, 5))  # 16 sequences do not split over 3 ranks


def test_world_size_rules_fire_on_their_direction_only():
    rules = AlertRules([AlertConfig(name="shrank", when="world_size.shrink"),
                        AlertConfig(name="grew", when="world_size.grow")])
    fired = rules.world_changed(4, 2, step=10)
    assert [f.rule.name for f in fired] == ["shrank"]
    assert fired[0].message == "world size shrank from 4 to 2 processes"
    assert fired[0].values == {"world_size": 2, "before": 4}
    assert [f.rule.name for f in rules.world_changed(2, 3, step=10)] == ["grew"]
    assert rules.world_changed(2, 2, step=10) == []


def test_a_resume_on_fewer_processes_is_a_world_shrink_event_and_alert(tiny_config):
    cfg = tiny_config("run", **{"train.steps": 2})
    Trainer(cfg, console=False).train()
    run = Path(cfg.run.dir)
    # the checkpoint as a two-process run would have written it
    ckpt = latest_checkpoint(run / "checkpoints")
    state = json.loads((ckpt / "state.json").read_text())
    assert state["world_size"] == 1
    state["world_size"] = 2
    (ckpt / "state.json").write_text(json.dumps(state))
    forge_state(ckpt)
    rule = {"name": "lost a node", "when": "world_size.shrink"}
    again = Config.from_dict({**cfg.to_dict(), "alerts": [rule]}, {"train.steps": 3})
    Trainer(again, resume=True, console=False).train()
    events = read_events(run)
    shrink = next(e for e in events if e["kind"] == "world_shrink")
    assert (shrink["step"], shrink["world_size_before"], shrink["world_size"]) == (2, 2, 1)
    assert shrink["accumulation"] == 2  # configs' global 8 = 2 micro-batches of 4 on one rank
    alert = next(e for e in events if e["kind"] == "alert")
    assert alert["rule"] == "lost a node" and alert["step"] == 2
    assert not any(e["kind"] in ("world_shrink", "world_grow") for e in events[:2])


# ---- job files: Slurm and Kubernetes ---------------------------------------------------------


def test_an_elastic_slurm_job_asks_for_a_node_range_and_tells_the_workers(capsys, tmp_path,
                                                                         monkeypatch):
    import subprocess

    monkeypatch.chdir(tmp_path)
    args = ["launch", "slurm", CONFIG, "--gpus-per-node", "0", "--nproc-per-node", "2"]
    assert main([*args, "--nodes", "1:2"]) == 0
    script = capsys.readouterr().out
    (tmp_path / "job.sh").write_text(script)
    subprocess.run(["bash", "-n", str(tmp_path / "job.sh")], check=True)
    assert "#SBATCH --nodes=1-2\n" in script and "(1-2 x 2 CPU processes)" in script
    assert f"\nexport {ELASTIC_ENV}=1:2\n" in script
    # whatever SLURM allocates, one launcher per node through srun
    assert 'srun --kill-on-bad-exit=1 --ntasks-per-node=1 "${NODE[@]}" &' in script
    assert main([*args, "--nodes", "2", "--train.micro_batch_size=4"]) == 0
    assert ELASTIC_ENV not in capsys.readouterr().out  # a fixed size: no re-planning
    # configs/tiny.toml's global batch of 16 does not split over 3 nodes x 2
    err = one_line_error(capsys, [*args, "--nodes", "1:4"])
    assert "cannot run on 3 node(s) x 2 processes" in err
    assert "node counts allowed for this layout in 1:4: 1, 2, 4" in err


def _k8s_job(capsys, *args: str) -> dict:
    """The PyTorchJob of `tessel launch k8s`, checked against the CRD's own schema."""
    import gzip

    import jsonschema
    import yaml

    assert main(["launch", "k8s", CONFIG, "--image", "i:1", "--pvc", "p", *args]) == 0
    _, job = yaml.safe_load_all(capsys.readouterr().out)
    schema = json.loads(gzip.decompress((ROOT / "tests/data/pytorchjob_v1.schema.json.gz")
                                        .read_bytes()))
    jsonschema.Draft4Validator(schema).validate(job)
    return job


def test_an_elastic_pytorchjob_has_an_elastic_policy_and_workers_only(capsys):
    import subprocess

    job = _k8s_job(capsys, "--nodes", "1:2", "--gpus-per-node", "2")
    assert job["spec"]["elasticPolicy"] == {"rdzvBackend": "c10d", "minReplicas": 1,
                                            "maxReplicas": 2, "maxRestarts": 3}
    specs = job["spec"]["pytorchReplicaSpecs"]
    assert list(specs) == ["Worker"] and specs["Worker"]["replicas"] == 2
    (container,) = specs["Worker"]["template"]["spec"]["containers"]
    script = container["args"][0]
    subprocess.run(["bash", "-n", "-c", script], check=True)
    assert f"export {ELASTIC_ENV}=1:2\n" in script
    store = subprocess.run(["bash", "-c", f"{SEPARATE_STORE_EXPORT}\n"
                            "echo $TORCH_DISABLE_SHARE_RDZV_TCP_STORE"], capture_output=True,
                           text=True, env={"PATH": "/usr/bin:/bin"}).stdout
    assert store == "1\n" and SEPARATE_STORE_EXPORT in script
    # the operator's PET_NNODES (1:2) and PET_RDZV_* give torchrun its range and rendezvous
    assert "exec torchrun --nproc-per-node 2 --max-restarts 3 -m tessel train" in script
    assert "--nnodes" not in script and "MASTER_ADDR" not in script
    fixed = _k8s_job(capsys, "--nodes", "2", "--gpus-per-node", "2", "--train.micro_batch_size=4")
    assert "elasticPolicy" not in fixed["spec"]


def test_an_elastic_trainjob_is_refused(capsys):
    err = one_line_error(capsys, ["launch", "k8s", CONFIG, "--image", "i", "--pvc", "p",
                                  "--kind", "trainjob", "--nodes", "1:2"])
    assert "has no elastic policy" in err and "use --kind pytorchjob for an elastic job" in err


def test_namespaces_that_cannot_be_made_skip_in_one_line_but_fail_under_ci(monkeypatch):
    import netns

    monkeypatch.setattr(netns, "unavailable", lambda: "not root")
    monkeypatch.setenv("CI", "false")
    with pytest.raises(pytest.skip.Exception, match=r"network namespaces unavailable \(not root\)"):
        with netns.nodes(2):
            pass
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception, match="CI=true: must run"):
        with netns.nodes(2):
            pass


def test_a_users_own_store_setting_reaches_torchrun(monkeypatch):
    from tessel.launch.rendezvous import torchrun_env

    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "0")
    env = torchrun_env(NodeRange(2, 2))
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "0" and ELASTIC_ENV not in env


def _counted_fits(monkeypatch) -> list[int]:
    """The world sizes `fits` is asked about; more than a thousand fails the test at once (the
    old check tried every node count of the range, a billion of them)."""
    from tessel.launch import elastic

    real, worlds = elastic.fits, []

    def fits(cfg, world):
        worlds.append(world)
        if len(worlds) > 1000:
            pytest.fail("the node counts are checked one by one")
        return real(cfg, world)

    monkeypatch.setattr(elastic, "fits", fits)
    return worlds


def test_a_huge_node_range_is_answered_without_trying_every_count(capsys, launched, monkeypatch):
    worlds = _counted_fits(monkeypatch)
    err = one_line_error(capsys, ["train", CONFIG, "--nnodes", "1:1000000000",
                                  "--rdzv-endpoint", "127.0.0.1:29500"])
    assert "--nnodes 1:1000000000: the layout cannot run on 3 node(s) x 1 processes" in err
    assert "node counts allowed for this layout in 1:1000000000: 1, 2, 4, 8, 16;" in err
    assert launched == [] and len(worlds) < 20
    # `tessel launch` names the option its user typed, --nodes
    err = one_line_error(capsys, ["launch", "slurm", CONFIG, "--gpus-per-node", "0",
                                  "--nodes", "1:1000000000"])
    assert err.startswith("tessel: error: --nodes 1:1000000000: the layout cannot run on 3 ")
    assert "narrow --nodes" in err and "--nnodes" not in err


@pytest.mark.parametrize("overrides, nproc", [
    ({}, 1), ({"parallel.tp": 2}, 1), ({"parallel.pp": 2}, 3), ({"parallel.tp": 2}, 2),
    ({"parallel.tp": 4, "train.global_batch_size": 24, "train.micro_batch_size": 4}, 3),
    ({"parallel.dp_replicate": 2, "parallel.dp_shard": 2, "train.micro_batch_size": 2}, 2),
])
def test_the_counts_found_arithmetically_are_the_ones_that_fit(overrides, nproc):
    from tessel.launch.elastic import candidate_counts, fits

    cfg = Config.load(CONFIG, overrides)
    counts = range(1, 61)
    tried = [n for n in candidate_counts(cfg, nproc, counts) if fits(cfg, n * nproc) is None]
    assert tried == [n for n in counts if fits(cfg, n * nproc) is None]

