"""What the health checks keep across agent restarts, in one JSON file in the state dir.

Two things must survive a restart within one boot: the kernel-log cursor (boot id + last sequence number, and
for a plain file its inode and offset), so old Xids are not replayed into new actions; and the GPU faults still
waiting for a reset, so a restarted agent does not report a broken GPU Healthy. With a dcgm-exporter source,
the exporter's per-GPU Xid totals as last scraped, so Xids it counted while the agent was down are acted on after
the restart instead of vanishing into a new baseline. A new boot id means the node
rebooted: the cursor belongs to the old buffer and every reset-class fault is cleared by the reboot.
The file is replaced atomically (write, fsync, rename); a write error is logged once and retried later.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agent.health.findings import Clears, Finding
from agent.host.kmsg import KmsgCursor
from agent.signals import Severity

log = logging.getLogger(__name__)

STATE_FILE = "health-state.json"
STATE_VERSION = 1


@dataclass
class SavedHealth:
    """The restart-surviving part of the health checks."""

    boot_id: str = ""
    kmsg_path: str = ""
    cursor: KmsgCursor | None = None
    awaiting_reset: list[Finding] = field(default_factory=list)
    dcgm_url: str = ""
    dcgm_xid_totals: dict[str, float] | None = None  # None: never scraped (the first scrape is a baseline)


def _finding_to_json(finding: Finding) -> dict[str, Any]:
    return {"key": finding.key, "severity": finding.severity.value, "reason": finding.reason,
            "devices": list(finding.devices), "gpu_uuid": finding.gpu_uuid, "code": finding.code,
            "hardware": finding.hardware}


def _finding_from_json(data: dict[str, Any]) -> Finding:
    return Finding(str(data["key"]), Severity.parse(str(data["severity"])), str(data["reason"]), Clears.RESET,
                   tuple(str(d) for d in data.get("devices", ())), str(data.get("gpu_uuid", "")),
                   code=str(data.get("code", "GpuFault")), hardware=bool(data.get("hardware", False)))


class StateStore:
    """Load and save `SavedHealth` as `<state dir>/health-state.json`."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir) / STATE_FILE
        self._write_failed = False

    def load(self, boot_id: str) -> SavedHealth:
        """What was saved during this boot; an empty value after a reboot or when nothing usable is there."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return SavedHealth(boot_id)
        except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested absurdly deep
            log.warning("ignoring unreadable health state %s (%s); old kernel-log Xids may be counted again",
                        self.path, exc)
            return SavedHealth(boot_id)
        try:
            saved_boot = str(data.get("boot_id", ""))
            if data.get("version") != STATE_VERSION or saved_boot != boot_id:
                if saved_boot != boot_id:
                    log.info("new boot (was %s, now %s): starting with a fresh kernel-log cursor and no GPU faults",
                             saved_boot or "?", boot_id or "?")
                return SavedHealth(boot_id)
            kmsg = data.get("kmsg") or {}
            cursor = KmsgCursor(boot_id, _int(kmsg.get("seq")), _int(kmsg.get("inode")), _int(kmsg.get("offset")))
            faults = [_finding_from_json(item) for item in data.get("awaiting_reset", [])]
            dcgm = data.get("dcgm") or {}
            totals = dcgm.get("xid_totals")
            xid_totals = {str(k): float(v) for k, v in totals.items()} if isinstance(totals, dict) else None
            return SavedHealth(boot_id, str(kmsg.get("path", "")), cursor, faults, str(dcgm.get("url", "")),
                               xid_totals)
        except (AttributeError, KeyError, TypeError, ValueError) as exc:
            log.warning("ignoring malformed health state %s (%s)", self.path, exc)
            return SavedHealth(boot_id)

    def save(self, saved: SavedHealth) -> bool:
        """Write atomically; False (logged once per failure streak) when it could not."""
        cursor = saved.cursor or KmsgCursor(saved.boot_id)
        data = {"version": STATE_VERSION, "boot_id": saved.boot_id,
                "kmsg": {"path": saved.kmsg_path, "seq": cursor.seq, "inode": cursor.inode, "offset": cursor.offset},
                "awaiting_reset": [_finding_to_json(f) for f in saved.awaiting_reset]}
        if saved.dcgm_xid_totals is not None:
            data["dcgm"] = {"url": saved.dcgm_url, "xid_totals": saved.dcgm_xid_totals}
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=".health-state.", dir=self.path.parent)
            try:
                with os.fdopen(fd, "w", encoding="utf-8") as out:
                    json.dump(data, out, indent=1)
                    out.flush()
                    os.fsync(out.fileno())
                os.replace(tmp, self.path)
            except BaseException:
                Path(tmp).unlink(missing_ok=True)
                raise
        except OSError as exc:
            if not self._write_failed:
                log.error("cannot save health state to %s (%s); after a restart old Xids may be acted on again "
                          "- check --state-dir", self.path, exc)
            self._write_failed = True
            return False
        self._write_failed = False
        return True


def _int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None
