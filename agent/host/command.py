"""Run an operator-given command on the host: argv only (never a shell), with a timeout, output captured.

The one place outside the iptables port that starts a process (preflight's `--preflight-command`). The caller
decides what the outcome means; this module only reports it.

The command runs in a process group of its own, and the group is what ends: killed at the timeout, when the
caller is cancelled (the agent stops), and after the command itself exits (whatever it left running in the
background). Its output goes through a pipe this module owns rather than one of asyncio's subprocess pipes,
because asyncio's `wait()` also waits for those pipes to close, and a background child that inherited stdout
kept them open: the timeout then never reported and the children were orphaned. Output is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Sequence
from dataclasses import dataclass

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
    try:
        proc = await asyncio.create_subprocess_exec(*argv, stdin=asyncio.subprocess.DEVNULL, stdout=write_fd,
                                                    stderr=write_fd, start_new_session=True)
    except OSError as exc:
        os.close(read_fd)
        return CommandOutcome(None, error=str(exc.strerror or exc))
    finally:
        os.close(write_fd)
    output = asyncio.ensure_future(_read_bounded(read_fd))
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
        raise
    _kill_group(proc.pid)  # what the command left running in the background
    return CommandOutcome(returncode, await _collect(output))


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


async def _read_bounded(fd: int) -> bytes:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    transport, _ = await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader),
                                                os.fdopen(fd, "rb", buffering=0))
    kept = bytearray()
    try:
        while chunk := await reader.read(65536):
            kept += chunk[:MAX_OUTPUT - len(kept)]
    finally:
        transport.close()
    return bytes(kept)
