"""`gpu_node_agent_device_pod_info`: one series per (device, container) the kubelet reports, for joins.

Any per-device metric, the agent's or dcgm-exporter's, can be joined to pods on `device` (the kubelet device
ID: a VF bus id or a GPU UUID). Collected from the latest reading, so it follows the kubelet as fast as the
ownership poll runs; an unreadable kubelet leaves the last known rows (the API going away does not end the
pods). Devices of every resource are reported, also GPUs served by another plugin.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from agent.ownership.book import Ownership

LABELS = ("resource", "device", "namespace", "pod", "container")


class DevicePodInfo(Collector):
    """Collector over `latest()` (None before the first reading: no series)."""

    def __init__(self, latest: Callable[[], Ownership | None], registry: CollectorRegistry | None) -> None:
        self._latest = latest
        if registry is not None:
            registry.register(self)

    def describe(self) -> Iterator[GaugeMetricFamily]:
        """Declared without samples, so registration does not read the kubelet."""
        yield GaugeMetricFamily("gpu_node_agent_device_pod_info", self._help(), labels=LABELS)

    @staticmethod
    def _help() -> str:
        return "1 for every device a container holds, as the kubelet's PodResources API reports it"

    def collect(self) -> Iterator[GaugeMetricFamily]:
        """One sample per held device and container."""
        family = GaugeMetricFamily("gpu_node_agent_device_pod_info", self._help(), labels=LABELS)
        ownership = self._latest()
        for row in ownership.rows() if ownership is not None else ():
            family.add_metric(list(row), 1.0)
        yield family
