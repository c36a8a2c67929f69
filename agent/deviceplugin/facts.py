"""The kubelet's facts for the device plugin's placement, from `agent.ownership`: one value per preference call
(`placement.policy.Partner`) with the partner devices of the container under admission (known, or the
candidates, or unknown and why) and the other kind's free devices. Nothing is kept between calls.

Partner resources are the served pools of the other kind and, when GPUs are not served here (NIC-only mode),
the other plugin's GPU resource (`--gpu-resource-name`). Several containers newly holding partner devices (no
pod spec tells them apart) are paired with only when their partner devices sit under the same switches, where
the choice is the same whichever is the one under admission; under different switches the lookup first fetches
the specs the pod watch lacks (with API access), which usually tells them apart.

When the partner is not known (`gpu_node_agent_preference_fallbacks_total{reason}` counts why), the policy still
prefers devices under switches where the other kind is free: the kubelet's free devices at the last reading,
however old (after a failed lookup the container's partner, allocated since, is among them), or, when several
containers newly hold partner devices, only theirs (the one under admission is among them; the allocator
chooses between the two). Without any reading the other kind is unknown and all of it counts as free. For a
kind served here (joint mode) it is the served devices no listed container holds, in the servers' own IDs (a
time-sliced GPU's replicas: a GPU with a free replica is free), their health the servers' own (not the
reading's allocatable, which can predate a restarted agent's registration), intersected with the allocator's
estimate, and only while fresh (three poll intervals).
`no_new_holder` (the kubelet answered, nobody newly holds the other kind) is still counted as a fallback but
passed on as "holds none yet", so joint mode's admission-context guess does not pair the container with a
single-resource pod admitted just before it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

from agent.deviceplugin.pools import ResourcePool, mig_resource_name
from agent.ownership.admitted import Admission
from agent.ownership.service import OwnershipService
from agent.placement.policy import DeviceKind, Partner
from agent.placement.replicas import physical
from agent.placement.tree import switch_groups

STALE_POLLS = 3


class OwnershipFacts:
    """`partner` is a `server.PartnerLookup`."""

    def __init__(self, service: OwnershipService, pools: Callable[[], Iterable[ResourcePool]],
                 gpu_resource_name: str) -> None:
        self.service = service
        self._pools = pools
        self.gpu_resource_name = gpu_resource_name

    def _resources(self, kind: DeviceKind, pools: Sequence[ResourcePool]) -> list[str]:
        names = [p.resource_name for p in pools if p.kind == kind.value]
        if kind is DeviceKind.GPU and not names:
            names.append(self.gpu_resource_name)  # GPUs served by another plugin, with its MIG resources (mixed)
            topology = next((p.topology for p in pools if p.topology is not None), None)
            prefix = self.gpu_resource_name.rpartition("/")[0]
            profiles = {m.profile for g in (topology.gpus if topology else ()) for m in g.mig_devices}
            names.extend(f"{prefix}/{mig_resource_name(profile)}" for profile in sorted(profiles))
        return names

    async def partner(self, pool: ResourcePool) -> Partner:
        """What the kubelet's records say about the container under admission's devices of the other kind, and
        that kind's free devices."""
        other = DeviceKind.NIC if pool.kind == DeviceKind.GPU.value else DeviceKind.GPU

        def same_switches(candidates: Sequence[Admission]) -> bool:
            if pool.topology is None:
                return False
            groups = {switch_groups(pool.topology, other is DeviceKind.GPU, c.partner_ids) for c in candidates}
            return len(groups) == 1 and None not in groups

        pools = list(self._pools())  # once per call: the lookup and the free devices read the same pools
        resources = self._resources(other, pools)
        found = await self.service.lookup(pool.resource_name, resources, alike=same_switches)
        free = self._free(resources, [p for p in pools if p.kind == other.value])
        if found.found is not None:
            return Partner(held=found.found.partner_ids, free=free)
        held = [c.partner_ids for c in found.candidates]
        candidates: frozenset[str] = frozenset()
        if held and pool.topology is not None:
            if same_switches(found.candidates):
                return Partner(held=min(held, key=sorted), free=free)  # same switches: the same choice either way
            candidates = frozenset().union(*held)
        self.service.fell_back(found.reason)
        if found.reason == "no_new_holder":
            # the kubelet answered and nobody newly holds the other kind: the container holds none of it yet (its
            # other resource comes later). Saying so keeps joint mode's admission-context guess from pairing it
            # with a single-resource pod admitted just before; the policy aligns with free devices instead.
            return Partner(held=frozenset(), reason=found.reason, candidates=candidates, free=free)
        return Partner(reason=found.reason, candidates=candidates, free=free)

    def _free(self, resources: Sequence[str], served: Sequence[ResourcePool]) -> frozenset[str] | None:
        """The kubelet's free devices of the other kind (its `resources`, those `served` here) at the last reading;
        None when it was never read, or (a kind served here) the reading is too old to beat the allocator's own
        estimate."""
        latest, read_at = self.service.latest, self.service.read_at
        if latest is None or read_at is None:
            return None
        if served and self.service.monotonic() - read_at > STALE_POLLS * self.service.poll_interval:
            return None  # the allocator's own estimate of its own devices is better than an old reading
        if served:
            # who holds them from the kubelet's records, their health from the servers (the allocator intersects):
            # the allocatable reading may predate this agent's registration (right after a restart the kubelet
            # has none of a disconnected plugin's devices as healthy until its successor's first ListAndWatch).
            # In the servers' own IDs, as the allocator's estimate: a time-sliced GPU's replicas, not its UUID
            held = {i for resource in resources for i in latest.held(resource)}
            return frozenset(i for p in served for i in p.ids) - held
        free: set[str] = set()
        for resource in resources:
            of_resource = latest.free(resource)
            if of_resource is None:
                return None
            free |= {physical(i) for i in of_resource}
        return frozenset(free)
