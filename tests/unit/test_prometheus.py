"""The Prometheus endpoint, scraped over real loopback HTTP."""

from __future__ import annotations

import socket
import urllib.request

import pytest

from tessel.errors import TesselError
from tessel.observe.prometheus import PrometheusExporter, metric_name


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        return r.read().decode()


def samples(text: str) -> dict[str, str]:
    """{'name{labels}': 'value'} of the exposition's sample lines."""
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            key, value = line.rsplit(" ", 1)
            out[key] = value
    return out


@pytest.fixture(scope="module")
def exporter():
    # One per module: closing waits for the server's 0.5 s poll, which adds up over tests.
    e = PrometheusExporter(0, "runs/exp1", host="127.0.0.1")
    yield e
    e.close()


def test_latest_numeric_fields_become_gauges(exporter: PrometheusExporter) -> None:
    assert exporter.port > 0
    exporter.update(
        {
            "step": 10,
            "loss": 4.0,
            "lr": 3e-4,
            "mfu": None,
            "kind": "train",
            "resumed": True,
            "grad_norm": float("nan"),
        }
    )
    exporter.update({"step": 20, "loss": 3.25, "tokens_per_s": 1234.5})
    exporter.update({"step": 20, "val_loss": 3.5})  # an eval record keeps the train values
    s = samples(scrape(exporter.port))
    run = 'run="runs/exp1"'
    assert s[f"tessel_loss{{{run}}}"] == "3.25"
    assert s[f"tessel_step{{{run}}}"] == "20.0"
    assert s[f"tessel_val_loss{{{run}}}"] == "3.5"
    assert s[f"tessel_tokens_per_s{{{run}}}"] == "1234.5"
    assert s[f"tessel_lr{{{run}}}"] == "0.0003"
    assert s[f"tessel_grad_norm{{{run}}}"] == "NaN"
    assert s[f"tessel_metrics_updates_total{{{run}}}"] == "3.0"
    assert f"tessel_last_update_timestamp_seconds{{{run}}}" in s
    names = {k.split("{")[0] for k in s}
    assert not names & {"tessel_mfu", "tessel_kind", "tessel_resumed"}


def test_metric_names_are_valid() -> None:
    assert metric_name("loss") == "tessel_loss"
    assert metric_name("train/loss-ema") == "tessel_train_loss_ema"


def test_port_in_use_is_a_one_line_error(exporter: PrometheusExporter) -> None:
    with pytest.raises(TesselError) as e:
        PrometheusExporter(exporter.port, "runs/other", host="127.0.0.1")
    assert str(e.value) == (
        f"metrics.prometheus_port={exporter.port} is already in use; choose another port or 0 "
        "for any free port"
    )


def test_port_held_by_another_socket() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(TesselError, match="already in use"):
            PrometheusExporter(port, "r", host="127.0.0.1")


def test_two_exporters_in_one_process_do_not_collide_and_close_frees_the_port() -> None:
    a = PrometheusExporter(0, "runs/a", host="127.0.0.1")
    b = PrometheusExporter(0, "runs/b", host="127.0.0.1")
    try:
        a.update({"step": 1, "loss": 1.0})
        b.update({"step": 2, "loss": 2.0})
        sa, sb = samples(scrape(a.port)), samples(scrape(b.port))
        assert sa['tessel_loss{run="runs/a"}'] == "1.0" and 'tessel_loss{run="runs/b"}' not in sa
        assert sb['tessel_loss{run="runs/b"}'] == "2.0" and 'tessel_loss{run="runs/a"}' not in sb
    finally:
        a.close()
        b.close()
    a.close()  # idempotent
    with socket.socket() as s:
        # SO_REUSEADDR as the exporter's server sets it: only a live listener blocks the bind.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind(("127.0.0.1", a.port))
        s.listen()
