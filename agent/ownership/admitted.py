"""Which container is being admitted right now, and which devices of the other kind it already holds.

The kubelet admits one pod at a time and allocates a container's device resources one after another, in a
random order; PodResources `List` already shows the pod under admission, with the devices of the resources
allocated so far (podresources.md §5). So during a preference call for resource R, the container being
admitted is a listed container whose pod spec asks for R and that has no R devices yet. Those devices of the
*partner* resources (GPU for a NIC call, NIC for a GPU call) that it holds are the facts placement aligns with.

Several such containers (a pod whose later containers also ask for R): the one already holding partner devices
is the one being admitted (the kubelet finishes a container before the next); if none holds any, the answer is
"no partner devices yet" (its partner resource comes later, or it has none), which is exact too. Unknown
(return None, the caller falls back): no pod spec for any listed container that asks for R, or more than one
candidate holding partner devices. A device-plugin call carries no pod identity, so this is the closest the
API lets a plugin get; ordinary init containers are not listed and are never found (their preference calls
fall back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass

from agent.host.podresources import ContainerDevices
from agent.kube.model import PodView

SpecLookup = Callable[[str, str], PodView | None]  # (namespace, name) -> the pod spec, None when unknown


@dataclass(frozen=True)
class Admission:
    """The container under admission and the partner devices it holds (empty: none yet)."""

    namespace: str
    pod: str
    container: str
    partner_devices: Mapping[str, frozenset[str]]

    @property
    def partner_ids(self) -> frozenset[str]:
        """All partner devices, whatever their resource."""
        return frozenset(i for ids in self.partner_devices.values() for i in ids)


def requests_of(spec: PodView | None, container: str) -> frozenset[str] | None:
    """Extended resources the named container asks for; None when the spec or container is unknown."""
    if spec is None:
        return None
    for entry in spec.containers:
        if entry.name == container and (not entry.init or entry.sidecar):
            return entry.resources
    return None


def admitted_container(containers: Iterable[ContainerDevices], resource: str, partners: Iterable[str],
                       specs: SpecLookup) -> Admission | None:
    """The container being admitted for `resource` (see the module docstring); None when it cannot be told."""
    partner_names = frozenset(partners)
    candidates: list[tuple[ContainerDevices, dict[str, frozenset[str]]]] = []
    for listed in containers:
        if listed.of(resource):
            continue  # already holds `resource`: admitted before, or this is not its call
        wanted = requests_of(specs(listed.namespace, listed.pod), listed.container)
        if wanted is None or resource not in wanted:
            continue
        held = {name: listed.of(name) for name in partner_names if listed.of(name)}
        candidates.append((listed, held))
    if not candidates:
        return None
    holding = [(c, held) for c, held in candidates if held]
    if len(holding) > 1:
        return None
    chosen, held = holding[0] if holding else (candidates[0][0], {})
    return Admission(chosen.namespace, chosen.pod, chosen.container, held)
