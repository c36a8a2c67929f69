"""The NVLink, fabric and recovery-action rules: what NVML says about each GPU in, findings out.

Pure (no I/O; time comes in as an argument), so each rule is tested on plain values; `gpu_state_watch` reads
NVML and hands the findings to the assessor.

- NVLink: a GPU's link is judged against its peers, never alone: boards differ (a PCIe board without a bridge
  reports every link inactive, some SKUs leave link slots unused), so a link counts as missing on a GPU when it
  is inactive there while at least half of the other NVLink GPUs have it active, and a GPU with fewer active
  links than its peers' median is short even where link numbers differ. A GPU without NVLink, or a node with one
  NVLink GPU, gives nothing.
- Fabric (NVSwitch systems, `nvmlGpuFabricInfo`): registration not started / in progress for longer than the
  grace time (counted from when this agent first saw it so), completed with a failure status, or a health
  summary / mask saying unhealthy is `gpu_fabric`; degraded bandwidth, limited capacity or a route recovery in
  progress is `gpu_fabric_degraded`. NOT_SUPPORTED gives nothing.
- Recovery action: anything but NONE is a finding on that GPU carrying the driver's request
  (`Finding.recovery`), with the action configured for that value (`gpu_recovery_<value>`).
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping
from dataclasses import dataclass

from agent.health.findings import Clears, Finding, GpuRef
from agent.host.nvml import GpuFabric, GpuState
from agent.host.nvml.api import (
    FABRIC_COMPLETED,
    FABRIC_NOT_SUPPORTED,
    FABRIC_STATES,
    FABRIC_SUMMARY_LIMITED,
    FABRIC_SUMMARY_UNHEALTHY,
    RECOVERY_ACTIONS,
)
from agent.signals import GpuRecoveryAction, Severity

SOURCE = "nvml:"  # key prefix of every finding of these checks
# NVML_GPU_FABRIC_HEALTH_MASK_*: (shift, width mask, value that means trouble, what it means, degraded only)
_MASK_FLAGS = ((0, 0x3, 1, "bandwidth degraded", True), (2, 0x3, 1, "route recovery in progress", True),
               (4, 0x3, 1, "route unhealthy", False), (6, 0x3, 1, "access-timeout recovery in progress", True))
_MASK_CONFIG_SHIFT = 8  # 4 bits: 0 not supported, 1 none, 2.. an incorrect configuration
_CONFIG_PROBLEMS = {2: "incorrect system GUID", 3: "incorrect chassis serial number", 4: "no partition",
                    5: "insufficient NVLinks", 6: "incompatible GPU firmware", 7: "invalid location",
                    8: "GPU state invalid"}
_RECOVERY_TEXT = {"gpu_reset": "a GPU reset", "node_reboot": "a node reboot",
                  "drain_p2p": "draining its peer-to-peer users", "drain_and_reset":
                  "draining peer-to-peer users, then a GPU reset", "recover_imex_domain": "recovery of its IMEX domain",
                  "bus_reset": "a PCIe bus reset", "system_reboot": "a system reboot"}
# Which findings each part of `GpuState` produces (key prefixes), so a part that cannot be read keeps its findings.
PART_KEYS = {"nvlink": ("nvlink_inactive",), "fabric": ("gpu_fabric", "gpu_fabric_degraded"),
             "recovery_action": ("gpu_recovery",)}


@dataclass(frozen=True)
class NvlinkVerdict:
    """One GPU's NVLink judgement: links inactive that its peers have active, or a count short of theirs."""

    missing: tuple[int, ...]
    active: int
    peers_active: int

    @property
    def down(self) -> int:
        """Links short of the peers (the metric): the missing links, or the count difference if larger."""
        return max(len(self.missing), self.peers_active - self.active)


