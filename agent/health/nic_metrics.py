"""Prometheus metrics of the NIC/PCIe/inventory pass, built fresh on every scrape from its last reading.

`nic_port_events_total{device,port,counter}` carries the kernel's value as read (`device` is the RDMA device
name); a counter the kernel reset goes down, which Prometheus' `rate()` treats as a counter reset.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.health.nic_watch import NicWatcher
from agent.signals import DeviceHealth

PREFIX = "gpu_node_agent_"


class NicCollector(Collector):
    """Port counters, flaps, PCIe link width/speed and AER totals, GPUs expected and present."""

    def __init__(self, watcher: NicWatcher, device_health: DeviceHealth | None = None) -> None:
        self.watcher = watcher
        self.device_health = device_health

    def collect(self) -> Iterator[Metric]:
        """One snapshot of the watcher's last pass."""
        w = self.watcher
        reading = w.judge.latest
        # not "..._counter_total": promtool's lint rejects a metric type in a name; the `counter` label names the file
        counters = CounterMetricFamily(PREFIX + "nic_port_events", "InfiniBand/RoCE port error and recovery events "
                                       "as the kernel counts them, by counter file (counters/ and hw_counters/ in "
                                       "sysfs; many saturate)",
                                       labels=["device", "port", "counter"])
        for port in reading.ports:
            for name, value in sorted(port.counters.items()):
                counters.add_metric([port.device, str(port.port), name], value)
        yield counters
        flaps = CounterMetricFamily(PREFIX + "nic_link_flaps", "down->up cycles of an RDMA port seen by the agent",
                                    labels=["device", "port"])
        for port in reading.ports:
            subject = f"{port.device}/{port.port}"
            flaps.add_metric([port.device, str(port.port)], w.judge.flap_totals.get(subject, 0))
        yield flaps
        degraded = GaugeMetricFamily(PREFIX + "pcie_link_degraded", "1 when a PCIe link runs narrower than its "
                                     "maximum width (GPU, NIC or an upstream port)", labels=["device"])
        width = GaugeMetricFamily(PREFIX + "pcie_link_width_lanes", "PCIe link width", labels=["device", "which"])
        speed = GaugeMetricFamily(PREFIX + "pcie_link_speed_gts", "PCIe link speed in GT/s (idle GPUs slow down: "
                                  "exported, not judged)", labels=["device", "which"])
        for link in reading.links:
            narrow = link.max_width is not None and link.current_width is not None \
                and link.current_width < link.max_width
            degraded.add_metric([link.bus_id], 1.0 if narrow else 0.0)
            for which, lanes, gts in (("current", link.current_width, link.current_speed),
                                      ("max", link.max_width, link.max_speed)):
                if lanes is not None:
                    width.add_metric([link.bus_id, which], lanes)
                if gts is not None:
                    speed.add_metric([link.bus_id, which], gts)
        yield from (degraded, width, speed)
        aer = CounterMetricFamily(PREFIX + "pcie_aer_errors", "PCIe AER errors reported by the device "
                                  "(aer_dev_* TOTAL lines)", labels=["device", "severity"])
        for bus_id, kinds in sorted(reading.aer.items()):
            for kind, value in sorted(kinds.items()):
                aer.add_metric([bus_id, kind], value)
        yield aer
        expected = GaugeMetricFamily(PREFIX + "gpus_expected", "GPUs this node should have (--expected-gpus, "
                                     "else the count at the first scan)")
        expected.add_metric([], w.inventory.expected)
        yield expected
        present = GaugeMetricFamily(PREFIX + "gpus_present", "expected GPUs present on the PCI bus (and in NVML "
                                    "when it runs)")
        present.add_metric([], w.inventory.present)
        yield present
        healthy = GaugeMetricFamily(PREFIX + "gpus_healthy", "GPUs present and Healthy (no active finding names "
                                    "them); the fleet ratio is sum(healthy) / sum(expected)")
        healthy.add_metric([], self._healthy_gpus())
        yield healthy

    def _healthy_gpus(self) -> int:
        """Known GPUs not missing whose UUID device health holds Healthy (one without a UUID: present is all
        that can be said of it)."""
        w, health = self.watcher, self.device_health
        return sum(1 for bus_id, gpu in w.known_gpus.items() if bus_id not in w.inventory.missing
                   and (health is None or not gpu.uuid or health.is_healthy(gpu.uuid)))
