"""An agent process killed right after its Nth change of kernel state, for kill-point tests.

The dying agent runs in a forked child that counts, at the syscall and command boundary only, every operation that
changes kernel state: each successful state-changing bpf(2) command (every bpf(2) call goes through
`agent.host.bpf._bpf`), each unlink of a pin under the bpffs directory, each cls_bpf filter change
(`agent.host.bpf_tc`), and each iptables-restore, ipset restore or `nft -f` the Host port runs. Right after the Nth
it calls `os._exit(137)`: the kernel then closes the child's fds exactly as on SIGKILL (unpinned maps, programs
and links vanish, pinned ones stay). Nothing of the project's own logic is replaced; every operation still runs.
"""

from __future__ import annotations

import ctypes
import os
import struct
import tempfile
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from agent.config.netacct import NetacctConfig
from agent.host import bpf, bpf_tc
from agent.host.netfilter import Host
from agent.netacct import rules
from agent.netacct.engine import Netacct
from agent.pods.model import Pod

KILLED = 137
CHANGING = {bpf.MAP_CREATE: "MAP_CREATE", bpf.MAP_UPDATE_ELEM: "MAP_UPDATE_ELEM",
            bpf.MAP_DELETE_ELEM: "MAP_DELETE_ELEM", bpf.PROG_LOAD: "PROG_LOAD", bpf.OBJ_PIN: "OBJ_PIN",
            bpf.LINK_CREATE: "LINK_CREATE", bpf.LINK_UPDATE: "LINK_UPDATE", bpf.LINK_DETACH: "LINK_DETACH"}


class _Counter:
    """Writes each state change to the trace file; exits the process right after the `kill_after`th."""

    def __init__(self, kill_after: int | None, trace: int) -> None:
        self.kill_after = kill_after
        self.trace = trace
        self.count = 0

    def done(self, what: str) -> None:
        self.count += 1
        os.write(self.trace, f"{what}\n".encode())
        if self.count == self.kill_after:
            os._exit(KILLED)


class _CountingHost(Host):
    """The Host port, counting each command that changes the netfilter state (reads are no kill points)."""

    counter: _Counter

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float | None = None) -> str:
        out = super().run(argv, stdin, timeout)
        tool = os.path.basename(argv[0])
        if tool.endswith("-restore") or (tool == "ipset" and "restore" in argv) or (tool == "nft" and "-f" in argv):
            marker = " carried" if stdin and rules.CARRIED in stdin else ""  # the complete-install marker
            self.counter.done(f"{tool} {argv[1] if tool == 'nft' else ''}".strip() + marker)
        return out


def _instrument(counter: _Counter, bpffs_dir: str) -> None:
    """In the child only: count at the bpf(2), pin-unlink and cls_bpf boundaries."""
    syscall = bpf._bpf
    unlink = os.unlink

    def counted_bpf(cmd: int, attr: Any) -> int:
        ret = syscall(cmd, attr)
        if cmd == bpf.OBJ_PIN:  # named by the pin (its path is the attr's first field)
            pin = os.path.basename(ctypes.string_at(struct.unpack_from("<Q", attr, 0)[0]).decode())
            counter.done(f"OBJ_PIN {pin.split('_')[0]}")
        elif cmd in CHANGING:
            counter.done(CHANGING[cmd])
        return ret

    def counted_unlink(path: Any, *args: Any, **kwargs: Any) -> None:
        unlink(path, *args, **kwargs)
        if str(path).startswith(bpffs_dir):
            counter.done(f"unlink {os.path.basename(str(path)).split('_')[0]}")

    def counted_tc(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = fn(*args, **kwargs)
            if out is not False:  # cls_detach: False when nothing was there
                counter.done(name)
            return out
        return call

    bpf._bpf = counted_bpf  # type: ignore[assignment]
    os.unlink = counted_unlink  # type: ignore[assignment]
    bpf_tc.cls_attach = counted_tc("cls_attach", bpf_tc.cls_attach)  # type: ignore[assignment]
    bpf_tc.cls_detach = counted_tc("cls_detach", bpf_tc.cls_detach)  # type: ignore[assignment]


def run_agent(config: NetacctConfig, netns: str, pods: list[Pod],
              kill_after: int | None = None) -> tuple[int, list[str]]:
    """One agent process that syncs `pods` with `config` (a migration when another layout is installed), killed
    right after its `kill_after`th state change (None: never). (exit status, the state changes it made)."""
    with tempfile.TemporaryFile() as trace:
        pid = os.fork()
        if pid == 0:  # the child: never returns into the test runner
            status = 1
            try:
                counter = _Counter(kill_after, trace.fileno())
                _instrument(counter, config.bpffs_dir)
                host = _CountingHost(netns=netns)
                host.counter = counter
                Netacct(config, host).sync(pods)
                status = 0
            except BaseException:  # reported to the parent through the trace
                os.write(trace.fileno(), f"error {traceback.format_exc()!r}\n".encode())
            finally:
                os._exit(status)
        _, raw = os.waitpid(pid, 0)
        trace.seek(0)
        lines = trace.read().decode().splitlines()
    return os.waitstatus_to_exitcode(raw), lines


def kill_points(trace: list[str], stride: int) -> list[int]:
    """The points to kill at (1-based: after that many changes): the first and last of each run of identical
    operations (so every operation kind and every boundary between phases), and every `stride`th in between."""
    points: set[int] = set()
    start = 0
    for i in range(1, len(trace) + 1):
        if i == len(trace) or trace[i] != trace[start]:
            points.update((start + 1, i))
            points.update(range(start + 1, i + 1, stride))
            start = i
    return sorted(points)
