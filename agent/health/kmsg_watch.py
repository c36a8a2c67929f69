"""The kernel-log producer: follow /dev/kmsg (or a file) and report NVRM Xid, bus-loss and UUID lines.

/dev/kmsg is pollable, so the event loop wakes the moment a record arrives (`loop.add_reader`); a plain file
cannot be polled and is re-read on a short interval instead. Either way a new Xid reaches the assessor within
one loop turn of being readable, which is what the one-second detection goal needs. The backlog read at start
(skipping what the saved cursor says was already handled) is this producer's first pass.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from agent import aio
from agent.health.assess import HealthAssessor
from agent.health.checks import Checks, CheckState
from agent.health.nvrm import FallenOffBus, GpuUuidLine, NvrmLine, XidLine, parse_nvrm_all
from agent.health.pci_kmsg import PciFault, parse_pci_fault
from agent.host.kmsg import KERNEL_FACILITY, KmsgCursor, KmsgReader, KmsgRecord

log = logging.getLogger(__name__)

DEVICE_WAKE_SECONDS = 1.0  # re-check the stop event this often even when the kernel is silent
MISSING_FILE_RETRY_SECONDS = 0.5


class KmsgWatcher:
    """Reads the kernel log and feeds NVRM events to the assessor; `cursor` is where to resume."""

    def __init__(self, path: str | Path, assessor: HealthAssessor, boot_id: str,
                 cursor: KmsgCursor | None = None, file_poll_interval: float = 0.05, *,
                 checks: Checks | None = None, pci_faults: Callable[[PciFault], None] | None = None) -> None:
        self.path = Path(path)
        self.pci_faults = pci_faults  # mlx5, AER and SXid lines go here (the NIC/PCIe producer)
        self.assessor = assessor
        self.checks = checks if checks is not None else Checks()
        self.boot_id = boot_id
        self.cursor = cursor
        self.file_poll_interval = file_poll_interval
        self.lost_records = 0
        self.records_read = 0
        self.skipped: dict[str, int] = {}  # reason -> NVRM events not acted on (not_kernel, foreign_device)
        self.resyncs = 0  # sequence numbers that could not be real (see KmsgReader)
        self._foreign_logged: set[str] = set()
        self.first_pass = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log until `stop` is set. OSError (missing file, permission) goes to the supervisor."""
        reader = KmsgReader(self.path, self.boot_id, self.cursor)
        if not await self._open(reader, stop):
            return
        lost_before, resyncs_before = self.lost_records, self.resyncs
        try:
            self.checks.set("kmsg", CheckState.OK)
            while not stop.is_set():
                records, more = reader.read_available()
                for record in records:
                    self._handle(record)
                self.records_read += len(records)
                self.cursor = reader.cursor()
                self.lost_records = lost_before + reader.lost
                self.resyncs = resyncs_before + reader.resyncs
                if more:
                    await asyncio.sleep(0)  # a long backlog: let the other producers run between batches
                    continue
                self.first_pass.set()
                if reader.is_device and reader.fileno is not None:
                    await _readable(reader.fileno, stop)
                else:
                    await aio.sleep_or_stop(stop, self.file_poll_interval)
        finally:
            reader.close()

    async def _open(self, reader: KmsgReader, stop: asyncio.Event) -> bool:
        """Open the log, waiting for it to appear (a simulation's file may come later); False when stopped."""
        said = False
        while not stop.is_set():
            try:
                reader.open()
                return True
            except FileNotFoundError:
                self.checks.set("kmsg", CheckState.UNAVAILABLE, f"no such file {self.path}")
                if not said:
                    log.warning("kernel log %s does not exist; waiting for it", self.path)
                    said = True
                self.first_pass.set()  # nothing to read yet is a finished first pass
                await aio.sleep_or_stop(stop, MISSING_FILE_RETRY_SECONDS)
        return False

    def _handle(self, record: KmsgRecord) -> None:
        if self.pci_faults is not None and record.facility == KERNEL_FACILITY:
            fault = parse_pci_fault(record.message)
            if fault is not None:
                self.pci_faults(fault)
                return
        lines = parse_nvrm_all(record.message)
        if not lines:
            return
        if record.facility != KERNEL_FACILITY:  # user space wrote it to /dev/kmsg: not the driver speaking
            self._skip("not_kernel", len(lines))
            return
        for line in lines:
            self._dispatch(line)

    def _dispatch(self, line: NvrmLine) -> None:
        if isinstance(line, GpuUuidLine):
            self.assessor.names.learn_uuid(line.device, line.uuid)
            return
        device = line.device if not isinstance(line, XidLine) or line.device_parsed else None
        if device is None or not self.assessor.names.is_local_kernel_device(device):
            self._skip_foreign(line)
            return
        if isinstance(line, XidLine):
            gpu = self.assessor.names.by_kernel_device(line.device)
            detail = line.detail if line.caused_by is None else f"caused by previous Xid {line.caused_by}"
            self.assessor.on_xid(gpu, line.code, "kmsg", detail[:120], gpu_instance=line.gpu_instance)
        else:
            gpu = self.assessor.names.by_kernel_device(line.device)
            self.assessor.on_gpu_lost(gpu, "kernel log: fallen off the bus", from_nvml=False)

    def _skip(self, reason: str, count: int = 1) -> None:
        self.skipped[reason] = self.skipped.get(reason, 0) + count

    def _skip_foreign(self, line: XidLine | FallenOffBus) -> None:
        """A device that is not an address of this node: never acted on, logged once per device."""
        self._skip("foreign_device")
        device = line.device[:64]
        if device not in self._foreign_logged and len(self._foreign_logged) < 64:
            self._foreign_logged.add(device)
            what = f"Xid {line.code}" if isinstance(line, XidLine) else "bus loss"
            log.warning("kernel log names %s on %r, which is not a GPU of this node; skipped (logged once per "
                        "device)", what, device)


async def _readable(fd: int, stop: asyncio.Event) -> None:
    """Return when `fd` is readable, `stop` is set, or DEVICE_WAKE_SECONDS passed."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(fd, ready.set)
    try:
        await aio.wait_any(ready, stop, timeout=DEVICE_WAKE_SECONDS)
    finally:
        loop.remove_reader(fd)
