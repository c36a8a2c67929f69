"""Prometheus metrics of the NVLink / fabric / recovery-action pass, built on every scrape from its last reading.

GPU labels are the health metrics' (`gpu`, `uuid`, `pci_bus_id`). One-hot families (`state`, `action`) list every
known value, so a dashboard or alert sees a series go 1 -> 0 rather than vanish.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.health.gpu_state_watch import GpuStateWatcher
from agent.host.nvml.api import FABRIC_NOT_SUPPORTED, FABRIC_STATES, RECOVERY_ACTIONS

PREFIX = "gpu_node_agent_"
GPU_LABELS = ["gpu", "uuid", "pci_bus_id"]


class GpuStateCollector(Collector):
    """NVLink link counts, fabric state and status, and the driver's recovery action per GPU."""

    def __init__(self, watcher: GpuStateWatcher) -> None:
        self.watcher = watcher

    def collect(self) -> Iterator[Metric]:
        """One snapshot of the watcher's last pass."""
        w = self.watcher
        active = GaugeMetricFamily(PREFIX + "nvlink_links_active", "NVLinks NVML reports active (GPUs with NVLink)",
                                   labels=GPU_LABELS)
        inactive = GaugeMetricFamily(PREFIX + "nvlink_links_inactive", "NVLinks NVML reports inactive (a PCIe "
                                     "board without a bridge reports all of them)", labels=GPU_LABELS)
        down = GaugeMetricFamily(PREFIX + "nvlink_links_down", "NVLinks inactive on this GPU that its peers have "
                                 "active (the agent's judgement; 0 when fine)", labels=GPU_LABELS)
        fabric = GaugeMetricFamily(PREFIX + "gpu_fabric_state", "1 for the GPU's NVLink fabric registration state "
                                   "(nvmlGpuFabricInfo; not_supported without an NVSwitch fabric)",
                                   labels=[*GPU_LABELS, "state"])
        status = GaugeMetricFamily(PREFIX + "gpu_fabric_status", "NVML return code of the fabric registration "
                                   "(0 = success; read once completed)", labels=GPU_LABELS)
        recovery = GaugeMetricFamily(PREFIX + "gpu_recovery_action", "1 for the recovery the NVIDIA driver requests "
                                     "for the GPU (NVML field GPU_RECOVERY_ACTION; none = nothing)",
                                     labels=[*GPU_LABELS, "action"])
        for uuid, (gpu, state) in sorted(w.latest.items(), key=lambda item: item[1][0].bus_id):
            labels = [gpu.index, uuid, gpu.bus_id]
            if state.nvlinks:
                on = sum(state.nvlinks.values())
                active.add_metric(labels, on)
                inactive.add_metric(labels, len(state.nvlinks) - on)
                verdict = w.judge.nvlink.get(uuid)
                down.add_metric(labels, verdict.down if verdict is not None else 0)
            if "fabric" not in state.errors:
                now = state.fabric.state if state.fabric is not None else FABRIC_NOT_SUPPORTED
                for value, name in FABRIC_STATES.items():
                    fabric.add_metric([*labels, name], 1.0 if value == now else 0.0)
                if state.fabric is not None:
                    status.add_metric(labels, state.fabric.status)
            if state.recovery_action is not None:
                current = RECOVERY_ACTIONS.get(state.recovery_action, "unknown")
                for name in [*RECOVERY_ACTIONS.values(), "unknown"]:
                    recovery.add_metric([*labels, name], 1.0 if name == current else 0.0)
        yield from (active, inactive, down, fabric, status, recovery)
