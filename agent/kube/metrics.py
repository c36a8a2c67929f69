"""API-server request metrics, registered on the `CollectorRegistry` the caller passes in (never the global one).

`gpu_node_agent_apiserver_requests_total{verb,code}` counts every request the cluster port makes (remediation's
node and lease traffic and the pod watch of netacct and shaping alike, through one shared client), so the
fleet-wide API load of the DaemonSet can be read off one node and multiplied by the node count.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class ApiRequestCounter:
    """`gpu_node_agent_apiserver_requests_total{verb,code}`; code is the HTTP status, `timeout` or `error`."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self._counter = Counter("gpu_node_agent_apiserver_requests", "API server requests made by the agent",
                                ("verb", "code"), registry=registry)
        self.foreign_pods = Counter("gpu_node_agent_apiserver_foreign_pods",
                                    "Pods of other nodes in an answer to a LIST of this node's pods (a server or "
                                    "proxy ignoring the field selector), skipped, by request", ("request",),
                                    registry=registry)
        for request in ("list_node_pods", "find_node_pod", "watch_pods"):
            self.foreign_pods.labels(request)

    def count(self, verb: str, code: int | str) -> None:
        """Count one request."""
        self._counter.labels(verb=verb, code=str(code)).inc()
