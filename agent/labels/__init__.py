"""Node labels the cluster can schedule on (issue 39): GFD-compatible `nvidia.com/` keys where GFD is absent and
the agent's own `gpunodeagent.io/` topology and health facts, published through an NFD NodeFeature (or on the
Node itself where NFD's resource is not served), never blinking.

- `gfd` / `own`: the labels as pure functions of the facts;
- `facts`: one reading of the sources, group by group (a failed source reads None);
- `publish`: the two targets (NodeFeature, Node), each writing only what differs;
- `service`: the loop that keeps last values, waits for a complete first reading and counts writes.

`NodeLabels` is the subsystem: it picks the target (`nodeLabels.mode`), the NodeFeature's owners (the agent's
Pod and its DaemonSet), then runs the service.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from agent.clock import SYSTEM_CLOCK, Clock
from agent.kube.errors import ApiError
from agent.kube.model import OwnerRef
from agent.kube.port import NodeApi, NodeFeatureApi, PodLookupApi
from agent.labels.publish import NodeFeatureTarget, NodeTarget, Target
from agent.labels.service import NodeLabelService

log = logging.getLogger(__name__)

__all__ = ["LabelApi", "NodeLabels"]
RETRY = 30.0  # seconds between tries to reach the API server before the first publish


class LabelApi(NodeApi, NodeFeatureApi, PodLookupApi, Protocol):
    """What node labels do on the API server."""


async def owners_of(api: PodLookupApi, namespace: str, pod_name: str) -> list[OwnerRef]:
    """The agent's DaemonSet (controller) and Pod as owners, as GFD and nfd-worker own their NodeFeatures."""
    pod = await api.find_node_pod(namespace, pod_name)
    if pod is None or not pod.uid:
        log.warning("node labels: the agent's pod %s/%s is not on this node; the NodeFeature gets no owner",
                    namespace, pod_name)
        return []
    daemonsets = [o for o in pod.owners if o.kind == "DaemonSet"]
    return [*daemonsets, OwnerRef("v1", "Pod", pod.name, pod.uid)]


class NodeLabels:
    """The node-labels subsystem: the target `mode` names (auto: a NodeFeature where served, else the Node)."""

    def __init__(self, mode: str, api: LabelApi, service: NodeLabelService, *, namespace: str, pod_name: str,
                 clock: Clock = SYSTEM_CLOCK) -> None:
        self.mode, self.api, self.service = mode, api, service
        self.namespace, self.pod_name, self.clock = namespace, pod_name, clock
        self.chosen: str = ""  # the target in use once chosen: nodefeature or node

    async def target(self) -> Target | None:
        """The target, or None when it cannot be used (logged)."""
        if self.mode == "node":
            return NodeTarget(self.api)
        if not await self.api.node_features_served():
            if self.mode == "nodefeature":
                log.error("node labels: --node-labels nodefeature, but the API server does not serve NFD's "
                          "NodeFeature (nfd.k8s-sigs.io/v1alpha1): install NFD, or use --node-labels auto or node")
                return None
            return NodeTarget(self.api)
        if not self.namespace:
            log.error("node labels: a NodeFeature needs the agent's namespace (POD_NAMESPACE, --pod-namespace)")
            return None
        owners = await owners_of(self.api, self.namespace, self.pod_name) if self.pod_name else []
        return NodeFeatureTarget(self.api, self.namespace, owners)

    async def run(self, stop: asyncio.Event) -> None:
        """Choose the target (retrying while the API server cannot answer), then keep the labels current."""
        target = None
        while target is None and not stop.is_set():
            try:
                target = await self.target()
            except ApiError as exc:
                log.warning("node labels: cannot choose where to publish (%s); retrying in %.0f s", exc, RETRY)
            if target is None:
                await self.clock.wait(stop, RETRY)
        if target is None:
            return
        self.chosen = target.mode
        log.info("node labels: publishing on the %s", "NodeFeature" if target.mode == "nodefeature" else "Node")
        await self.service.run(stop, target)
