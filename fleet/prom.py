"""Prometheus text with `prometheus_client`: families made fresh per scrape from a process's
figures, written through a registry of their own, and read back (by `fleet top`) with its
parser, label values unescaped."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

__all__ = ["CounterMetricFamily", "GaugeMetricFamily", "HistogramMetricFamily", "Metric",
           "counter", "exposition", "gauge", "parse"]  # fmt: skip


class _Snapshot(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self._families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self._families


def exposition(families: Iterable[Metric]) -> str:
    """The text format (0.0.4) of `families`."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Snapshot(families))
    return generate_latest(registry).decode()


def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def parse(text: str) -> dict[str, float]:
    """Prometheus text to {name or name{label="value",...}: value}, labels in the order
    written (a histogram's buckets, sum and count included)."""
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            key = sample.name
            if sample.labels:
                key += "{" + ",".join(f'{k}="{v}"' for k, v in sample.labels.items()) + "}"
            out[key] = float(sample.value)
    return out
