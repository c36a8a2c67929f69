"""Device ownership as one supervised subsystem: the kubelet poll, the own-node pod watch (pod specs, uids), and
pod Events for device-health changes.

Everything here degrades instead of failing: no PodResources socket is `gpu_node_agent_pod_resources_up` 0 and
the agent's own records; no API access means no pod specs (admission lookups rely on the kubelet's records
alone, and where those are ambiguous placement keeps its own policy), no spec fetches and no Events. Health
changes arrive on `health_changes` (a copy of what health sends the device plugin), so pod Events do not depend
on the device plugin running.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Mapping

from prometheus_client import CollectorRegistry

from agent import aio
from agent.host.podresources import PodResourcesPort, Reachability
from agent.kube.model import PodView
from agent.kube.port import Cluster
from agent.ownership.pod_events import PodDeviceEvents
from agent.ownership.service import OwnershipService
from agent.signals import DeviceHealthEvent

log = logging.getLogger(__name__)


def open_port(socket: str, registry: CollectorRegistry | None) -> PodResourcesPort:
    """The real client on `socket`, reporting to `gpu_node_agent_pod_resources_up`."""
    from agent.host.podresources.client import KubeletPodResources

    return KubeletPodResources(socket, reachability=Reachability(registry, socket))


class OwnershipSubsystem:
    """Owns the service, the pod watch and the pod-Event notifier. `gpu_of`: the bus id of the GPU a GPU or MIG
    UUID names, for the pod Events' text."""

    def __init__(self, port: PodResourcesPort, registry: CollectorRegistry | None, *,
                 cluster: Cluster | None, poll_interval: float, lookup_timeout: float,
                 gpu_of: Callable[[str], str | None] | None = None) -> None:
        self._watch = None
        fetcher = None
        if cluster is not None:
            from agent.kube.podwatch import NodePodWatch
            from agent.ownership.spec_fetch import PodSpecFetcher

            self._watch = NodePodWatch(cluster, lambda _pods: None)
            fetcher = PodSpecFetcher(cluster, registry)  # pods the watch lags on, when a preference call needs them
        self.service = OwnershipService(port, pod_specs=self._pod_specs, registry=registry,
                                        poll_interval=poll_interval, lookup_timeout=lookup_timeout,
                                        spec_fetcher=fetcher)
        self.pod_events = PodDeviceEvents(cluster, self.service, gpu_of=gpu_of)
        self.health_changes: asyncio.Queue[DeviceHealthEvent] = asyncio.Queue()

    def _pod_specs(self) -> Mapping[tuple[str, str], PodView] | None:
        watch = self._watch
        return watch.pods if watch is not None and watch.synced else None

    async def run(self, stop: asyncio.Event) -> None:
        """Poll, watch and tell pods until `stop`."""
        tasks = [asyncio.create_task(self.service.run(stop), name="ownership-poll"),
                 asyncio.create_task(self._tell_pods(), name="ownership-pod-events")]
        if self._watch is not None:
            tasks.append(asyncio.create_task(self._watch.run(stop), name="ownership-pod-watch"))
        try:
            await stop.wait()
        finally:
            await aio.cancel_and_wait(*tasks)

    async def _tell_pods(self) -> None:
        while True:
            change = await self.health_changes.get()
            try:
                if change.healthy:
                    self.pod_events.device_healthy(change.device_id)
                    continue
                holders = await self.pod_events.device_unhealthy(change.device_id, change.reason)
                if holders:
                    log.warning("unhealthy device %s is held by %s", change.device_id,
                                ", ".join(sorted({f"{h.namespace}/{h.pod}" for h in holders})))
            except Exception:  # one bad event must not end the notifier
                log.exception("cannot tell the pods of device %s", change.device_id)
