"""Remediation metrics, registered on the `CollectorRegistry` the caller passes in (never the global one).

`gpu_node_agent_remediation_actions_total` counts decisions by action and result (ok, failed, dry_run,
deferred, ...). API-server requests are counted by the cluster port (`agent.kube.metrics`).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ActionCounter:
    """`gpu_node_agent_remediation_actions_total{action,result}`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter("gpu_node_agent_remediation_actions", "Remediation decisions by action and result",
                                ("action", "result"), registry=registry)

    def count(self, action: str, result: str) -> None:
        """Count one decision."""
        self._counter.labels(action=action, result=result).inc()
