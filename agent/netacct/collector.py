"""Prometheus view of netacct: fresh metric families per scrape from one read pass of every counter.

A custom collector, not instrumented Counters updated in the background: each scrape reads the kernel once
(engine.scrape), folds the raw values into the monotonic book and renders the totals, so concurrent scrapes cannot
race and departed pods simply stop appearing (prometheus writing_exporters; reference netacct.md §7.3). Every
(traffic, scope) series is always present, zero before the first packet, so dashboards need no `or vector(0)`.
Self-metrics say whether the read was complete, how long it took, and which layout and backend are used.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from agent.netacct.engine import Netacct, Reading

PREFIX = "gpu_node_agent"
TRAFFIC = ("internet", "cluster")
SCOPES = ("host", "pod")
DIRECTIONS = {"in": "receive", "out": "transmit"}
ROLE_LABELS = {"rx-inet": ("receive", "internet"), "tx-inet": ("transmit", "internet"),
               "rx-clus": ("receive", "cluster"), "tx-clus": ("transmit", "cluster")}


def parse_key(key: str) -> tuple[str, str, str] | None:
    """`traffic=internet-in scope=host` -> (receive, internet, host); None for keys that are not exported."""
    fields = dict(part.split("=", 1) for part in key.split() if "=" in part)
    traffic, scope = fields.get("traffic", ""), fields.get("scope")
    cls, _, direction = traffic.rpartition("-")
    if cls not in TRAFFIC or direction not in DIRECTIONS or scope not in SCOPES:
        return None
    return DIRECTIONS[direction], cls, scope


def _families(per_pod: bool) -> dict[str, CounterMetricFamily]:
    out: dict[str, CounterMetricFamily] = {}
    for direction in ("receive", "transmit"):
        for unit in ("bytes", "packets"):
            out[f"{direction}_{unit}"] = CounterMetricFamily(
                f"{PREFIX}_network_{direction}_{unit}",
                f"{unit.capitalize()} {'received' if direction == 'receive' else 'sent'} by this node (scope=host: "
                f"INPUT/OUTPUT) or its routed pods (scope=pod: FORWARD), IP-level; traffic=cluster when the peer is "
                f"in the internal set, else internet", labels=["traffic", "scope"])
        if per_pod:
            out[f"pod_{direction}_bytes"] = CounterMetricFamily(
                f"{PREFIX}_pod_network_{direction}_bytes",
                f"IP-level bytes {'received' if direction == 'receive' else 'sent'} by one pod through this node, "
                f"by peer class", labels=["namespace", "pod", "traffic"])
    return out


class NetacctCollector:
    """Renders an engine's counters; register it on an explicit `CollectorRegistry`."""

    def __init__(self, engine: Netacct, per_pod: bool = True) -> None:
        self.engine = engine
        self.per_pod = per_pod

    def describe(self) -> Iterator[Metric]:
        """Metric names without reading the kernel (registration must not run iptables)."""
        yield from _families(self.per_pod).values()
        yield from self._self_metrics(None)

    def collect(self) -> Iterator[Metric]:
        """Read every counter once and yield all families."""
        reading = self.engine.scrape()
        if reading.layout == "unknown":
            # No layout chosen yet (auto, before the first sync): zeros now and the kernel's totals a moment later
            # would read as new traffic to Prometheus. Export the self-metrics only (up is 0).
            yield from self._self_metrics(reading)
            return
        families = _families(self.per_pod)
        totals: dict[tuple[str, str, str], tuple[int, int]] = {
            (d, t, s): (0, 0) for d in ("receive", "transmit") for t in TRAFFIC for s in SCOPES}
        for key, (packets, octets) in reading.rules.items():
            labels = parse_key(key)
            if labels is not None:
                old = totals[labels]
                totals[labels] = (old[0] + packets, old[1] + octets)
        for (direction, traffic, scope), (packets, octets) in sorted(totals.items()):
            families[f"{direction}_bytes"].add_metric([traffic, scope], octets)
            families[f"{direction}_packets"].add_metric([traffic, scope], packets)
        if self.per_pod:
            for (namespace, pod), roles in sorted(reading.pods.items()):
                for role, (direction, traffic) in ROLE_LABELS.items():
                    families[f"pod_{direction}_bytes"].add_metric([namespace, pod, traffic],
                                                                  roles.get(role, (0, 0))[1])
        yield from families.values()
        yield from self._self_metrics(reading)

    def _self_metrics(self, reading: Reading | None) -> Iterator[Metric]:
        up = GaugeMetricFamily(f"{PREFIX}_netacct_up", "1 when the last read of every netacct counter succeeded")
        took = GaugeMetricFamily(f"{PREFIX}_netacct_read_duration_seconds",
                                 "Seconds the last read of every netacct counter took")
        syncs = CounterMetricFamily(f"{PREFIX}_netacct_sync_failures",
                                    "Syncs of netacct rules and sets that failed (retried with backoff)")
        backend = GaugeMetricFamily(f"{PREFIX}_netacct_backend_info",
                                    "The backend netacct uses: nftables (native layout), or nft / legacy (the "
                                    "iptables layout's backend)", labels=["backend"])
        layout = GaugeMetricFamily(f"{PREFIX}_netacct_layout_info",
                                   "Where netacct's counting rules live: nft (native table) or iptables",
                                   labels=["layout"])
        repairs = CounterMetricFamily(f"{PREFIX}_netacct_repairs",
                                      "netacct objects someone else removed or changed that the agent re-created, "
                                      "holding the counts it last read (a warning names each)", labels=["what"])
        if reading is not None:
            for what, count in self.engine.repairs.counts().items():
                repairs.add_metric([what], count)
            up.add_metric([], 1.0 if reading.ok else 0.0)
            took.add_metric([], reading.seconds)
            syncs.add_metric([], self.engine.sync_failures)
            backend.add_metric([reading.mode], 1.0)
            layout.add_metric([reading.layout], 1.0)
        yield from (up, took, syncs, backend, layout, repairs)
