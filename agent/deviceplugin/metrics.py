"""Prometheus metrics of the device-plugin servers: allocations by the PCIe level achieved, and preferences
that could not be given.

- `gpu_node_agent_allocations_total{resource,level}`: successful Allocate calls. `level` is the worst GPU-NIC
  level (`pix`, `pxb`, `phb`, `node`, `sys`) of the container the allocation belongs to, in a best one-to-one
  matching of its GPUs and NIC devices (`placement.policy.achieved_levels`); both resources of a GPU + NIC container
  are counted with the same level, once the second one is allocated. `none`: the agent saw no devices of the
  other kind for that container (a NIC-only or GPU-only container, GPUs served by another plugin, or the
  pairing was lost, e.g. past the admission context's time-out). A lone allocation is counted when the next
  call shows it had no partner (at once when the other kind is not served here). Which allocations form a
  container is the admission context's guess (`placement.admission`, `placement.joint`): a single-resource pod followed
  within its time-out by a pod of the other resource is counted as one container with the other's level.
- `gpu_node_agent_allocations_pix_missed_total{resource}`: allocations counted above with a level worse than `pix`
  although, at the container's second resource's preference call, the kubelet offered a device at PIX to the
  container's devices of the other kind as the agent knew them (the kubelet's facts, or the admission context's
  guess). `pix / (pix + pix_missed)` is the PIX fraction where PIX was possible; containers whose partner was
  unknown are in neither. NIC-only mode counts the NIC resource only (the GPUs are another plugin's).
- `gpu_node_agent_preferred_allocation_failures_total{resource,reason}`: GetPreferredAllocation container
  requests answered with no or a partial preference (never an error; the kubelet then picks itself).
  `reason` (`placement.policy.Reason`, decided by its one validation): `invalid_request` (the kubelet's request
  is inconsistent or names devices we do not serve),
  `policy_error` (the policy raised; a bug), `empty` (the policy found no valid answer), `short` (fewer devices
  than asked, because some of the offered ones are Unhealthy here).

Everything registers on the `CollectorRegistry` handed in (the agent's `/metrics` one), never on the global
default registry, so several managers (tests) can live in one process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter

from agent.placement.joint import NO_PAIR, PIX_MISSED
from agent.placement.policy import Reason
from agent.topology.model import Level

LEVEL_LABELS: tuple[str, ...] = (*(level.name.lower() for level in Level if level is not Level.X), NO_PAIR)
POLICY_ERROR = "policy_error"  # the policy raised: a bug, answered with no preference
FAILURE_REASONS: tuple[str, ...] = (*(reason.value for reason in Reason if reason is not Reason.OK), POLICY_ERROR)


class AllocationMetrics:
    """The device-plugin counters on one registry."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.allocations = Counter(
            "gpu_node_agent_allocations", "Successful Allocate calls by the worst GPU-NIC PCIe level of the "
            "container (none: no devices of the other kind seen for it)", ["resource", "level"],
            registry=self.registry)
        self.pix_missed = Counter(
            "gpu_node_agent_allocations_pix_missed", "Allocations worse than PIX to the container's other-kind "
            "devices although the kubelet offered a device at PIX to them", ["resource"], registry=self.registry)
        self.preference_failures = Counter(
            "gpu_node_agent_preferred_allocation_failures",
            "GetPreferredAllocation container requests answered with no or a partial preference",
            ["resource", "reason"], registry=self.registry)

    def add_resource(self, resource: str) -> None:
        """Create the resource's series at zero, so rates work from the first allocation on."""
        for label in LEVEL_LABELS:
            self.allocations.labels(resource, label)
        self.pix_missed.labels(resource)
        for reason in FAILURE_REASONS:
            self.preference_failures.labels(resource, reason)

    def allocated(self, resource: str, level: str) -> None:
        """One Allocate of `resource` for a container whose level is `level` (a LEVEL_LABELS value), or, for
        `PIX_MISSED`, one of them that could have been PIX."""
        if level == PIX_MISSED:
            self.pix_missed.labels(resource).inc()
        else:
            self.allocations.labels(resource, level).inc()

    def no_preference(self, resource: str, reason: str) -> None:
        """One container request answered with no or a partial preference, for `reason` (FAILURE_REASONS)."""
        self.preference_failures.labels(resource, reason).inc()
