"""The Kubernetes API port, shared by every subsystem that talks to the API server (remediation, netacct).

- `port`: the operations the agent may perform, as narrow Protocols (the RBAC rules grant exactly these).
- `model` / `errors`: the values the port returns and the only exceptions it raises.
- `cluster`: the real port on lightkube; `connect` builds one client. lightkube stays inside it and the modules
  beside it: `calls` (client, error translation, streamed requests), `pod_calls` and `nodefeature_calls`
  (request groups of the port), `nodes` (the fleet view's Node LIST).
- `simulated`: an in-memory cluster for `--simulate` without credentials.
- `reflector`: the one list/watch loop (bookmarks, 410 re-list, backoff) for the node and its pods.
- `podwatch`: this node's pods, kept current by the reflector.

Create ONE cluster per process and hand it to every consumer: requests are counted on one
`gpu_node_agent_apiserver_requests_total`, and the connection pool is shared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from agent.kube.errors import ClusterConfigError

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from agent.kube.cluster import LightkubeCluster
    from agent.kube.nodes import LightkubeNodes
    from agent.kube.port import Cluster

__all__ = ["ClusterConfigError", "connect", "connect_nodes", "open_cluster"]


def connect(node_name: str, registry: CollectorRegistry, kubeconfig: str | None = None,
            timeout: float = 10.0) -> LightkubeCluster:
    """The real cluster port (kubeconfig, or the in-cluster service account), counting requests on `registry`.

    Imports lightkube lazily. Raises `ClusterConfigError` without usable credentials.
    """
    from agent.kube.cluster import connect as _connect
    from agent.kube.metrics import ApiRequestCounter

    return _connect(node_name, ApiRequestCounter(registry), kubeconfig, timeout)


def connect_nodes(registry: CollectorRegistry, kubeconfig: str | None = None, timeout: float = 10.0) -> LightkubeNodes:
    """The read-only cluster-wide Node LIST (`gpu-node-agent fleet`), counting requests on `registry`."""
    from agent.kube.metrics import ApiRequestCounter
    from agent.kube.nodes import connect_nodes as _connect_nodes

    return _connect_nodes(ApiRequestCounter(registry), kubeconfig, timeout)


def open_cluster(node_name: str, registry: CollectorRegistry, *, in_memory: bool = False,
                 kubeconfig: str | None = None, timeout: float = 10.0) -> Cluster:
    """The one cluster port of a process: `in_memory`, the demo node and its pods (named `simulated-node`
    unless `node_name` is given); else `connect`. `ClusterConfigError` without a node name (a real cluster
    only) or without credentials."""
    if in_memory:
        from agent.kube.simulated import demo_cluster

        return demo_cluster(node_name)
    if not node_name:
        raise ClusterConfigError("no node name: set --node-name or NODE_NAME (downward API spec.nodeName)")
    return connect(node_name, registry, kubeconfig, timeout)
