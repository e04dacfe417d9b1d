"""Hardware profile files as users write them (`tessel plan --hardware FILE`, `--gpu list`) and
as `--save-hardware` writes them: each key's real range, refused in one line naming the key
the user wrote; names that need quoting in TOML; files that are not text or nest too deep."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tessel.cli import main
from tessel.errors import TesselError
from tessel.planner import hardware

NEW = {"bf16_tflops": "500", "memory_gib": "48", "intra_node_gbps": "100",
       "inter_node_gbps": "25", "gpus_per_node": "4"}
"""The keys a new profile needs, as TOML values."""


def profile_file(tmp_path: Path, keys: dict[str, str], name: str = "lab",
                 base: dict[str, str] = NEW) -> Path:
    f = tmp_path / "hw.toml"
    f.write_text(f"[gpu.{name}]\n" + "".join(f"{k} = {v}\n" for k, v in {**base, **keys}.items()))
    return f


def one_line(capsys) -> str:  # noqa: ANN001
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("tessel: error: "), err
    assert "Traceback" not in err
    return err


@pytest.mark.parametrize("key_value, needle", [
    ("fp8_tflops = -1979", "fp8_tflops must be a positive number at most 1e+06 (TFLOP/s; 0 "
                           "for none), not -1979"),
    ("fp8_tflops = nan", "fp8_tflops must be a positive number"),
    ("fp8_tflops = inf", "not inf"),
    ("fp8_tflops = true", "not true"),
    ("bf16_tflops = 1e300", "bf16_tflops must be a positive number at most 1e+06 (TFLOP/s), "
                            "not 1e+300"),
    ("memory_gib = 1e308", "memory_gib must be a positive number at most 1e+06 (GiB), "
                           "not 1e+308"),
    ("intra_node_gbps = 0", "intra_node_gbps must be a positive number"),
    ("hbm_gbps = 'fast'", "hbm_gbps must be a positive number at most 1e+06 (GB/s), "
                          "not 'fast'"),
    ("matmul_efficiency = 50", "matmul_efficiency must be a number in (0, 1] (a fraction of the"
                               " peak), not 50"),
    ("comm_efficiency = 1e300", "comm_efficiency must be a number in (0, 1]"),
    ("comm_efficiency = 0", "not 0"),
    ("gpus_per_node = true", "gpus_per_node must be a whole number from 1 to 65536, not true"),
    ("gpus_per_node = 2.5", "gpus_per_node must be a whole number"),
    ("gpus_per_node = 100000000000000000000", "not 1e+20"),
    ("collective_latency_us = 1e300", "collective_latency_us must be a number >= 0 and at most "
                                      "1e+09 (microseconds), not 1e+300"),
    ("sync_skew = inf", "sync_skew must be a number >= 0"),
    ("collective_curve_us = [[1, 1], [1" + "0" * 400 + ", 2]]", "collective_curve_us must be"),
])
def test_a_key_out_of_its_range_is_one_line_naming_it(tmp_path: Path, capsys, key_value,
                                                      needle):
    key, value = key_value.split(" = ", 1)
    f = profile_file(tmp_path, {key: value})
    with pytest.raises(TesselError) as info:
        hardware.load_profiles(f)
    message = str(info.value)
    assert message.startswith("hardware profile 'lab': ") and needle in message
    assert len(message) < 200  # numbers as 1e+308, not 309 digits
    assert main(["plan", "--gpu", "list", "--hardware", str(f)]) == 2
    assert needle in one_line(capsys)
    assert "lab " not in capsys.readouterr().out  # nothing listed


def test_a_built_in_profile_keeps_its_range_when_a_file_overrides_it(tmp_path: Path):
    f = profile_file(tmp_path, {"matmul_efficiency": "1.5"}, "h100-sxm", {})
    with pytest.raises(TesselError, match="matmul_efficiency must be a number in \\(0, 1\\]"):
        hardware.load_profiles(f)
    fine = profile_file(tmp_path, {"matmul_efficiency": "1", "fp8_tflops": "0"}, "h100-sxm", {})
    assert hardware.load_profiles(fine)["h100-sxm"].fp8_flops is None


def test_a_cpu_profile_takes_fitted_factors_above_one(tmp_path: Path):
    """On CPU processes the efficiencies are fitted factors (calibration: up to 100)."""
    f = profile_file(tmp_path, {"device_type": '"cpu"', "matmul_efficiency": "1.37",
                                "comm_efficiency": "20"})
    cpu = hardware.load_profiles(f)["lab"]
    assert (cpu.matmul_efficiency, cpu.comm_efficiency) == (1.37, 20)
    bad = profile_file(tmp_path, {"device_type": '"cpu"', "matmul_efficiency": "1000"})
    with pytest.raises(TesselError, match="matmul_efficiency must be a number in \\(0, 100\\] "
                                          "\\(a fitted factor on CPU processes\\), not 1000"):
        hardware.load_profiles(bad)


@pytest.mark.parametrize("name", ["my.gpu", "my gpu", 'quote"d', "h100-sxm", "x\ny"])
def test_a_saved_profile_reads_back_whatever_its_name(tmp_path: Path, name: str):
    profile = dataclasses.replace(hardware.BUILTIN["h100-sxm"], name=name, matmul_efficiency=0.5,
                                  device_names=("H100",))
    saved = tmp_path / "saved.toml"
    saved.write_text(hardware.profile_toml(profile))
    assert hardware.load_profiles(saved)[name] == profile


def test_save_hardware_with_a_dotted_name_round_trips(tmp_path: Path):
    f = profile_file(tmp_path, {}, '"my.gpu"')
    saved = tmp_path / "saved.toml"
    assert main(["plan", "--gpus", "4", "--gpu", "my.gpu", "--hardware", str(f),
                 "--model.preset=tiny", "--save-hardware", str(saved), "--json"]) == 0
    assert hardware.load_profiles(saved)["my.gpu"] == hardware.load_profiles(f)["my.gpu"]


@pytest.mark.parametrize("content, needle", [
    (b"\xff\xfe[gpu.x]\n", "is not UTF-8 text (byte 0: invalid start byte)"),
    (b"a = " + b"[" * 100_000, "nests its arrays or tables too deep to read"),
    (b"[gpu\n", "is not valid TOML"),
])
def test_a_damaged_hardware_file_is_one_line(tmp_path: Path, capsys, content: bytes, needle):
    f = tmp_path / "hw.toml"
    f.write_bytes(content)
    assert main(["plan", "--gpu", "list", "--hardware", str(f)]) == 2
    err = one_line(capsys)
    assert f"hardware file {str(f)!r} " in err and needle in err
