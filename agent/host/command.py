"""Run an operator-given command on the host: argv only (never a shell), with a timeout, output captured.

The one place outside the iptables port that starts a process (preflight's `--preflight-command`). The caller
decides what the outcome means; this module only reports it.

The command runs in a process group of its own, and the group is what ends: killed at the timeout, when the
caller is cancelled (the agent stops), and after the command itself exits (whatever it left running in the
background). Its output goes through a pipe this module owns rather than one of asyncio's subprocess pipes,
because asyncio's `wait()` also waits for those pipes to close, and a background child that inherited stdout
kept them open: the timeout then never reported and the children were orphaned. Output is bounded.
A cancel that comes while the command is still starting ends it too (see `_start`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

MAX_OUTPUT = 64 << 10  # bytes of output kept (the caller reports a short tail)
DRAIN_SECONDS = 1.0  # after the group is gone, how long the pipe may take to report its end


@dataclass(frozen=True)
class CommandOutcome:
    """How a run ended: `returncode` None when it could not start (`error` says why) or timed out."""

    returncode: int | None
    output: str = ""
    error: str = ""
    timed_out: bool = False


async def run_command(argv: Sequence[str], timeout: float) -> CommandOutcome:
    """Run `argv`, stdout and stderr together; kill its process group after `timeout` seconds or on cancel."""
    read_fd, write_fd = os.pipe()
    pipe = os.fdopen(read_fd, "rb", buffering=0)  # ours until the reader takes it; closed however the run ends
    try:
        try:
            proc = await _start(argv, write_fd)
        finally:
            os.close(write_fd)
    except OSError as exc:
        pipe.close()
        return CommandOutcome(None, error=str(exc.strerror or exc))
    except asyncio.CancelledError:
        pipe.close()
        raise
    output = asyncio.ensure_future(_read_bounded(pipe))
    try:
        async with asyncio.timeout(timeout):
            returncode = await proc.wait()
    except TimeoutError:
        _kill_group(proc.pid)
        await proc.wait()
        return CommandOutcome(None, await _collect(output), timed_out=True)
    except asyncio.CancelledError:
        _kill_group(proc.pid)
        output.cancel()
        try:
            await _settle(proc, output)  # the stop waits for the reaping (milliseconds), never for the command
        finally:
            pipe.close()  # when the reader never ran
        raise
    _kill_group(proc.pid)  # what the command left running in the background
    return CommandOutcome(returncode, await _collect(output))


async def _start(argv: Sequence[str], write_fd: int) -> asyncio.subprocess.Process:
    """Start `argv` in a session (so a process group) of its own.

    The start runs as a task of its own, shielded: asyncio forks the process in its first step and hands it over
    a few turns of the loop later, and a cancel that came in between used to abandon it half-started (asyncio
    then killed the shell alone, and whatever it had started in the background lived on). Now a cancelled
    caller waits for the start to end and kills the group it made before re-raising.
    """
    start = asyncio.ensure_future(asyncio.create_subprocess_exec(
        *argv, stdin=asyncio.subprocess.DEVNULL, stdout=write_fd, stderr=write_fd, start_new_session=True))
    try:
        return await asyncio.shield(start)
    except asyncio.CancelledError:
        start.add_done_callback(_kill_started)  # also when a second cancel ends the wait below
        await asyncio.wait([start], timeout=DRAIN_SECONDS)
        if start.done() and not start.cancelled() and start.exception() is None:
            await _settle(start.result())
        raise


def _kill_started(start: asyncio.Future[asyncio.subprocess.Process]) -> None:
    if not start.cancelled() and start.exception() is None:
        _kill_group(start.result().pid)


async def _settle(proc: asyncio.subprocess.Process, *others: asyncio.Future[Any]) -> None:
    """After a kill on cancel: let the process be reaped and `others` end, for at most DRAIN_SECONDS."""
    reaped = asyncio.ensure_future(proc.wait())
    await asyncio.wait([reaped, *others], timeout=DRAIN_SECONDS)
    reaped.cancel()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


async def _collect(output: asyncio.Future[bytes]) -> str:
    """The output read so far; a member that left the group and still holds the pipe does not hold us."""
    try:
        data = await asyncio.wait_for(asyncio.shield(output), DRAIN_SECONDS)
    except TimeoutError:
        output.cancel()
        data = b""
    return data.decode(errors="replace")


async def _read_bounded(pipe: BinaryIO) -> bytes:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), pipe)
    kept = bytearray()
    try:
        while chunk := await reader.read(65536):
            kept += chunk[:MAX_OUTPUT - len(kept)]
    finally:
        transport.close()
    return bytes(kept)
