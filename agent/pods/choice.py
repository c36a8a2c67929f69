"""The one choice of this node's pod source: the pods file, the Kubernetes API, or none (an empty list).

Made once per process by the composition root; netacct and shaping read the source it returns (netacct runs
it when it runs, else shaping), so one process holds one pod watch.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from agent.kube.errors import ClusterConfigError
from agent.kube.port import PodWatchApi
from agent.pods.kube import KubePodSource
from agent.pods.source import FilePodSource, PodFeed, PodSource

log = logging.getLogger(__name__)


def open_pod_source(pods_file: str | None, cluster: Callable[[], PodWatchApi] | None = None) -> PodSource:
    """The pods file when configured; else this node's pods through the cluster port `cluster()` returns; else
    (no `cluster`, or it has no node name or credentials: logged once, here) an empty pod list, so only the
    node and pod aggregates are counted and nothing is shaped."""
    if pods_file:
        return FilePodSource(pods_file)
    if cluster is None:
        return PodFeed(())
    try:
        api = cluster()
    except ClusterConfigError as exc:
        log.warning("pods: no pods from the Kubernetes API (%s); the pod list stays empty: node traffic is "
                    "counted, no pod is counted or shaped (or give --pods-file)", exc)
        return PodFeed(())
    return KubePodSource(api)
