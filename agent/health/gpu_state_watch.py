"""The NVLink / fabric / recovery-action producer: a slow NVML poll of every GPU, judged by `GpuStateJudge`.

Every `gpu_state_interval_seconds` one pass (in a worker thread: NVML calls block, and a lost GPU makes them
slow) reads each GPU's NVLink link states, fabric info and recovery-action field, and hands the whole set of
findings to the assessor (`on_findings`, keys under `nvml:`). NVLink and fabric state change rarely; the recovery
action changes with an Xid 154 (GPU_RECOVERY_ACTION_CHANGED), which `nudge`s a pass at once.

Never a false Healthy: a part that cannot be read (an NVML error other than "not supported") sets its
`health_check_up{check}` (nvlink, gpu_fabric, gpu_recovery_action) to 0, keeps the findings it had for that GPU,
and with `unknown_health_action: unhealthy` makes the GPU Unhealthy until it reads again. A lost GPU keeps its
findings (the lost-GPU finding is raised by the NVML poll and events). Without NVML the three checks are
`unavailable` and the inventory pass marks the GPUs (`unknown:nvml`); the loop keeps going, so the checks
resume when NVML comes back.
"""

from __future__ import annotations

import asyncio
import logging

from agent import aio
from agent.clock import Clock
from agent.config.health import HealthConfig
from agent.health.assess import HealthAssessor
from agent.health.checks import Checks, CheckState
from agent.health.findings import Clears, Finding, GpuRef
from agent.health.gpu_state import PART_KEYS, SOURCE, GpuStateJudge
from agent.host.nvml import GpuLostError, GpuState, NvmlError, NvmlHealth, NvmlUnavailableError
from agent.signals import Severity

log = logging.getLogger(__name__)

CHECK_OF_PART = {"nvlink": "nvlink", "fabric": "gpu_fabric", "recovery_action": "gpu_recovery_action"}
_LOST = "lost"


class GpuStateWatcher:
    """See the module docstring."""

    def __init__(self, nvml: NvmlHealth, assessor: HealthAssessor, config: HealthConfig, *, clock: Clock,
                 checks: Checks | None = None) -> None:
        self.nvml = nvml
        self.assessor = assessor
        self.config = config
        self.clock = clock
        self.checks = checks if checks is not None else Checks()
        actions = {k: Severity.parse(v) for k, v in config.check_action_map().items()}
        self.unknown_action = actions["unknown"]
        self.judge = GpuStateJudge(actions, config.gpu_fabric_grace_seconds)
        self.latest: dict[str, tuple[GpuRef, GpuState]] = {}  # uuid -> last read (the metrics show it)
        self.first_pass = asyncio.Event()
        self.passes = 0
        self._findings: dict[str, Finding] = {}  # what the last pass published, by key
        self._failing: dict[tuple[str, str], str] = {}  # (uuid, part) -> error, logged once per streak
        self._wake = asyncio.Event()

    def nudge(self) -> None:
        """Read again now (an Xid 154 says a recovery action changed), not only at the next interval."""
        self._wake.set()

    async def run(self, stop: asyncio.Event) -> None:
        """Pass after pass until `stop`; interval 0 turns the checks off."""
        if self.config.gpu_state_interval_seconds <= 0:
            for check in CHECK_OF_PART.values():
                self.checks.set(check, CheckState.OFF)
            self.first_pass.set()
            return
        while not stop.is_set():
            self._wake.clear()
            await self.check_once()
            self.first_pass.set()
            await aio.wait_any(stop, self._wake, timeout=self.config.gpu_state_interval_seconds)

    async def check_once(self) -> None:
        """One pass over every GPU of the topology with a UUID."""
        gpus = {gpu.uuid: GpuRef(str(gpu.index), gpu.uuid, gpu.bus_id)
                for gpu in self.assessor.topology.gpus if gpu.uuid}
        read = await asyncio.to_thread(self._read, list(gpus))
        self.passes += 1
        if read is None:
            for check in CHECK_OF_PART.values():
                self.checks.set(check, CheckState.UNAVAILABLE, self.nvml.unavailable_reason or "NVML unavailable")
            return  # keep what was found: NVML going away is not a recovery
        states = [(gpus[uuid], state) for uuid, state in read.items() if isinstance(state, GpuState)]
        self.latest = {gpu.uuid: (gpu, state) for gpu, state in states}
        findings = self.judge.judge(states, self.clock.monotonic())
        findings += self._carried(read)
        findings += self._unknown(gpus, states)
        self._findings = {f.key: f for f in findings}
        self.assessor.on_findings(SOURCE, findings)

    def _read(self, uuids: list[str]) -> dict[str, GpuState | str] | None:
        """Each GPU's state, "lost" for a lost GPU; None without NVML (worker thread)."""
        if not self.nvml.available:
            return None
        found: dict[str, GpuState | str] = {}
        for uuid in uuids:
            try:
                found[uuid] = self.nvml.gpu_state(uuid)
            except GpuLostError:
                found[uuid] = _LOST
            except NvmlUnavailableError:
                return None
            except NvmlError as exc:  # the handle itself failed: every part unknown
                found[uuid] = GpuState(uuid, {}, errors=dict.fromkeys(CHECK_OF_PART, str(exc)))
        return found

    def _carried(self, read: dict[str, GpuState | str]) -> list[Finding]:
        """Earlier findings of GPUs (or parts) that could not be read this pass: not read is not healthy."""
        carried: list[Finding] = []
        for uuid, state in read.items():
            parts = list(PART_KEYS) if state == _LOST else list(state.errors) if isinstance(state, GpuState) else []
            for part in parts:
                carried += [f for key, f in self._findings.items()
                            if any(key == f"{SOURCE}{prefix}:{uuid}" for prefix in PART_KEYS.get(part, ()))]
        return carried

    def _unknown(self, gpus: dict[str, GpuRef], states: list[tuple[GpuRef, GpuState]]) -> list[Finding]:
        """Check states; GPUs a part could not be read for, Unhealthy under `unknown_health_action: unhealthy`."""
        failing: dict[str, list[str]] = {check: [] for check in CHECK_OF_PART.values()}
        found: list[Finding] = []
        now_failing: dict[tuple[str, str], str] = {}
        for gpu, state in states:
            for part, why in sorted(state.errors.items()):
                check = CHECK_OF_PART.get(part)
                if check is None:
                    continue
                failing[check].append(f"{gpu.name}: {why}")
                now_failing[(gpu.uuid, part)] = why
                if (gpu.uuid, part) not in self._failing:
                    log.warning("NVML %s of %s cannot be read (%s); %s", check, gpu.name, why,
                                "the GPU is Unhealthy until it can" if self._unhealthy else "its state is kept",
                                extra={"gpu_uuid": gpu.uuid, "check": check})
                if self._unhealthy:
                    found.append(Finding(f"{SOURCE}unknown:{part}:{gpu.uuid}", self.unknown_action,
                                         f"{gpu.name}: {check} unknown: {why}", Clears.STATE, (gpu.uuid,),
                                         code="GpuHealthUnknown"))
        for uuid, part in self._failing.keys() - now_failing.keys():
            if uuid in gpus:
                log.info("NVML %s of %s readable again", CHECK_OF_PART[part], gpus[uuid].name)
        self._failing = now_failing
        for check, problems in failing.items():
            if problems:
                self.checks.set(check, CheckState.UNAVAILABLE, "; ".join(problems))
            else:
                self.checks.set(check, CheckState.OK)
        return found

    @property
    def _unhealthy(self) -> bool:
        return self.config.unknown_health_action == "unhealthy"
