"""The latest training metrics as a Prometheus text endpoint (metrics.prometheus_port).

Rank 0 serves http://HOST:PORT/metrics from a daemon thread; a Prometheus server scrapes it
and can alert on it (a stalled run shows as an old `tessel_last_update_timestamp_seconds`).
The HTTP server and text format are prometheus_client's; this module only maps metrics
records to gauges.
"""

from __future__ import annotations

import errno
import re
import threading
import time
from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tessel.errors import TesselError

_PREFIX = "tessel_"
_INVALID = re.compile(r"[^a-zA-Z0-9_:]")
# Names of the exporter's own families (a counter's samples end in _total and _created).
_RESERVED = {
    "tessel_metrics_updates",
    "tessel_metrics_updates_total",
    "tessel_metrics_updates_created",
    "tessel_last_update_timestamp_seconds",
}


def metric_name(key: str) -> str:
    """The Prometheus name of a metrics-record field: "tokens_per_s" -> "tessel_tokens_per_s".
    Characters Prometheus does not allow in a name become "_"."""
    return _PREFIX + _INVALID.sub("_", key)


class _LatestCollector(Collector):
    """Yields the latest value of every numeric field seen, at scrape time.

    A custom collector rather than one `Gauge` per field: the fields are only known when
    records arrive (validation records carry val_loss, train records loss, mfu only on a
    GPU ...), and a scrape then sees one consistent snapshot taken under one lock.
    """

    def __init__(self, run: str):
        self._run = run
        self._lock = threading.Lock()
        self._values: dict[str, float] = {}
        self._updates = 0
        self._last_update: float | None = None

    def update(self, record: dict[str, Any]) -> None:
        with self._lock:
            for key, value in record.items():
                # bool is an int subclass but a flag, not a measurement.
                if isinstance(value, (int, float)) and not isinstance(value, bool):
                    name = metric_name(str(key))
                    if name not in _RESERVED:  # would emit a duplicate family, breaking scrapes
                        self._values[name] = float(value)
            self._updates += 1
            self._last_update = time.time()

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            values = dict(self._values)
            updates, last = self._updates, self._last_update
        for name in sorted(values):
            g = GaugeMetricFamily(
                name, f"Latest '{name[len(_PREFIX) :]}' of the training run.", labels=["run"]
            )
            g.add_metric([self._run], values[name])  # NaN/Inf are rendered as NaN/+Inf/-Inf
            yield g
        c = CounterMetricFamily("tessel_metrics_updates", "Metrics records received.", labels=["run"])
        c.add_metric([self._run], updates)
        yield c
        if last is not None:
            t = GaugeMetricFamily(
                "tessel_last_update_timestamp_seconds",
                "Unix time of the latest metrics record (alert on its age to catch a stalled run).",
                labels=["run"],
            )
            t.add_metric([self._run], last)
            yield t


class PrometheusExporter:
    """Serves the latest metrics of one run at http://host:port/metrics.

    Each numeric field of the records passed to `update` becomes a gauge
    `tessel_<field>{run="<run>"}` holding its latest value ("step" -> `tessel_step`);
    booleans, None and strings are skipped. Serving starts in the constructor, on a daemon
    thread, with a registry of its own (never prometheus_client's global one), so several
    exporters can live in one process.
    """

    def __init__(self, port: int, run: str, host: str = "0.0.0.0"):
        self._collector = _LatestCollector(run)
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self._collector)
        try:
            # prometheus_client >= 0.20 returns (server, thread); see pyproject.toml.
            self._server, self._thread = start_http_server(port, addr=host, registry=self._registry)
        except OSError as e:
            if e.errno == errno.EADDRINUSE:
                raise TesselError(
                    f"metrics.prometheus_port={port} is already in use; choose another port or 0 "
                    "for any free port"
                ) from None
            if e.errno == errno.EACCES:
                raise TesselError(
                    f"metrics.prometheus_port={port}: permission denied (ports below 1024 need "
                    "root); choose a port of 1024 or more, or 0 for any free port"
                ) from None
            raise TesselError(
                f"metrics.prometheus_port={port}: cannot listen on {host}:{port}: {e.strerror or e}"
            ) from None
        self._closed = False

    @property
    def port(self) -> int:
        """The port actually served (the free one chosen when constructed with port 0)."""
        return int(self._server.server_address[1])

    def update(self, record: dict[str, Any]) -> None:
        """Take the numeric fields of one metrics record as the latest values."""
        self._collector.update(record)

    def close(self) -> None:
        """Stop serving and free the port. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)
