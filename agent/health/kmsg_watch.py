"""The kernel-log producer: follow /dev/kmsg (or a file) and report NVRM Xid, bus-loss and UUID lines.

/dev/kmsg is pollable, so the event loop wakes the moment a record arrives (`loop.add_reader`); a plain file
cannot be polled and is re-read on a short interval instead. Either way a new Xid reaches the assessor within
one loop turn of being readable, which is what the one-second detection goal needs. The backlog read at start
(skipping what the saved cursor says was already handled) is this producer's first pass.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

from agent import aio
from agent.health.assess import HealthAssessor
from agent.health.nvrm import FallenOffBus, GpuUuidLine, XidLine, parse_nvrm
from agent.host.kmsg import KmsgCursor, KmsgReader, KmsgRecord

log = logging.getLogger(__name__)

DEVICE_WAKE_SECONDS = 1.0  # re-check the stop event this often even when the kernel is silent
MISSING_FILE_RETRY_SECONDS = 0.5


class KmsgWatcher:
    """Reads the kernel log and feeds NVRM events to the assessor; `cursor` is where to resume."""

    def __init__(self, path: str | Path, assessor: HealthAssessor, boot_id: str,
                 cursor: KmsgCursor | None = None, file_poll_interval: float = 0.05) -> None:
        self.path = Path(path)
        self.assessor = assessor
        self.boot_id = boot_id
        self.cursor = cursor
        self.file_poll_interval = file_poll_interval
        self.lost_records = 0
        self.records_read = 0
        self.first_pass = asyncio.Event()

    async def run(self, stop: asyncio.Event) -> None:
        """Follow the log until `stop` is set. OSError (missing file, permission) goes to the supervisor."""
        reader = KmsgReader(self.path, self.boot_id, self.cursor)
        if not await self._open(reader, stop):
            return
        lost_before = self.lost_records
        try:
            self.assessor.checks["kmsg"] = "ok"
            while not stop.is_set():
                records, more = reader.read_available()
                for record in records:
                    self._handle(record)
                self.records_read += len(records)
                self.cursor = reader.cursor()
                self.lost_records = lost_before + reader.lost
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
                self.assessor.checks["kmsg"] = f"unavailable: no such file {self.path}"
                if not said:
                    log.warning("kernel log %s does not exist; waiting for it", self.path)
                    said = True
                self.first_pass.set()  # nothing to read yet is a finished first pass
                await aio.sleep_or_stop(stop, MISSING_FILE_RETRY_SECONDS)
        return False

    def _handle(self, record: KmsgRecord) -> None:
        line = parse_nvrm(record.message)
        if line is None:
            return
        if isinstance(line, XidLine):
            gpu = self.assessor.gpu_by_kernel_device(line.device, line.device_parsed)
            detail = line.detail if line.caused_by is None else f"caused by previous Xid {line.caused_by}"
            self.assessor.on_xid(gpu, line.code, "kmsg", detail[:120], gpu_instance=line.gpu_instance)
        elif isinstance(line, FallenOffBus):
            gpu = self.assessor.gpu_by_kernel_device(line.device)
            self.assessor.on_gpu_lost(gpu, "kernel log: fallen off the bus", from_nvml=False)
        elif isinstance(line, GpuUuidLine):
            self.assessor.learn_uuid(line.device, line.uuid)


async def _readable(fd: int, stop: asyncio.Event) -> None:
    """Return when `fd` is readable, `stop` is set, or DEVICE_WAKE_SECONDS passed."""
    loop = asyncio.get_running_loop()
    ready = asyncio.Event()
    loop.add_reader(fd, ready.set)
    try:
        await aio.wait_any(ready, stop, timeout=DEVICE_WAKE_SECONDS)
    finally:
        loop.remove_reader(fd)
