"""This node's pods from the Kubernetes API: a `PodFeed` fed by the pod watch.

`KubePodSource` runs `agent.kube.podwatch.NodePodWatch` on the shared cluster port (list, then watch with
`fieldSelector=spec.nodeName=<node>` and bookmarks; re-list only on 410) and publishes, on every change, the pods
with their own addresses (`addressed`): at least one IP in `status.podIPs`, not on the host network (their
traffic is the node's: netacct counts it in the host scope, and they have no veth of their own to shape), and
not finished (a Succeeded or Failed pod's IPs go back to the pool and may already belong to a new pod). Until
the first list succeeds the set stays unknown, so consumers keep what they find in the kernel instead of
emptying it while the API server is unreachable at start.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Iterable

from agent.clock import SYSTEM_CLOCK, Clock
from agent.kube.model import PodView
from agent.kube.podwatch import NodePodWatch
from agent.kube.port import PodWatchApi
from agent.kube.reflector import WATCH_TIMEOUT
from agent.pods.model import Pod, PodListError, make_pod
from agent.pods.source import PodFeed
from agent.supervisor import Backoff, Supervisor

log = logging.getLogger(__name__)

FINISHED = ("Succeeded", "Failed")


def addressed(pods: Iterable[PodView], warned: set[tuple[str, str]] | None = None) -> list[Pod]:
    """The pods with their own addresses, validated; a pod with a malformed IP is skipped (warned once)."""
    out: list[Pod] = []
    for view in pods:
        if view.host_network or not view.ips or view.phase in FINISHED:
            continue
        try:
            out.append(make_pod(view.namespace, view.name, view.ips, view.uid, dict(view.annotations)))
        except PodListError as exc:
            if warned is None or view.key not in warned:
                log.warning("pods: skipping pod %s/%s: %s", view.namespace, view.name, exc)
                if warned is not None:
                    warned.add(view.key)
    return out


class KubePodSource(PodFeed):
    """`PodSource` over the cluster port's pod watch of this node."""

    def __init__(self, api: PodWatchApi, *, clock: Clock = SYSTEM_CLOCK, rng: random.Random | None = None,
                 timeout_range: tuple[int, int] = WATCH_TIMEOUT, backoff: Backoff | None = None) -> None:
        super().__init__()  # unknown until the first successful list
        self._warned: set[tuple[str, str]] = set()
        self.watch = NodePodWatch(api, self._changed, clock=clock, rng=rng, timeout_range=timeout_range,
                                  backoff=backoff)

    def _changed(self, pods: tuple[PodView, ...]) -> None:
        self.publish(addressed(pods, self._warned))

    async def run(self, stop: asyncio.Event) -> None:
        """List and watch until `stop` is set; an unexpected failure is logged and the watch restarted, since the
        service would not notice a dead source (it only ever sees the last published set)."""
        log.info("pods: following the pods of node %s through the Kubernetes API", self.watch.api.node_name)
        supervisor = Supervisor(stop, clock=self.watch.clock, maximum=300.0, grace=0.0, on_failure=_watch_failed)
        supervisor.add("pod watch", self.watch.run)
        await supervisor.run()


def _watch_failed(name: str, exc: Exception, delay: float) -> None:
    log.error("pods: the pod watch failed unexpectedly; restarting it in %.0fs", delay, exc_info=exc)
