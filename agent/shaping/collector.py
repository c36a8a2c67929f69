"""Prometheus view of shaping: fresh families per scrape from one read of the shapers' counters.

Per pod with a limit: the configured limit per direction (whatever its state), and for shaped pods the bytes sent
through and packets dropped by its limited class (qdisc counters: L2 bytes and GSO segments, so bytes*8 over the
limit reaches about 1.0 when a pod is pinned at its limit). A shaper re-created (interface replaced) restarts its
counters, which `rate()` reads as a reset of that one series. Pods per state say how many are pending (interface
not found yet), in conflict (another tc owner) or failing.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.config.shaping import DIRECTIONS
from agent.host.tc import TcError
from agent.shaping.engine import STATES, PodCounters, PodKey, Shaper

PREFIX = "gpu_node_agent"


def _families() -> tuple[GaugeMetricFamily, CounterMetricFamily, CounterMetricFamily]:
    limit = GaugeMetricFamily(f"{PREFIX}_pod_internet_limit_bits_per_second",
                              "Configured internet bandwidth limit of a pod (egress = uploads, ingress = downloads)",
                              labels=["namespace", "pod", "direction"])
    shaped = CounterMetricFamily(f"{PREFIX}_pod_internet_shaped_bytes",
                                 "Bytes (L2) of a pod's internet traffic sent through its shaper",
                                 labels=["namespace", "pod", "direction"])
    dropped = CounterMetricFamily(f"{PREFIX}_pod_internet_dropped_packets",
                                  "Packets of a pod's internet traffic its shaper dropped (queue full at the limit)",
                                  labels=["namespace", "pod", "direction"])
    return limit, shaped, dropped


class ShapingCollector:
    """Renders a `Shaper`'s limits and counters; register it on an explicit `CollectorRegistry`."""

    def __init__(self, shaper: Shaper) -> None:
        self.shaper = shaper

    def describe(self) -> Iterator[Metric]:
        """Metric names without reading the kernel."""
        yield from _families()
        yield from self._self_metrics(ok=None)

    def collect(self) -> Iterator[Metric]:
        """Read the shapers once and yield every family."""
        limit, shaped, dropped = _families()
        report = self.shaper.last
        ok = True
        try:
            counters: dict[PodKey, PodCounters] = self.shaper.scrape()
        except (TcError, OSError):
            counters, ok = {}, False
        for (namespace, pod), shaping in sorted(report.pods.items()):
            for direction in DIRECTIONS:
                bps = shaping.limits.get(direction)
                if bps is not None:
                    limit.add_metric([namespace, pod, direction], float(bps))
        for (namespace, pod), entry in sorted(counters.items()):
            for direction, values in sorted(entry.counters.items()):
                shaped.add_metric([namespace, pod, direction], values.bytes)
                dropped.add_metric([namespace, pod, direction], values.drops)
        yield from (limit, shaped, dropped)
        yield from self._self_metrics(ok)

    def _self_metrics(self, ok: bool | None) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_shaping_up", "1 when the last read of the shapers' counters succeeded")
        pods = GaugeMetricFamily(f"{PREFIX}_shaping_pods",
                                 "Pods with an internet limit, by state (shaped, pending: host-side interface not "
                                 "found yet, conflict: another owner of its tc hooks, error: retried)",
                                 labels=["state"])
        failures = CounterMetricFamily(f"{PREFIX}_shaping_sync_failures",
                                       "Shaping syncs that failed as a whole (retried with backoff)")
        invalid = CounterMetricFamily(f"{PREFIX}_shaping_invalid_annotations",
                                      "Bandwidth annotation values refused (that direction of the pod runs "
                                      "unshaped), each counted once per pod, annotation and value")
        if ok is not None:
            up.add_metric([], 1.0 if ok else 0.0)
            report = self.shaper.last
            for state in STATES:
                pods.add_metric([state], report.count(state))
            failures.add_metric([], self.shaper.sync_failures)
            invalid.add_metric([], self.shaper.invalid_annotations)
        yield from (up, pods, failures, invalid)
