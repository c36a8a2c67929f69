"""Settings of GPU time-slicing: NVIDIA k8s-device-plugin's `sharing.timeSlicing`, in the form its plugin acts on.

NVIDIA's plugin ignores `rename` and `devices` (api/config/v1 `DisableResourceNamingInConfig`, called by
cmd/nvidia-device-plugin/main.go), so what changes the served resources is the resource name, its replicas,
`renameByDefault` and `failRequestsGreaterThanOne`; that is this section. NVIDIA's file itself is read by
`agent.config.nvidia_file`, which fills it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from agent.config.fields import setting
from agent.config.resources import resource_name_problem

SHARED_SUFFIX = ".shared"  # NVIDIA's DefaultSharedResourceNameSuffix
# A kubelet list is one gRPC message (4 MiB by default) of ~60-byte entries: 1024 replicas of 8 GPUs is 8192
# entries, far beyond any real node's sharing and far below that limit
MAX_REPLICAS = 1024
ALLOCATION_POLICIES = ("distributed", "packed")  # NVIDIA's sharedDevicesAllocationPolicy values


@dataclass
class ReplicatedResourceConfig:
    """One GPU resource whose devices are each served as several replicas."""

    name: str = setting("", help="full resource name whose devices are replicated, e.g. nvidia.com/gpu or "
                                 "nvidia.com/mig-1g.10gb")
    replicas: int = setting(2, help="replicas per device (at least 2); replica IDs are <device ID>::<n>")

    def check(self) -> None:
        """A resource name the kubelet accepts and NVIDIA's replica bounds."""
        prefix, _, name = self.name.rpartition("/")
        problem = resource_name_problem(prefix, name, dots=True) if prefix else "needs a prefix, e.g. nvidia.com/gpu"
        if problem:
            raise ValueError(f"name: {self.name!r}: {problem}")
        if not 2 <= self.replicas <= MAX_REPLICAS:
            raise ValueError(f"replicas: {self.replicas} for {self.name}: number of replicas must be >= 2 "
                             f"(and at most {MAX_REPLICAS})")


@dataclass
class TimeSlicingConfig:
    """GPU time-slicing as NVIDIA's plugin serves it (`sharing.timeSlicing`)."""

    resources: list[ReplicatedResourceConfig] = setting(factory=list, help="resources to replicate")
    rename_by_default: bool = setting(False, help="serve the replicas as <name>.shared instead of <name>")
    fail_requests_greater_than_one: bool = setting(
        False, help="refuse an Allocate of more than one replica in a container (NVIDIA's error text)")

    def check(self) -> None:
        """Each resource is named once."""
        # counted once: names.count() per entry took 7.4 s for 19,000 aliases of one entry
        twice = sorted(name for name, seen in Counter(r.name for r in self.resources).items() if seen > 1)
        if twice:
            raise ValueError(f"resources: {', '.join(twice)} is listed twice")

    def served_name(self, name: str) -> str:
        """The resource the replicas of `name` are served as."""
        return name + SHARED_SUFFIX if self.rename_by_default else name

    def replicas(self, name: str) -> int | None:
        """Replicas per device of resource `name`, None when it is not shared."""
        return next((r.replicas for r in self.resources if r.name == name), None)
