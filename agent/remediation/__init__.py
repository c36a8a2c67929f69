"""Remediation: the agent acts on its own Node through the Kubernetes API, carefully and at fleet scale.

Entry points for `agent.app`: `build_service` (or `RemediationService` with `connect_cluster` / `simulated_cluster`
by hand) and `NodeVerdict`, the input, on an asyncio queue. `connect_cluster` imports lightkube lazily;
`simulated_cluster` needs no cluster at all (`run --simulate PROFILE --dry-run`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from agent.remediation.service import RemediationService
from agent.remediation.verdicts import HEALTHY, NodeVerdict

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from agent.config.remediation import RemediationConfig
    from agent.remediation.port import Cluster
    from agent.remediation.preflight import PreflightCheck
    from agent.remediation.simulated import InMemoryCluster

__all__ = ["HEALTHY", "NodeVerdict", "RemediationService", "build_service", "connect_cluster", "simulated_cluster"]


def connect_cluster(config: RemediationConfig, node_name: str, registry: CollectorRegistry) -> Cluster:
    """The real cluster port (kubeconfig or in-cluster), counting requests on `registry`.

    Raises `agent.remediation.cluster.ClusterConfigError` (a usage error: exit 2) without credentials.
    """
    from agent.remediation.cluster import connect
    from agent.remediation.metrics import ApiRequestCounter

    return connect(node_name, ApiRequestCounter(registry), config.kubeconfig, config.api_timeout_seconds)


def simulated_cluster(node_name: str, preflight_taint: str = "") -> InMemoryCluster:
    """An in-memory Node (with the preflight taint when given) running a training pod and a DaemonSet pod."""
    from agent.remediation.model import PodView, Taint
    from agent.remediation.simulated import InMemoryCluster

    taints = [Taint(preflight_taint, "NoSchedule")] if preflight_taint else []
    pods = [PodView("default", "training-job-0", ("Job",)), PodView("kube-system", "nvidia-device-plugin-x1",
                                                                     ("DaemonSet",))]
    return InMemoryCluster(node_name or "simulated-node", pods=pods, taints=taints)


def build_service(config: RemediationConfig, node_name: str, verdicts: asyncio.Queue[Any],
                  registry: CollectorRegistry, *, simulate: bool = False,
                  preflight_checks: Sequence[PreflightCheck] = ()) -> RemediationService:
    """The service on the real cluster, or (`simulate`) on an in-memory node; close `service.cluster` after run."""
    if simulate:
        node_name = node_name or "simulated-node"
        cluster: Cluster = simulated_cluster(node_name)
    else:
        cluster = connect_cluster(config, node_name, registry)
    return RemediationService(config, node_name, cluster, verdicts, registry, pod_name=config.pod_name,
                              pod_namespace=config.pod_namespace, preflight_checks=preflight_checks)
