"""The shaping engine: brings the node's tc objects in line with the pods' limits, and reads their counters.

`sync` is a reconcile: it reads everything of ours once (`TcPort.read`), works out per pod what should be on its
host-side interface and IFB, and changes only what differs (a new limit is a class change in place), so a restart
finds its objects and adds no duplicates. Objects of ours on interfaces no pod wants them on are removed
(redirects before the IFBs they point at: a redirect into a deleted IFB drops every internet upload of the pod).
A pod whose interface is not found yet (its CNI is still wiring it, or a bridge has not resolved its MAC) is
`pending` and retried; an interface with someone else's root qdisc or ingress filters is a `conflict`, reported
and left alone. One lock serialises syncs and scrapes (the netlink socket is not shared between threads).
"""

from __future__ import annotations

import hashlib
import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from agent.config.shaping import Limits
from agent.host.tc import IFB_PREFIX, DeviceShaping, Network, ShaperCounters, TcError, TcPort, TcState, exemptions
from agent.pods.model import Pod
from agent.shaping.limits import Problem, resolve

log = logging.getLogger(__name__)

PodKey = tuple[str, str]
STATES = ("shaped", "pending", "conflict", "error")


def ifb_name(pod: Pod) -> str:
    """The pod's IFB: a fixed prefix and a hash of its UID (or namespace/name), within the 15-byte limit."""
    identity = pod.uid or f"{pod.namespace}/{pod.name}"
    return IFB_PREFIX + hashlib.sha256(identity.encode()).hexdigest()[:11]


@dataclass(frozen=True)
class PodShaping:
    """What one round decided for a pod with limits."""

    limits: Limits
    state: str  # one of STATES
    detail: str = ""
    index: int | None = None  # host-side interface
    ifb: str = ""


@dataclass
class SyncReport:
    """The outcome of one sync: per pod with limits, and the annotation problems found."""

    pods: dict[PodKey, PodShaping] = field(default_factory=dict)
    problems: dict[PodKey, tuple[Pod, tuple[Problem, ...]]] = field(default_factory=dict)
    removed: list[str] = field(default_factory=list)
    ifb_index: dict[str, int] = field(default_factory=dict)  # our IFBs after the sync (for counter reads)

    def count(self, state: str) -> int:
        """Pods in `state`."""
        return sum(1 for p in self.pods.values() if p.state == state)


@dataclass(frozen=True)
class PodCounters:
    """A shaped pod's limits and its shapers' counters (per direction)."""

    limits: Limits
    counters: dict[str, ShaperCounters]


