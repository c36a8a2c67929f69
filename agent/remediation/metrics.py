"""Remediation metrics, registered on the `CollectorRegistry` the caller passes in (never the global one).

`gpu_node_agent_remediation_actions_total` counts decisions by action and result (ok, failed, dry_run,
deferred, ...); `gpu_node_agent_incidents_total` the new fault findings recorded in the node's incidents
annotation; `gpu_node_agent_remediation_latched` is 1 while the node waits for a person
(NeedsHumanAttention). API-server requests are counted by the cluster port (`agent.kube.metrics`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class ActionCounter:
    """`gpu_node_agent_remediation_actions_total{action,result}`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter("gpu_node_agent_remediation_actions", "Remediation decisions by action and result",
                                ("action", "result"), registry=registry)
        self._incidents = Counter("gpu_node_agent_incidents", "New fault findings (a GPU or NIC and its reason) "
                                  "recorded in the node's incidents annotation", registry=registry)
        self._latched = Gauge("gpu_node_agent_remediation_latched",
                              "1 while the node is latched NeedsHumanAttention (too many remediations)",
                              registry=registry)

    def count(self, action: str, result: str) -> None:
        """Count one decision."""
        self._counter.labels(action=action, result=result).inc()

    def incidents(self, count: int) -> None:
        """Count new fault findings recorded on the node."""
        self._incidents.inc(count)

    def latched(self, value: bool) -> None:
        """Publish whether the needs-a-human latch is set."""
        self._latched.set(1.0 if value else 0.0)
