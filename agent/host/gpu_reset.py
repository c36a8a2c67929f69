"""Reset one GPU with the operator's command, on the host: what may block it, and the reset itself.

The agent has no reset of its own (pynvml has none; `nvidia-smi --gpu-reset` is the documented way). The command
is an argv list from config (`remediation.gpuResetCommand`, checked at load: fixed program, only the placeholders
`{busId}`, `{index}`, `{uuid}`), filled with values the agent checked here: a UUID of NVML's shape, a canonical
PCI bus id, an index. `{index}` is the GPU's position in PCI bus order, which is how nvidia-smi numbers GPUs.

`nvidia-smi --gpu-reset` refuses while any process holds the GPU, the agent's own NVML session included
(nvidia-smi(1): "no processes may be using the GPU"). So: the blockers are checked first (processes on the GPU,
MIG mode, a lost GPU), then the session is closed (`NvmlPort.suspend`: health calls wait, event sets are
freed), the command runs with a timeout, the session opens again, and the reset counts only when NVML lists the
same UUID at the same bus id afterwards.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass

from agent.config.remediation import RESET_PLACEHOLDER
from agent.host.busid import is_bus_id
from agent.host.command import run_command
from agent.host.nvml import GpuLostError, NvmlError, NvmlPort

log = logging.getLogger(__name__)

SUSPEND_SECONDS = 30.0  # how long the reset waits for running NVML calls (a poll of a sick GPU can be slow)
_UUID = re.compile(r"^(GPU|MIG)-[0-9a-fA-F-]{8,64}$")
#: nvidia-smi(1), RETURN VALUE: what a failed reset's exit status means
NVIDIA_SMI_EXIT = {2: "invalid argument", 3: "operation not available on this GPU", 4: "insufficient permissions",
                   6: "GPU not found", 9: "NVIDIA driver not loaded", 10: "the kernel detected an interrupt issue",
                   12: "NVML library not found", 13: "function not implemented by this NVML",
                   14: "infoROM corrupted", 15: "GPU has fallen off the bus", 255: "other or internal driver error"}


@dataclass(frozen=True)
class ResetTarget:
    """The GPU to reset, as the command's placeholders name it."""

    uuid: str
    bus_id: str
    index: int


@dataclass(frozen=True)
class ResetOutcome:
    """`ok`: the command exited 0 and NVML lists the GPU again; `detail` says what happened, for Events."""

    ok: bool
    detail: str


def reset_argv(template: Sequence[str], target: ResetTarget) -> list[str]:
    """The command with its placeholders filled; ValueError when a value is not what NVML reports."""
    if not _UUID.match(target.uuid) or not is_bus_id(target.bus_id) or target.index < 0:
        raise ValueError(f"refusing to reset {target}: not a GPU UUID, canonical bus id and index")
    values = {"{busId}": target.bus_id, "{index}": str(target.index), "{uuid}": target.uuid}
    return [RESET_PLACEHOLDER.sub(lambda m: values[m.group(0)], arg) for arg in template]


class GpuResetter:
    """Runs the reset command for one GPU at a time, with the NVML session closed around it."""

    def __init__(self, nvml: NvmlPort, command: Sequence[str], timeout_s: float, *,
                 suspend_timeout_s: float = SUSPEND_SECONDS) -> None:
        self.nvml = nvml
        self.command = list(command)
        self.timeout_s = timeout_s
        self.suspend_timeout_s = suspend_timeout_s

    def target(self, uuid: str) -> ResetTarget | None:
        """Where NVML sees the GPU now (blocking); None when it does not list it."""
        by_bus = self.nvml.gpu_uuids()
        for index, bus_id in enumerate(sorted(by_bus)):
            if by_bus[bus_id] == uuid:
                return ResetTarget(uuid, bus_id, index)
        return None

    def blockers(self, uuid: str) -> tuple[list[str], bool]:
        """What keeps the reset from running now (blocking), and whether waiting can help: processes on the GPU
        can end; a GPU in MIG mode, one NVML cannot see or a lost one will not be reset by waiting."""
        target = self.target(uuid)
        if target is None:
            return [f"NVML does not list {uuid}" + (f" ({self.nvml.unavailable_reason})"
                                                    if not self.nvml.available else "")], False
        if target.bus_id in self.nvml.mig_gpus():
            return ["MIG mode is on (a reset would need every MIG instance destroyed first)"], False
        try:
            pids = self.nvml.running_processes(uuid)
        except GpuLostError as exc:
            return [f"the GPU is lost ({exc})"], False
        except NvmlError as exc:
            return [f"cannot list its processes: {exc}"], True
        if pids:
            return [f"processes {', '.join(map(str, pids[:10]))}{' ...' if len(pids) > 10 else ''} use it"], True
        return [], True

    async def reset(self, target: ResetTarget) -> ResetOutcome:
        """Close the NVML session, run the command, open the session, check NVML lists the GPU again."""
        try:
            argv = reset_argv(self.command, target)
        except ValueError as exc:
            return ResetOutcome(False, str(exc))
        if not await asyncio.to_thread(self.nvml.suspend, self.suspend_timeout_s):
            return ResetOutcome(False, f"NVML calls did not finish within {self.suspend_timeout_s:.0f} s; "
                                       f"the session could not be closed for the reset")
        try:
            log.info("resetting GPU %s (%s): %s", target.uuid, target.bus_id, argv)
            outcome = await run_command(argv, self.timeout_s)
        finally:
            self.nvml.resume()
        tail = outcome.output.strip().splitlines()[-3:]
        said = f": {' / '.join(tail)}" if tail else ""
        if outcome.returncode is None:
            why = (f"timed out after {self.timeout_s:.0f} s" if outcome.timed_out
                   else f"could not start: {outcome.error}")
            return ResetOutcome(False, f"{argv[0]} {why}{said}")
        if outcome.returncode != 0:
            meaning = NVIDIA_SMI_EXIT.get(outcome.returncode, "")
            return ResetOutcome(False, f"{argv[0]} exited {outcome.returncode}"
                                       f"{f' ({meaning})' if meaning else ''}{said}")
        after = await asyncio.to_thread(self.target, target.uuid)
        if after is None or after.bus_id != target.bus_id:
            return ResetOutcome(False, f"the command exited 0 but NVML does not list {target.uuid} at "
                                       f"{target.bus_id} afterwards")
        return ResetOutcome(True, f"{argv[0]} exited 0{said}")
