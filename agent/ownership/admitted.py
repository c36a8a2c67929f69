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

Without a pod spec (no API access, or a pod the watch has not delivered yet) `Listings` and `new_holders` tell
the container from the kubelet's records alone: the one whose holding of partner devices (and none of R) is new
since the previous reading. The caller pairs with it when there is exactly one (see `Listings`).
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


SETTLE_S = 1.0  # a state first shown only by a poll is old after this long (an admission takes milliseconds)
BASELINE = float("-inf")  # `_Seen.since` of what the first reading after a start showed: held since before it


@dataclass
class _Seen:
    devices: Mapping[str, frozenset[str]]
    since: float  # start of the first List that showed the container holding exactly `devices`
    lookup_since: float | None  # start of the first admission lookup's List that showed it so


class Listings:
    """What earlier `List` replies showed of each container, to tell the container under admission without a pod
    spec (rule of the module docstring's second half).

    Without specs, the container under admission for resource R is a listed container holding partner devices
    and none of R whose holding was not so at the previous reading: the kubelet allocates a container's
    resources one after another and asks about R right after the partner's Allocate, so the state "holds the
    partner, none of R" is new at R's preference call. A state counts as seen before when an earlier admission
    lookup's List showed it, or a background poll did more than `settle` seconds before (a poll may land between
    the partner's Allocate and R's call; a GPU-only pod admitted since the last lookup is not new for long).
    Listings are applied in the order their Lists were sent, so a reply that comes back late never overwrites a
    newer one.

    A pod listed since an earlier reading than another listed pod has finished its admission: the kubelet lists a
    pod when its admission starts (podresources.md §5 step 1) and admits one pod at a time, so a pod that appeared
    later was admitted after it. Such a pod's containers are never the one under admission (a GPU-only pod
    admitted just before a NIC-first container, both seen by lookups, is told apart from a GPU-first container).

    The first reading after a start is the baseline: nothing it shows counts as new. Without it, every container
    holding partner devices after an agent restart would look newly so, and a NIC-first container would be
    paired with a GPU held since before the restart. The container under admission when it was taken (the rare
    call that beats the first poll) is then not found either: a fallback, never a wrong pairing.
    """

    def __init__(self, settle: float = SETTLE_S) -> None:
        self.settle = settle
        self.applied_at: float | None = None  # start of the newest List applied
        self._seen: dict[tuple[str, str, str], _Seen] = {}
        self._applied = 0  # Lists applied so far
        self._appeared: dict[tuple[str, str], int] = {}  # (namespace, pod) -> the applied List that first showed it
        self._newest = 0  # the latest of those

    def apply(self, containers: Iterable[ContainerDevices], started: float, *, lookup: bool) -> bool:
        """Remember one List reply sent at `started`; False (ignored) when a newer one is already applied."""
        if self.applied_at is not None and started < self.applied_at:
            return False
        since = started if self.applied_at is not None else BASELINE
        self.applied_at = started
        self._applied += 1
        seen: dict[tuple[str, str, str], _Seen] = {}
        appeared: dict[tuple[str, str], int] = {}
        for listed in containers:
            pod = (listed.namespace, listed.pod)
            appeared[pod] = self._appeared.get(pod, self._applied)
            before = self._seen.get(listed.key)
            if before is None or before.devices != listed.devices:
                before = _Seen(listed.devices, since, None)
            if lookup and before.lookup_since is None:
                before.lookup_since = started
            seen[listed.key] = before
        self._seen = seen
        self._appeared = appeared
        self._newest = max(appeared.values(), default=0)
        return True

    def admission_over(self, listed: ContainerDevices) -> bool:
        """Whether `listed`'s pod has finished its admission: another pod the kubelet lists appeared after it."""
        first = self._appeared.get((listed.namespace, listed.pod))
        return first is not None and first < self._newest

    def is_new(self, listed: ContainerDevices, started: float) -> bool:
        """Whether `listed` (from a List sent at `started`) holds what it holds since that reading only."""
        before = self._seen.get(listed.key)
        if before is None or before.devices != listed.devices:
            return True
        if before.lookup_since is not None and before.lookup_since < started:
            return False
        return before.since >= started - self.settle


def new_holders(containers: Iterable[ContainerDevices], resource: str, partners: Iterable[str],
                is_new: Callable[[ContainerDevices], bool]) -> list[Admission]:
    """Listed containers holding partner devices and none of `resource` whose holding `is_new` (no spec needed)."""
    partner_names = frozenset(partners)
    found: list[Admission] = []
    for listed in containers:
        held = {name: listed.of(name) for name in partner_names if listed.of(name)}
        if held and not listed.of(resource) and is_new(listed):
            found.append(Admission(listed.namespace, listed.pod, listed.container, held))
    return found
