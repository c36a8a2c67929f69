"""Prometheus metrics of the health checks, built fresh on every scrape from the assessor's current state.

A custom collector rather than module-level Counter/Gauge objects: nothing global, registered on the
`CollectorRegistry` the caller passes in, and labels come and go with the topology. GPU labels are
dcgm-exporter's names (`gpu` index, `uuid`, `pci_bus_id`); the bus id is the agent's canonical `0000:1b:00.0`
form, like everywhere else in the agent (join with dcgm-exporter's NVML form on `uuid`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from agent.health.assess import HealthAssessor
from agent.health.checks import Checks
from agent.health.findings import GpuRef
from agent.signals import Severity

if TYPE_CHECKING:  # imported only with a dcgm-exporter URL (agent.health.service)
    from agent.health.dcgm_watch import DcgmWatcher

PREFIX = "gpu_node_agent_"
GPU_LABELS = ("gpu", "uuid", "pci_bus_id")
ResourceOf = Callable[[str], str | None]


def _gpu_labels(gpu: GpuRef) -> list[str]:
    return [gpu.index, gpu.uuid, gpu.bus_id]


class HealthCollector(Collector):
    """Xid counts, ECC and row-remap state, device health, node verdict and check availability."""

    def __init__(self, assessor: HealthAssessor, checks: Checks, resource_of: ResourceOf | None = None,
                 kmsg_lost: Callable[[], int] = lambda: 0, dcgm: DcgmWatcher | None = None, *,
                 kmsg_skipped: Callable[[], Mapping[str, int]] = dict,
                 kmsg_resyncs: Callable[[], int] = lambda: 0, link_resyncs: Callable[[], int] = lambda: 0) -> None:
        self.assessor = assessor
        self.checks = checks
        self.resource_of = resource_of
        self.kmsg_lost = kmsg_lost
        self.kmsg_skipped = kmsg_skipped
        self.kmsg_resyncs = kmsg_resyncs
        self.link_resyncs = link_resyncs
        self.dcgm = dcgm

    def collect(self) -> Iterator[Metric]:
        """One consistent snapshot of the assessor."""
        a = self.assessor
        xids = CounterMetricFamily(PREFIX + "xid_errors",
                                   "Xid errors reported by the driver (kernel log, NVML or DCGM; a fault counts once)",
                                   labels=[*GPU_LABELS, "xid"])
        for (gpu, code), count in sorted(a.xids.totals.items(), key=lambda item: (item[0][0].bus_id, item[0][1])):
            xids.add_metric([*_gpu_labels(gpu), str(code)], count)
        yield xids
        yield from self._memory()
        yield from self._devices()
        verdict = GaugeMetricFamily(PREFIX + "node_verdict", "1 for the node's current health verdict",
                                    labels=["verdict"])
        for severity in Severity:
            verdict.add_metric([severity.value], 1.0 if a.verdict.severity is severity else 0.0)
        yield verdict
        checks = GaugeMetricFamily(PREFIX + "health_check_up",
                                   "1 while a health check runs; 0 when unavailable (e.g. no NVML), failed or off",
                                   labels=["check"])
        for name, status in self.checks.items():
            checks.add_metric([name], 1.0 if status.up else 0.0)
        yield checks
        lost = CounterMetricFamily(PREFIX + "kmsg_records_lost", "kernel-log records overwritten before read")
        lost.add_metric([], self.kmsg_lost())
        yield lost
        skipped = CounterMetricFamily(PREFIX + "kmsg_events_skipped", "NVRM events in the kernel log not acted on, by "
                                      "reason (not_kernel: written by user space; foreign_device: not a GPU of this "
                                      "node)", labels=["reason"])
        counts = self.kmsg_skipped()
        for reason in ("foreign_device", "not_kernel"):
            skipped.add_metric([reason], counts.get(reason, 0))
        yield skipped
        resyncs = CounterMetricFamily(PREFIX + "kmsg_sequence_resyncs", "kernel-log sequence numbers that could not "
                                      "be real (went back, leapt, or a saved position ahead of the kernel)")
        resyncs.add_metric([], self.kmsg_resyncs())
        yield resyncs
        link_resyncs = CounterMetricFamily(PREFIX + "link_event_resyncs", "times the netlink link-event stream lost "
                                           "news (socket overrun, ENOBUFS) and every link was read again")
        link_resyncs.add_metric([], self.link_resyncs())
        yield link_resyncs
        if self.dcgm is not None:
            yield from self._dcgm(self.dcgm)

    @staticmethod
    def _dcgm(dcgm: DcgmWatcher) -> Iterator[Metric]:
        scrapes = CounterMetricFamily(PREFIX + "dcgm_scrapes", "scrapes of dcgm-exporter by result (ok, unreachable, "
                                      "timeout, http_error, too_large, malformed, no_gpus)", labels=["result"])
        for result in sorted({"ok", *dcgm.results}):
            scrapes.add_metric([result], dcgm.results[result])
        yield scrapes
        unknown = GaugeMetricFamily(PREFIX + "dcgm_unknown_gpus", "GPUs in the last good dcgm-exporter scrape that "
                                    "are not on this node (their samples are ignored)")
        unknown.add_metric([], len(dcgm.unknown_gpus))
        yield unknown

    def _memory(self) -> Iterator[Metric]:
        a = self.assessor
        ecc = CounterMetricFamily(PREFIX + "ecc_errors", "ECC errors by type (corrected/uncorrected) and counter "
                                  "(volatile since the last reset, aggregate over the GPU's life)",
                                  labels=[*GPU_LABELS, "error_type", "counter_type"])
        retired = GaugeMetricFamily(PREFIX + "retired_pages", "retired framebuffer pages by cause",
                                    labels=[*GPU_LABELS, "cause"])
        retired_pending = GaugeMetricFamily(PREFIX + "retired_pages_pending",
                                            "1 when page retirement waits for a GPU reset", labels=list(GPU_LABELS))
        remapped = GaugeMetricFamily(PREFIX + "remapped_rows", "remapped DRAM rows by error type",
                                     labels=[*GPU_LABELS, "error_type"])
        pending = GaugeMetricFamily(PREFIX + "row_remap_pending", "1 when a row remap waits for a GPU reset",
                                    labels=list(GPU_LABELS))
        failure = GaugeMetricFamily(PREFIX + "row_remap_failure", "1 when a row remap failed",
                                    labels=list(GPU_LABELS))
        for uuid, h in sorted(a.memory.items()):
            labels = _gpu_labels(a.names.by_uuid(uuid))
            for error_type, counter_type, value in (
                ("corrected", "volatile", h.ecc_corrected_volatile),
                ("uncorrected", "volatile", h.ecc_uncorrected_volatile),
                ("corrected", "aggregate", h.ecc_corrected_aggregate),
                ("uncorrected", "aggregate", h.ecc_uncorrected_aggregate),
            ):
                if value is not None:
                    ecc.add_metric([*labels, error_type, counter_type], value)
            for cause, value in (("sbe", h.retired_pages_sbe), ("dbe", h.retired_pages_dbe)):
                if value is not None:
                    retired.add_metric([*labels, cause], value)
            for error_type, value in (("correctable", h.remapped_rows_corrected),
                                      ("uncorrectable", h.remapped_rows_uncorrected)):
                if value is not None:
                    remapped.add_metric([*labels, error_type], value)
            for family, flag in ((retired_pending, h.retired_pages_pending), (pending, h.remap_pending),
                                 (failure, h.remap_failure)):
                if flag is not None:
                    family.add_metric(labels, 1.0 if flag else 0.0)
        reset_pending = GaugeMetricFamily(PREFIX + "gpu_reset_pending", "1 while a GPU reset is pending for the "
                                          "GPU: a row remap or page retirement it applies (the GPU stays in service), "
                                          "or a fault it cures", labels=list(GPU_LABELS))
        waiting = a.book.reset_pending()
        for gpu in a.topology.gpus:
            if gpu.uuid:
                reset_pending.add_metric(_gpu_labels(a.names.by_uuid(gpu.uuid)), 1.0 if gpu.uuid in waiting else 0.0)
        yield from (ecc, retired, retired_pending, remapped, pending, failure, reset_pending)

    def _devices(self) -> Iterator[Metric]:
        a = self.assessor
        unhealthy = a.book.unhealthy_devices()
        healthy = GaugeMetricFamily(PREFIX + "device_healthy", "1 when the device is Healthy in ListAndWatch",
                                    labels=["resource", "device"])
        for device, kind in _devices(a):
            resource = (self.resource_of(device) if self.resource_of else None) or kind
            healthy.add_metric([resource, device], 0.0 if device in unhealthy else 1.0)
        yield healthy
        link = GaugeMetricFamily(PREFIX + "nic_link_up", "1 when an RDMA NIC's link is up",
                                 labels=["pci_bus_id", "netdev", "rdma"])
        for bus_id, status in sorted(a.links.items()):
            netdev = status.nic.netdevs[0] if status.nic.netdevs else ""
            link.add_metric([bus_id, netdev, status.nic.rdma or ""], 1.0 if status.up else 0.0)
        yield link


def _devices(a: HealthAssessor) -> list[tuple[str, str]]:
    """(device ID, kind) of every device health is reported for: GPU UUIDs, RDMA PFs and their VFs."""
    found = [(g.uuid, "gpu") for g in a.topology.gpus if g.uuid]
    for nic in a.topology.rdma_nics:
        found.append((nic.bus_id, "nic"))
        found.extend((vf.bus_id, "nic_vf") for vf in nic.vfs)
    return found
