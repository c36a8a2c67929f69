"""Publication of the verdict book: device health to its one owner, the node verdict to its latest-value cell.

Device health is published from the start (an Unhealthy device must leave the kubelet's pool at once). The
node verdict is held back until `open()`, which the service calls after every producer has looked once: an
early "healthy" could otherwise lift a cordon that a real, not yet re-read fault justifies. Repeats change
nothing, so they publish nothing: that, plus the Xid counter's bursts, keeps floods out of logs and actions.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from agent.health.findings import Finding
from agent.health.verdict import VerdictBook
from agent.signals import HEALTHY, DeviceHealth, Latest, NodeVerdict
from agent.topology.model import Topology

log = logging.getLogger(__name__)


class HealthPublisher:
    """Writes what the book says into the shared contracts (`agent.signals`)."""

    def __init__(self, device_health: DeviceHealth, verdicts: Latest[NodeVerdict],
                 topology: Callable[[], Topology] | None = None,
                 findings_listener: Callable[[Sequence[Finding]], None] | None = None) -> None:
        self.device_health = device_health
        self.findings_listener = findings_listener  # told the active findings on every publication (NVSentinel)
        self.topology = topology  # the node now: an Unhealthy GPU's MIG devices are Unhealthy too
        self.verdicts = verdicts
        self.current: NodeVerdict = HEALTHY
        self._open = False

    def publish(self, book: VerdictBook) -> None:
        """After every observation: device flips to the owner (an Unhealthy GPU takes its MIG devices with it);
        a changed verdict logged (and published if open)."""
        unhealthy = book.unhealthy_devices()
        topology = self.topology() if self.topology is not None else None
        for gpu in topology.gpus if topology is not None else ():
            if gpu.uuid in unhealthy:
                for mig in gpu.mig_devices:
                    unhealthy.setdefault(mig.uuid, unhealthy[gpu.uuid])
        unknown = book.unknown_devices()
        for gpu in topology.gpus if topology is not None else ():
            if gpu.uuid in unknown:
                unknown |= {mig.uuid for mig in gpu.mig_devices if mig.uuid in unhealthy}
        self.device_health.replace(unhealthy, unknown=unknown)
        if self.findings_listener is not None:
            self.findings_listener(book.findings())
        verdict = book.verdict()
        if verdict == self.current:
            return
        level = logging.WARNING if verdict.severity > self.current.severity else logging.INFO
        change = f"{self.current.verdict} -> {verdict.verdict}" if verdict.severity != self.current.severity \
            else f"{verdict.verdict}, reasons changed" if verdict.reasons != self.current.reasons \
            else f"{verdict.verdict}, GPU reset advised for: {', '.join(verdict.reset_advised) or 'none'}"
        log.log(level, "node verdict %s%s", change, f": {'; '.join(verdict.reasons)}" if verdict.reasons else "",
                extra={"verdict": verdict.verdict})
        self.current = verdict
        if self._open:
            self.verdicts.set(verdict)

    def open(self) -> None:
        """The first pass is done: publish the current verdict and every change after."""
        self._open = True
        self.verdicts.set(self.current)
