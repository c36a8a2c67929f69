"""Which Kubernetes API server the process talks to, decided once, and its one client, opened on first use.

In memory only when no credentials are given (`--simulate` without `--kubeconfig`, outside a cluster); the
decision and the start-line description live here so the wiring only hands the port to the subsystems that
need the API (remediation, the pod watch of netacct and shaping, ownership, DRA, shaping's Events).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry

from agent.config import AgentConfig

if TYPE_CHECKING:
    from agent.kube.port import Cluster

SERVICE_ACCOUNT_TOKEN = Path("/var/run/secrets/kubernetes.io/serviceaccount/token")
SIMULATED_NODE = "simulated-node"


class ClusterPort:
    """The process's one Kubernetes API client, opened on first use and shared by remediation and netacct.

    In memory (the simulated node and its pods) only when no credentials are given: `--simulate` without
    `--kubeconfig`, outside a cluster. `--simulate` never changes which API server a kubeconfig points at.
    """

    def __init__(self, cfg: AgentConfig, registry: CollectorRegistry, *,
                 service_account_token: Path = SERVICE_ACCOUNT_TOKEN) -> None:
        self._cfg = cfg
        self._registry = registry
        self.in_cluster = service_account_token.is_file()
        self.in_memory = cfg.topology.simulate is not None and not cfg.api_server.kubeconfig and not self.in_cluster
        self.opened: Cluster | None = None
        self._failure: Exception | None = None

    @property
    def node_name(self) -> str:
        """This node's name (the simulated node's when in memory and none is given)."""
        return self._cfg.node_name or (SIMULATED_NODE if self.in_memory else "")

    def describe(self) -> str:
        """Which API server, for the start line."""
        if self.in_memory:
            return f"in-memory cluster (node {self.node_name}; no credentials given)"
        where = f"kubeconfig {self._cfg.api_server.kubeconfig}" if self._cfg.api_server.kubeconfig else \
            "in-cluster service account" if self.in_cluster else "default kubeconfig"
        return f"API server from {where} (node {self.node_name or '?'})"

    def get(self) -> Cluster:
        """The client; `ClusterConfigError` without a node name (a real cluster only) or without credentials."""
        if self.opened is None:
            from agent.kube import ClusterConfigError, open_cluster

            if self._failure is not None:  # every user hears the same answer; the client is made once
                raise self._failure
            api = self._cfg.api_server
            try:
                self.opened = open_cluster(self.node_name, self._registry, in_memory=self.in_memory,
                                           kubeconfig=api.kubeconfig, timeout=api.timeout_seconds)
            except ClusterConfigError as exc:
                self._failure = exc
                raise
        return self.opened

    async def aclose(self) -> None:
        """Release the client (after every subsystem using it has stopped)."""
        cluster, self.opened = self.opened, None
        if cluster is not None:
            await cluster.aclose()