class Shaper:
    """Installs, reads and removes per-pod internet shapers through a `TcPort`."""

    def __init__(self, port: TcPort, internal: Sequence[Network], defaults: Mapping[str, Limits]) -> None:
        self.port = port
        self.defaults = dict(defaults)
        self.download_exempt = exemptions(internal, source=True)
        self.upload_exempt = exemptions(internal, source=False)
        self.last = SyncReport()
        self.syncs = 0
        self.sync_failures = 0
        self.invalid_annotations = 0  # annotation values refused, each counted once per pod, annotation and value
        self._invalid_seen: set[tuple[str, str, str]] = set()
        self._lock = threading.Lock()
        self._reported: set[tuple[PodKey, str]] = set()  # conflicts already logged
        self._ifbs: dict[str, int] = {}  # IFB name -> index, as this sync left them

    def close(self) -> None:
        """Release the port (shapers stay)."""
        self.port.close()

    # -- deciding ----------------------------------------------------------------------------------------------

    def _wanted(self, pods: Sequence[Pod], report: SyncReport) -> dict[int, tuple[Pod, Limits]]:
        wanted: dict[int, tuple[Pod, Limits]] = {}
        for pod in pods:
            limits, problems = resolve(pod.namespace, pod.annotation_map, self.defaults)
            if problems:
                report.problems[(pod.namespace, pod.name)] = (pod, problems)
            if not limits:
                continue
            key = (pod.namespace, pod.name)
            link = next((found for ip in pod.ips if (found := self.port.host_interface(ip)) is not None), None)
            if link is None:
                report.pods[key] = PodShaping(limits, "pending", "host-side interface not found yet")
            elif link.kind != "veth" or link.index in wanted:
                why = (f"{link.name} is a {link.kind}, not a pod's own interface" if link.index not in wanted
                       else f"{link.name} is shared with pod {'/'.join(wanted[link.index][0].key)}")
                report.pods[key] = PodShaping(limits, "conflict", why, link.index)
            else:
                wanted[link.index] = (pod, limits)
                report.pods[key] = PodShaping(limits, "shaped", link.name, link.index, ifb_name(pod))
        return wanted

    # -- changing ----------------------------------------------------------------------------------------------

    def sync(self, pods: Sequence[Pod] | None) -> SyncReport:
        """Reconcile with `pods` (None: pods unknown yet, change nothing)."""
        with self._lock:
            if pods is None:
                return self.last
            try:
                report = self._sync(pods)
            except Exception:  # counted whatever it is: a failed sync must show in the metrics, not only the log
                self.sync_failures += 1
                raise
            self.syncs += 1
            self.last = report
            self._count_invalid(report)
            return report

    def _count_invalid(self, report: SyncReport) -> None:
        current = {(pod.uid or f"{namespace}/{name}", problem.annotation, problem.value)
                   for (namespace, name), (pod, problems) in report.problems.items() for problem in problems}
        self.invalid_annotations += len(current - self._invalid_seen)
        self._invalid_seen = current  # a pod gone or fixed is forgotten; breaking it again counts again

    def _sync(self, pods: Sequence[Pod]) -> SyncReport:
        report = SyncReport()
        self._ifbs = {}
        wanted = self._wanted(pods, report)
        state = self.port.read()
        needed_ifbs = {ifb_name(pod) for pod, limits in wanted.values() if limits.egress is not None}
        unhooked: set[int] = set()
        for index, current in state.devices.items():  # ours where no pod wants it (any more)
            pod_limits = wanted.get(index, (None, Limits()))[1]
            if current.upload_ifb is not None and pod_limits.egress is None:
                self.port.unshape_upload(index)
                unhooked.add(index)
                report.removed.append(f"upload shaper on interface {index}")
            if current.download_bps is not None and pod_limits.ingress is None:
                self.port.unshape_download(index)
                report.removed.append(f"download shaper on interface {index}")
        for name in sorted(state.ifbs.keys() - needed_ifbs):
            index = state.ifbs[name].index
            for device, current in state.devices.items():  # nothing may still redirect into it
                if current.upload_ifb == index and device not in unhooked:
                    self.port.unshape_upload(device)
            self.port.delete_ifb(name)
            report.removed.append(f"IFB {name}")
        if report.removed:
            state = self.port.read()
        for index, (pod, limits) in wanted.items():
            key = (pod.namespace, pod.name)
            try:
                self._shape(index, pod, limits, state)
            except TcError as exc:
                report.pods[key] = PodShaping(limits, "error", str(exc), index)
                log.warning("shaping: pod %s/%s on interface %d: %s; retrying", pod.namespace, pod.name, index, exc)
        report.ifb_index = self._ifbs
        for key, shaping in report.pods.items():
            if shaping.state == "conflict" and (key, shaping.detail) not in self._reported:
                self._reported.add((key, shaping.detail))
                log.warning("shaping: pod %s/%s not shaped: %s", key[0], key[1], shaping.detail)
        if report.removed:
            log.info("shaping: removed %s", ", ".join(report.removed))
        return report

    def _shape(self, index: int, pod: Pod, limits: Limits, state: TcState) -> None:
        current = state.devices.get(index) or DeviceShaping(foreign=state.foreign.get(index, ""))
        if current.foreign:
            raise TcError(f"interface {index} has another owner: {current.foreign}")
        down_exempt = frozenset(self.download_exempt)
        if limits.ingress is None:
            if current.download_bps is not None:
                self.port.unshape_download(index)
        elif current.download_bps is None or current.download_exempt != down_exempt or not current.download_leaf:
            self.port.shape_download(index, limits.ingress, self.download_exempt)
            log.info("shaping: pod %s/%s downloads limited to %d bit/s", pod.namespace, pod.name, limits.ingress)
        elif current.download_bps != limits.ingress:
            self.port.set_download_rate(index, limits.ingress)
            log.info("shaping: pod %s/%s download limit now %d bit/s", pod.namespace, pod.name, limits.ingress)
        if limits.egress is None:
            if current.upload_ifb is not None:
                self.port.unshape_upload(index)
            return
        self._shape_upload(index, pod, limits.egress, current, state)

    def _shape_upload(self, index: int, pod: Pod, rate: int, current: DeviceShaping, state: TcState) -> None:
        name = ifb_name(pod)
        ifb = state.ifbs.get(name)
        if ifb is None or ifb.rate_bps != rate or not ifb.leaf or not ifb.up:
            ifb_index = self.port.ensure_ifb(name, rate)
            log.info("shaping: pod %s/%s uploads limited to %d bit/s (%s)", pod.namespace, pod.name, rate, name)
        else:
            ifb_index = ifb.index
        self._ifbs[name] = ifb_index
        if current.upload_ifb != ifb_index or current.upload_exempt != frozenset(self.upload_exempt):
            self.port.shape_upload(index, ifb_index, self.upload_exempt)

    # -- reading and removing ----------------------------------------------------------------------------------

    def scrape(self) -> dict[PodKey, PodCounters]:
        """Counters of every shaped pod (as of the last sync's mapping of pods to interfaces)."""
        with self._lock:
            shaped = {k: p for k, p in self.last.pods.items() if p.state == "shaped"}
            if not shaped:
                return {}
            ingress = {key: shaping.index for key, shaping in shaped.items()
                       if shaping.limits.ingress is not None and shaping.index is not None}
            egress = {key: ifb for key, shaping in shaped.items() if shaping.limits.egress is not None
                      and (ifb := self.last.ifb_index.get(shaping.ifb)) is not None}
            leaves = self.port.counters([*ingress.values(), *egress.values()])  # only the shaped interfaces
        out: dict[PodKey, PodCounters] = {}
        for key, shaping in shaped.items():
            counters: dict[str, ShaperCounters] = {}
            if key in ingress and ingress[key] in leaves:
                counters["ingress"] = leaves[ingress[key]]
            if key in egress and egress[key] in leaves:
                counters["egress"] = leaves[egress[key]]
            out[key] = PodCounters(shaping.limits, counters)
        return out

    def remove_all(self) -> list[str]:
        """Remove every shaper and IFB of ours (redirects first); what was removed."""
        with self._lock:
            state = self.port.read()
            removed: list[str] = []
            for index, current in state.devices.items():
                if current.upload_ifb is not None or current.upload_exempt:
                    self.port.unshape_upload(index)
                    removed.append(f"upload redirect on interface {index}")
                if current.download_bps is not None:
                    self.port.unshape_download(index)
                    removed.append(f"download shaper on interface {index}")
            for name in sorted(state.ifbs):
                self.port.delete_ifb(name)
                removed.append(f"IFB {name}")
            self.last = SyncReport()
            return removed
