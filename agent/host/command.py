"""Run an operator-given command on the host: argv only (never a shell), with a timeout, output captured.

The one place outside the iptables port that starts a process (preflight's `--preflight-command`). The caller
decides what the outcome means; this module only reports it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class CommandOutcome:
    """How a run ended: `returncode` None when it could not start (`error` says why) or timed out."""

    returncode: int | None
    output: str = ""
    error: str = ""
    timed_out: bool = False


async def run_command(argv: Sequence[str], timeout: float) -> CommandOutcome:
    """Run `argv`, stdout and stderr together; kill it after `timeout` seconds."""
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdout=asyncio.subprocess.PIPE,
                                                    stderr=asyncio.subprocess.STDOUT)
    except OSError as exc:
        return CommandOutcome(None, error=str(exc.strerror or exc))
    try:
        output, _ = await asyncio.wait_for(proc.communicate(), timeout)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            proc.kill()
        await proc.wait()
        return CommandOutcome(None, timed_out=True)
    return CommandOutcome(proc.returncode, output.decode(errors="replace"))
