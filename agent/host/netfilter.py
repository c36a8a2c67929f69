"""The netfilter port: the only code that runs iptables, ip6tables, ipset and nft (netacct is its user).

Every command is an argv list with a timeout, never a shell; what varies in a payload (IP addresses, CIDRs) is
validated by `ipaddress` before it gets here, and pod names never get here at all. Writes go through
`iptables-restore --noflush -w N` (one process per change set, honouring the xtables lock on legacy hosts) and
`ipset restore -exist`. Counters are read with `iptables-save -c -t mangle` per family, started concurrently,
while the ipset members are dumped over netlink in this thread (the fastest read measured; see ipset_netlink).

Backend detection follows kubernetes-sigs/iptables-wrappers: look for the kubelet's hint chains in the nft
mangle table first, then in a *full* legacy save (`-t mangle` would make the legacy kernel table exist), and
default to nft. The native layout's writes are one `nft -f -` transaction each (payload on stdin); its reads go
over nfnetlink (nft_netlink). `netns` runs everything inside a named network namespace (tests, benchmarks).
"""

from __future__ import annotations

import functools
import logging
import re
import shutil
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from agent.host.ipset_netlink import IpsetReader, SetDump
from agent.host.nft_netlink import NftReader

log = logging.getLogger(__name__)

MODES = ("nft", "legacy")
FAMILIES = (4, 6)
HINT_CHAINS = re.compile(r"^:(KUBE-IPTABLES-HINT|KUBE-KUBELET-CANARY) ", re.MULTILINE)
_COMMANDS = {4: "iptables", 6: "ip6tables"}


class CommandError(Exception):
    """A command failed, timed out or is not installed; the message names the command and its stderr."""


@dataclass(frozen=True)
class Snapshot:
    """One read of everything: mangle saves per family (missing when unreadable) and dumps of the named sets."""

    saves: dict[int, str]
    sets: dict[str, SetDump | None]
    errors: tuple[str, ...] = ()


def _tool(mode: str, family: int, verb: str) -> list[str]:
    """argv prefix of e.g. `iptables-nft-save`, falling back to `xtables-nft-multi iptables-save`."""
    return list(_resolve(mode, family, verb))


@functools.lru_cache(maxsize=32)
def _resolve(mode: str, family: int, verb: str) -> tuple[str, ...]:
    # Cached on success only: a failure raises, so a tool installed later is found on the next try.
    name = f"{_COMMANDS[family]}-{mode}-{verb}"
    path = shutil.which(name)
    if path:
        return (path,)
    multi = shutil.which(f"xtables-{mode}-multi")
    if multi:
        return (multi, f"{_COMMANDS[family]}-{verb}")
    raise CommandError(f"{name} is not installed (Debian/Ubuntu package: iptables)")


