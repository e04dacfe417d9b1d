"""parallel.async_tp (micro-pipelined tensor parallelism): refused in one line, exit 2, with
nothing written, wherever it cannot run; where it can, the compiler pass is turned on and the
tensor-parallel group registered for symmetric memory."""

from __future__ import annotations

import sys

import pytest
import torch.distributed as dist

from tessel.cli import main
from tessel.config import Config
from tessel.parallel.async_tp import enable_async_tp
from tessel.parallel.check import check_layout
from tessel.parallel.dims import ParallelDims, ParallelError

RUN = ["--quiet", "--model.preset=tiny", "--train.steps=1", "--train.micro_batch_size=2",
       "--train.global_batch_size=4", "--parallel.async_tp=true"]


def _one_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


@pytest.mark.parametrize("launch", [[], ["--nproc", "2", "--parallel.tp=2"]],
                         ids=["one process", "torchrun"])
def test_the_cli_refuses_async_tp_on_cpu_with_nothing_written(tmp_path, capsys, launch):
    run = tmp_path / "run"
    code = main(["train", *RUN, *launch, "--train.compile=true", f"--run.dir={run}"])
    assert code == 2
    assert "parallel.async_tp runs on CUDA GPUs only" in _one_line(capsys)
    assert not run.exists()


def _cfg(**overrides: object) -> Config:
    base: dict[str, object] = {"model.preset": "tiny", "parallel.tp": 2, "parallel.async_tp": True,
                               "train.compile": True, "train.micro_batch_size": 2,
                               "train.global_batch_size": 4}
    return Config.load(None, {**base, **overrides})


def _check(cfg: Config, device: str = "cuda") -> None:
    check_layout(cfg, ParallelDims.from_config(cfg.parallel, cfg.parallel.tp), device, "bf16")


@pytest.mark.parametrize("overrides, words", [
    ({"parallel.tp": 1}, "this layout has tp = 1: set parallel.tp > 1"),
    ({"parallel.sequence_parallel": False}, "set parallel.sequence_parallel = true"),
    ({"train.compile": False}, "set train.compile = true"),
])
def test_async_tp_is_refused_where_the_layout_cannot_pipeline(overrides, words):
    with pytest.raises(ParallelError, match=words) as refused:
        _check(_cfg(**overrides))
    assert "\n" not in str(refused.value)
    assert "parallel.async_tp = false" in str(refused.value)


def test_async_tp_is_refused_by_a_torch_without_symmetric_memory(monkeypatch):
    # A module set to None in sys.modules fails to import, as in a torch without it.
    monkeypatch.setitem(sys.modules, "torch.distributed._symmetric_memory", None)
    with pytest.raises(ParallelError, match="torch.distributed._symmetric_memory is missing"):
        _check(_cfg())


def test_a_tensor_parallel_compiled_cuda_layout_is_accepted_and_the_default_is_off():
    _check(_cfg())  # no refusal
    assert Config.load(None, {}).parallel.async_tp is False
    _check(_cfg(**{"parallel.async_tp": False, "parallel.tp": 1}), "cpu")  # unchanged


def test_enable_async_tp_registers_the_group_and_turns_the_pass_on():
    import torch._inductor.config as inductor
    from torch.distributed._symmetric_memory import is_symm_mem_enabled_for_group
    from torch.distributed.device_mesh import init_device_mesh

    before = inductor._micro_pipeline_tp
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,), mesh_dim_names=("tp",))
        enable_async_tp(_cfg(**{"parallel.async_tp": False}).parallel, mesh)
        assert inductor._micro_pipeline_tp is before  # not asked: nothing
        enable_async_tp(_cfg().parallel, mesh)
        assert inductor._micro_pipeline_tp is True
        assert is_symm_mem_enabled_for_group(mesh.get_group().group_name)
    finally:
        inductor._micro_pipeline_tp = before
        dist.destroy_process_group()