class GpuStateJudge:
    """See the module docstring. Keeps only when each GPU's fabric was first seen not completed."""

    def __init__(self, actions: Mapping[str, Severity], fabric_grace_seconds: float) -> None:
        self.actions = actions
        self.fabric_grace_seconds = fabric_grace_seconds
        self.nvlink: dict[str, NvlinkVerdict] = {}  # uuid -> last judgement (GPUs with NVLink and peers)
        self._incomplete_since: dict[str, float] = {}

    def judge(self, states: list[tuple[GpuRef, GpuState]], now: float) -> list[Finding]:
        """Findings for these GPUs' states (parts listed in `GpuState.errors` are skipped)."""
        found = self.nvlinks(states)
        for gpu, state in states:
            if "fabric" not in state.errors:
                found += self.fabric(gpu, state.fabric, now)
            if "recovery_action" not in state.errors and state.recovery_action:
                found.append(self.recovery(gpu, state.recovery_action))
        return found

    # NVLink ---------------------------------------------------------------------------------------------------
    def nvlinks(self, states: list[tuple[GpuRef, GpuState]]) -> list[Finding]:
        """Each NVLink GPU against the others."""
        linked = [(gpu, s.nvlinks) for gpu, s in states if s.nvlinks and "nvlink" not in s.errors]
        self.nvlink = {}
        found: list[Finding] = []
        for gpu, links in linked:
            peers = [other for g, other in linked if g is not gpu]
            if not peers:
                continue
            missing = tuple(sorted(link for link in _usual_links(peers) if not links.get(link, False)))
            verdict = NvlinkVerdict(missing, sum(links.values()),
                                    statistics.median_low(sum(p.values()) for p in peers))
            self.nvlink[gpu.uuid] = verdict
            if verdict.down:
                them = "it" if len(missing) == 1 else "them"
                where = f"NVLink {', '.join(map(str, missing))} inactive (its peers have {them} active)" if missing \
                    else f"{verdict.active} NVLinks active, its peers have {verdict.peers_active}"
                found.append(self._finding("nvlink_inactive", gpu, f"{gpu.name}: {where}", "GpuNvlinkInactive",
                                           hardware=True))
        return found

    # fabric ---------------------------------------------------------------------------------------------------
    def fabric(self, gpu: GpuRef, fabric: GpuFabric | None, now: float) -> list[Finding]:
        """The fabric rules for one GPU."""
        if fabric is None or fabric.state == FABRIC_NOT_SUPPORTED:
            self._incomplete_since.pop(gpu.uuid, None)
            return []
        if fabric.state != FABRIC_COMPLETED:
            since = self._incomplete_since.setdefault(gpu.uuid, now)
            if now - since < self.fabric_grace_seconds:
                return []
            state = FABRIC_STATES.get(fabric.state, f"state {fabric.state}").replace("_", " ")
            return [self._finding("gpu_fabric", gpu, f"{gpu.name}: NVLink fabric registration {state} for over "
                                  f"{self.fabric_grace_seconds:.0f} s", "GpuFabricIncomplete")]
        self._incomplete_since.pop(gpu.uuid, None)
        if fabric.status != 0:
            return [self._finding("gpu_fabric", gpu, f"{gpu.name}: NVLink fabric registration failed (NVML status "
                                  f"{fabric.status})", "GpuFabricFailed", hardware=True)]
        faults, degraded = _mask(fabric.health_mask)
        if fabric.health_summary == FABRIC_SUMMARY_UNHEALTHY or faults:
            what = ", ".join(faults) or "health summary unhealthy"
            return [self._finding("gpu_fabric", gpu, f"{gpu.name}: NVLink fabric unhealthy: {what}",
                                  "GpuFabricUnhealthy", hardware=True)]
        if fabric.health_summary == FABRIC_SUMMARY_LIMITED or degraded:
            what = ", ".join(degraded) or "limited capacity"
            return [self._finding("gpu_fabric_degraded", gpu, f"{gpu.name}: NVLink fabric degraded: {what}",
                                  "GpuFabricDegraded", hardware=True)]
        return []

    # recovery action ------------------------------------------------------------------------------------------
    def recovery(self, gpu: GpuRef, value: int) -> Finding:
        """The driver asks for a recovery (value != NONE) on this GPU."""
        name = RECOVERY_ACTIONS.get(value, "unknown")
        text = _RECOVERY_TEXT.get(name, f"an action unknown to this agent (value {value})")
        action = GpuRecoveryAction(name)
        code = "GpuRecovery" + "".join(part.capitalize() for part in name.split("_"))
        return self._finding(f"gpu_recovery_{name}", gpu, f"{gpu.name}: the driver requests {text} (NVML GPU "
                             f"recovery action {name.upper()})", code, key="gpu_recovery", recovery=action)

    def _finding(self, check: str, gpu: GpuRef, reason: str, code: str, *, hardware: bool = False,
                 key: str = "", recovery: GpuRecoveryAction | None = None) -> Finding:
        return Finding(f"{SOURCE}{key or check}:{gpu.uuid}", self.actions[check], reason, Clears.STATE,
                       (gpu.uuid,) if gpu.uuid else (), gpu.uuid, code=code, hardware=hardware, recovery=recovery)


def _usual_links(peers: list[dict[int, bool]]) -> set[int]:
    """Links at least half the peers have active (a link a GPU does not even report counts as missing there)."""
    every = {link for p in peers for link, up in p.items() if up}
    return {link for link in every if 2 * sum(1 for p in peers if p.get(link)) >= len(peers)}


def _mask(mask: int) -> tuple[list[str], list[str]]:
    """The health mask's troubles: (faults, degradations)."""
    faults: list[str] = []
    degraded: list[str] = []
    for shift, width, bad, text, mild in _MASK_FLAGS:
        if (mask >> shift) & width == bad:
            (degraded if mild else faults).append(text)
    config = (mask >> _MASK_CONFIG_SHIFT) & 0xF
    if config >= 2:
        faults.append(f"incorrect configuration: {_CONFIG_PROBLEMS.get(config, f'code {config}')}")
    return faults, degraded