class Host:
    """Runs the netacct commands on this host, or inside network namespace `netns`."""

    def __init__(self, netns: str | None = None, lock_wait: int = 5, timeout: float = 10.0,
                 nft_table: str = "gpu_node_agent_netacct") -> None:
        self.netns = netns
        self.lock_wait = lock_wait
        self.timeout = timeout
        self._reader = IpsetReader(netns, timeout)
        self.nft_reader = NftReader(nft_table, netns, timeout)

    def close(self) -> None:
        """Release the netlink sockets."""
        self._reader.close()
        self.nft_reader.close()

    def _argv(self, argv: Sequence[str]) -> list[str]:
        if self.netns is None:
            return list(argv)
        ip = shutil.which("ip")
        if ip is None:
            raise CommandError("ip is not installed (package iproute2); it is needed to enter a network namespace")
        return [ip, "netns", "exec", self.netns, *argv]

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float | None = None) -> str:
        """Run one command; its stdout, or CommandError naming the command and its stderr."""
        full = self._argv(argv)
        try:
            done = subprocess.run(full, input=stdin, capture_output=True, text=True, check=False,
                                  timeout=timeout or self.timeout)
        except FileNotFoundError as exc:
            raise CommandError(f"{full[0]} is not installed") from exc
        except subprocess.TimeoutExpired as exc:
            raise CommandError(f"{' '.join(argv[:2])} timed out after {exc.timeout} s") from exc
        if done.returncode != 0:
            raise CommandError(f"{' '.join(argv[:3])} exited {done.returncode}: {done.stderr.strip()[:500]}")
        return done.stdout

    # -- iptables ---------------------------------------------------------------------------------------------

    def detect_mode(self, families: Iterable[int] = FAMILIES) -> str:
        """nft or legacy, from the kubelet's hint chains (kubernetes-sigs/iptables-wrappers); nft by default."""
        families = tuple(families)
        for mode, extra in (("nft", ["-t", "mangle"]), ("legacy", [])):
            for family in families:
                try:
                    text = self.run([*_tool(mode, family, "save"), *extra])
                except CommandError as exc:
                    log.debug("backend probe failed: %s", exc)
                    continue
                if HINT_CHAINS.search(text):
                    return mode
        return "nft"

    def save(self, mode: str, family: int, counters: bool = True) -> str:
        """`iptables-save [-c] -t mangle` of one family."""
        return self.run([*_tool(mode, family, "save"), *(["-c"] if counters else []), "-t", "mangle"])

    def save_full(self, mode: str, family: int, counters: bool = False) -> str:
        """A save of every table (does not create tables that do not exist, as `-t mangle` does on legacy)."""
        return self.run([*_tool(mode, family, "save"), *(["-c"] if counters else [])])

    def restore(self, mode: str, family: int, payload: str, counters: bool = False) -> None:
        """Apply a restore payload without flushing anything it does not name, waiting for the xtables lock;
        `counters`: set the `[packets:bytes]` its rule lines carry."""
        argv = [*_tool(mode, family, "restore"), *(["--counters"] if counters else []), "--noflush", "-w",
                str(self.lock_wait)]
        self.run(argv, stdin=payload, timeout=self.timeout + self.lock_wait)

    # -- ipset ------------------------------------------------------------------------------------------------

    def ipset_restore(self, payload: str) -> None:
        """Apply create/add/del/destroy lines with `ipset restore -exist` (one process per change set)."""
        if payload:
            self.run([_ipset(), "restore", "-exist"], stdin=payload)

    def has_ipset(self) -> bool:
        """Whether the ipset tool is installed (an nft-only node has nothing of the iptables layout to remove)."""
        return shutil.which("ipset") is not None

    def ipset_names(self) -> set[str]:
        """Names of every set in the namespace."""
        return set(self.run([_ipset(), "list", "-n"]).split())

    def dump_set(self, name: str) -> SetDump | None:
        """One set's members and counters over netlink; None when it does not exist."""
        return self._reader.dump(name)

    # -- nft ------------------------------------------------------------------------------------------------------

    def nft_apply(self, payload: str) -> None:
        """Apply one `nft -f -` transaction (all of it or nothing)."""
        if payload:
            self.run([_nft(), "-f", "-"], stdin=payload)

    def nft_usable(self) -> str | None:
        """None when `nft` is installed and answers, else why not."""
        try:
            self.run([_nft(), "list", "tables"])
        except CommandError as exc:
            return str(exc)
        return None

    def bpf_usable(self) -> str | None:
        """None where the eBPF layout may use bpf(2) and tc on this host (agent.host.bpf); a simulated host says why
        not, so `auto` never probes the real kernel through it."""
        return None

    # -- one read of everything ---------------------------------------------------------------------------------

    def snapshot(self, mode: str, families: Iterable[int], set_names: Iterable[str]) -> Snapshot:
        """Read the mangle saves (processes started concurrently) and the named sets (netlink) in one pass."""
        started: dict[int, subprocess.Popen[str]] = {}
        errors: list[str] = []
        for family in families:
            try:
                argv = self._argv([*_tool(mode, family, "save"), "-c", "-t", "mangle"])
                started[family] = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            except (OSError, CommandError) as exc:
                errors.append(f"{_COMMANDS[family]}-save: {exc}")
        sets: dict[str, SetDump | None] = {}
        try:
            for name in set_names:
                sets[name] = self._reader.dump(name)
        except OSError as exc:
            errors.append(f"ipset netlink dump: {exc}")
        finally:
            saves = self._collect(started, errors)
        return Snapshot(saves, sets, tuple(errors))

    def _collect(self, started: dict[int, subprocess.Popen[str]], errors: list[str]) -> dict[int, str]:
        """Wait for the concurrent saves (killing any that outlive the timeout) and keep their output."""
        saves: dict[int, str] = {}
        deadline = time.monotonic() + self.timeout
        for family, proc in started.items():
            try:
                out, err = proc.communicate(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.communicate()
                errors.append(f"{_COMMANDS[family]}-save timed out")
                continue
            if proc.returncode == 0:
                saves[family] = out
            else:
                errors.append(f"{_COMMANDS[family]}-save exited {proc.returncode}: {err.strip()[:300]}")
        return saves


def _ipset() -> str:
    path = shutil.which("ipset")
    if path is None:
        raise CommandError("ipset is not installed (Debian/Ubuntu package: ipset)")
    return path


def _nft() -> str:
    path = shutil.which("nft")
    if path is None:
        raise CommandError("nft is not installed (Debian/Ubuntu package: nftables)")
    return path
