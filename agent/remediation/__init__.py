"""Remediation: the agent acts on its own Node through the Kubernetes API, carefully and at fleet scale.

Entry points for `agent.app`: `build_service` (or `RemediationService` with `connect_cluster` / `simulated_cluster`
by hand) and `NodeVerdict`, the input, in an `agent.signals.Latest` cell. The cluster port itself lives in
`agent.kube`, shared with network accounting: pass `cluster=` to share one client. `connect_cluster` imports
lightkube lazily; `simulated_cluster` needs no cluster at all (`run --simulate PROFILE --dry-run`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from agent.signals import HEALTHY, Latest, NodeVerdict

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from agent.config.remediation import RemediationConfig
    from agent.kube.port import Cluster
    from agent.kube.simulated import InMemoryCluster
    from agent.remediation.gpu_reset import Resetter
    from agent.remediation.isolate import PodsOf
    from agent.remediation.preflight import PreflightCheck
    from agent.remediation.service import RemediationService
    from agent.signals import GpuResetListener

__all__ = ["HEALTHY", "NodeVerdict", "RemediationService", "build_service", "connect_cluster", "simulated_cluster"]


def __getattr__(name: str) -> object:
    """`RemediationService` on first use: the service pulls in the whole engine (config, reset, drain, reboot),
    which `fleet` and the other readers of this package's small modules (`state`, `incidents`) never run."""
    if name == "RemediationService":
        from agent.remediation.service import RemediationService

        return RemediationService
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def connect_cluster(node_name: str, registry: CollectorRegistry, kubeconfig: str | None = None,
                    timeout: float = 10.0) -> Cluster:
    """The real cluster port (kubeconfig or in-cluster), counting requests on `registry`.

    Raises `agent.kube.errors.ClusterConfigError` (a usage error: exit 2) without credentials.
    """
    from agent.kube import connect

    return connect(node_name, registry, kubeconfig, timeout)


def simulated_cluster(node_name: str, preflight_taint: str = "") -> InMemoryCluster:
    """An in-memory Node (with the preflight taint when given) running a training pod and a DaemonSet pod."""
    from agent.kube.simulated import demo_cluster

    return demo_cluster(node_name, preflight_taint)


def build_service(config: RemediationConfig, node_name: str, verdicts: Latest[NodeVerdict],
                  registry: CollectorRegistry, *, simulate: bool = False, cluster: Cluster | None = None,
                  preflight_checks: Sequence[PreflightCheck] = (), resetter: Resetter | None = None,
                  pods_of: PodsOf | None = None,
                  reset_listener: GpuResetListener | None = None) -> RemediationService:
    """The service on `cluster`, else on the real cluster or (`simulate`) an in-memory node.

    Whoever made the cluster closes it (`service.cluster.aclose()`) after `run`.
    """
    from agent.remediation.service import RemediationService

    if simulate:
        node_name = node_name or "simulated-node"
    if cluster is None:
        cluster = simulated_cluster(node_name) if simulate else connect_cluster(node_name, registry)
    return RemediationService(config, node_name, cluster, verdicts, registry, pod_name=config.pod_name,
                              pod_namespace=config.pod_namespace, preflight_checks=preflight_checks,
                              resetter=resetter, pods_of=pods_of, reset_listener=reset_listener)
