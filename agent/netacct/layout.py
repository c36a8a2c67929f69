"""The accounting layout protocol: where netacct's counters live in the kernel, one implementation per layout.

Why a protocol: the engine's work (one lock, the counter book, migrations carrying totals, repairs) is the same
whichever kernel objects count. A layout only says whether its objects exist, reads them into the book, brings
them in line with the pods (preloaded with a migration's carry), and removes them; the engine picks one layout
once (`choose`) and migrates from any other it finds installed. Implementations: `ebpf_table.EbpfLayout` (tc
programs counting into pinned maps), `nft_table.NftLayout` (one native nftables table) and
`iptables_table.IptablesLayout` (mangle chains and ipsets); a further layout is one more class.

A migration between two layouts, as the engine runs it: the old one's `final_read` (into the book, returning the
raw values by layout-neutral identity), the new one's `begin_carry`, its `sync` with the carry, the old one's
`remove`, the new one's `end_carry`. The carry markers make a migration cut short safe (see engine): a new layout
that `holds_carry` already counts what the old one counted (finish: remove the old one); one whose
`install_interrupted` must be removed and migrated again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from agent.netacct import ipsets
from agent.netacct.carry import Carry, OldRaw
from agent.netacct.counters import CounterBook, PodKey

log = logging.getLogger(__name__)

Members = dict[int, set[ipsets.Member]]  # pod addresses per IP family


class SyncError(Exception):
    """A sync could not read or change the kernel state; the service logs it and retries."""


class NotReady(Exception):
    """A layout cannot count here: why, and what to do about it; `fallback`: `auto` goes on to the next layout."""

    def __init__(self, why: str, fix: str, *, fallback: bool = False) -> None:
        super().__init__(why)
        self.why = why
        self.fix = fix
        self.fallback = fallback


@dataclass(frozen=True)
class PodMembers:
    """The pod list as a layout needs it: address owners, and the addresses per family."""

    owners: dict[bytes, PodKey]
    members: Members


@dataclass(frozen=True)
class Desired:
    """What one sync of a layout is asked for.

    `pods`: the pod list (None: not known yet; the layout keeps the members it holds, or, when `installed_here`,
    those of `synced`). `installed_here`: this process brought the layout in line before, so anything that differs
    from `synced` (the pod addresses of that last sync) was changed by someone else and is a repair. `carry`: a
    migration's totals, preloaded into objects this sync creates (no repair is counted then)."""

    pods: PodMembers | None
    synced: Mapping[int, set[ipsets.Member]]
    installed_here: bool
    carry: Carry | None = None


def sync_members(desired: Desired, book: CounterBook, held: Callable[[], Members], *, keep_synced: bool) -> Members:
    """The pod addresses a sync installs: the pod list's (the book learns their owners); before it is known, those of
    the last sync when `keep_synced` (a repair: a deleted element stays), else what the objects hold now (`held`)."""
    if desired.pods is not None:
        book.set_pods(desired.pods.owners)
        return desired.pods.members
    if keep_synced:
        return {f: set(m) for f, m in desired.synced.items()}
    return held()


class Layout(Protocol):
    """One way of counting netacct's series in the kernel. Every method runs under the engine's lock."""

    name: str  # the config value and the `layout` label: nft, iptables

    @property
    def backend(self) -> str:
        """The `backend` label of gpu_node_agent_netacct_backend_info (no detection runs for it)."""

    def probe(self) -> str | None:
        """For `auto`: None when this layout counts here (tried for real: throw-away objects, removed), else why not.
        """

    def ready(self, auto: bool) -> str:
        """Read-only, for the doctor: what answers for this layout (one line naming it); NotReady when it cannot
        count here. `auto`: the layout would be chosen by `auto`."""

    def present(self) -> bool:
        """Whether any of this layout's objects exist (False where they cannot be looked for)."""

    def scrape(self) -> tuple[str, ...]:
        """Read every counter into the book; the errors of an incomplete read (kernel errors never raise)."""

    def drifted(self, synced: Mapping[int, set[ipsets.Member]]) -> bool:
        """Whether the installed objects differ from what a sync for the pod addresses `synced` wrote (someone
        else changed them): read-only."""

    def sync(self, desired: Desired) -> Members:
        """Bring the objects in line, changing only what differs; the pod addresses now installed."""

    def final_read(self) -> OldRaw:
        """As the old layout of a migration: read everything into the book a last time; the raw values read."""

    def carried_rule_families(self, families: tuple[int, ...]) -> tuple[int, ...] | None:
        """As the new layout: the families whose node counters can be preloaded (None: all of `families`)."""

    def begin_carry(self) -> None:
        """As the new layout, before anything is preloaded: mark an install that a kill would leave half-done."""

    def end_carry(self) -> None:
        """As the new layout, once the old one is gone: drop the migration's marker."""

    def holds_carry(self) -> bool:
        """Whether the objects hold a migration's carry while the old layout may still exist (finish it)."""

    def install_interrupted(self) -> bool:
        """Whether a migration into this layout stopped before its objects were complete (remove and redo)."""

    def follow_installed(self) -> None:
        """As the old layout while a migration waits for the pod list: read where its objects are."""

    def remove(self) -> list[str]:
        """Remove every object of this layout (both families, wherever it could be); what was removed."""


def choose(configured: str, layouts: Sequence[Layout]) -> Layout:
    """The layout to count with, chosen once: the configured one, or for `auto` the first of `layouts` (in order of
    preference) whose probe says it counts here; the last one is the fallback and is not probed."""
    if configured != "auto":
        return next(layout for layout in layouts if layout.name == configured)
    passed: list[str] = []
    for layout in layouts[:-1]:
        why = layout.probe()
        if why is None:
            if passed:  # one line saying what was chosen and why the preferred ones were not
                log.warning("netacct: %s; using the %s layout", "; ".join(passed), layout.name)
            else:
                log.info("netacct: using the %s layout", layout.name)
            return layout
        passed.append(f"the {layout.name} layout does not work here ({why})")
    # one line saying what was chosen and why the preferred ones were not
    log.warning("netacct: %s; using the %s layout", "; ".join(passed) or "no layout to probe", layouts[-1].name)
    return layouts[-1]


def readiness(configured: str, layouts: Sequence[Layout]) -> str:
    """For the doctor, read-only: the layout `configured` names (`auto`: the first of `layouts` that answers, its
    probe packet left to the agent's start) and what answers for it; NotReady when it cannot count here."""
    candidates = list(layouts) if configured == "auto" else [layout for layout in layouts if layout.name == configured]
    passed: list[str] = []
    for layout in candidates:
        try:
            detail = layout.ready(auto=configured == "auto")
        except NotReady as exc:
            if not exc.fallback:
                raise
            if configured != "auto":
                raise NotReady(f"layout {layout.name}, but {exc.why}", exc.fix) from exc
            if layout is candidates[-1]:
                raise
            passed.append(f"{layout.name}: {exc.why}")
            continue
        return detail.replace(":", f" ({'; '.join(passed)}):", 1) if passed else detail
    raise NotReady(f"no layout named {configured}", "set netacct.layout to auto, ebpf, nft or iptables")
