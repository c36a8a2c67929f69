"""The kubelet's PodResources v1 API: which container holds which device (`port`), over its unix socket
(`client`), or from the stand-in kubelet's memory (`simulated`). Reference: podresources.md."""

from agent.host.podresources.port import (
    DEFAULT_SOCKET,
    ContainerDevices,
    PodResourcesError,
    PodResourcesPort,
    Reachability,
)

__all__ = ["DEFAULT_SOCKET", "ContainerDevices", "PodResourcesError", "PodResourcesPort", "Reachability"]
