"""Remediation metrics, registered on the `CollectorRegistry` the caller passes in (never the global one).

`gpu_node_agent_apiserver_requests_total{verb,code}` counts every request the cluster port makes, so the
fleet-wide API load of the DaemonSet can be read off one node and multiplied. `..._remediation_actions_total`
counts decisions by action and result (ok, failed, dry_run, deferred, ...).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ApiRequestCounter:
    """`gpu_node_agent_apiserver_requests_total{verb,code}`; code is the HTTP status, `timeout` or `error`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter("gpu_node_agent_apiserver_requests", "API server requests made by the agent",
                                ("verb", "code"), registry=registry)

    def count(self, verb: str, code: int | str) -> None:
        """Count one request."""
        self._counter.labels(verb=verb, code=str(code)).inc()


class ActionCounter:
    """`gpu_node_agent_remediation_actions_total{action,result}`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter("gpu_node_agent_remediation_actions", "Remediation decisions by action and result",
                                ("action", "result"), registry=registry)

    def count(self, action: str, result: str) -> None:
        """Count one decision."""
        self._counter.labels(action=action, result=result).inc()
