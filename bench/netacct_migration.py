"""Bench: how long a layout migration takes, and its lost window (old layout read a last time -> new layout's
counters committed), at 110 and 1,000 pods, in both directions.

Runs as root in a throw-away network namespace (no traffic: the window is the time, not a packet count). Each pod
has an IPv4 and an IPv6 address. The window is timed from the end of the last read of the old layout to the end
of the last command that commits a preloaded counter of the new one.

    python bench/netacct_migration.py [--pods 110 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from agent.config.netacct import NetacctConfig
from agent.netacct.backend import Host
from agent.netacct.engine import Netacct
from agent.netacct.ipset_netlink import SetDump
from agent.pods.model import Pod, make_pod


class TimedHost(Host):
    """A host that notes when each read of the old layout and each preloading write ended."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self.events: list[tuple[float, str]] = []

    def run(self, argv: Sequence[str], stdin: str | None = None, timeout: float | None = None) -> str:
        """Run, and note what kind of command it was."""
        out = super().run(argv, stdin, timeout)
        text = " ".join(argv) + (stdin or "")
        installs = ("add table inet" in text or ":GNA-NETACCT-IN " in text or "create gna-" in text)
        kind = "read" if "-save" in text else "write" if installs else "other"
        self.events.append((time.perf_counter(), kind))
        return out

    def dump_set(self, name: str) -> SetDump | None:
        """Dump, and note it as a read."""
        found = super().dump_set(name)
        self.events.append((time.perf_counter(), "read"))
        return found


def pods(count: int) -> list[Pod]:
    return [make_pod("bench", f"pod-{i}", [f"10.244.{i // 250}.{i % 250 + 2}", f"fd00:244::{i + 2:x}"])
            for i in range(count)]


def one(netns: str, count: int, old: str, new: str) -> tuple[float, float]:
    """Seconds of the migrating sync and of its lost window."""
    first = Netacct(NetacctConfig(enabled=True, layout=old, backend="nft"), Host(netns=netns))
    first.sync(pods(count))
    first.close()
    host = TimedHost(netns=netns)
    engine = Netacct(NetacctConfig(enabled=True, layout=new, backend="nft"), host)
    engine.layout  # noqa: B018 (resolve outside the timing)
    started = time.perf_counter()
    engine.sync(pods(count))
    took = time.perf_counter() - started
    reads = [t for t, kind in host.events if kind == "read" and t >= started]
    writes = [t for t, kind in host.events if kind == "write"]
    last_read = max(t for t in reads if t < min(writes))
    engine.remove_all()
    engine.close()
    return took, max(writes) - last_read


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--pods", type=int, nargs="+", default=[110, 1000])
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    netns = f"gna-bench-{uuid.uuid4().hex[:6]}"
    ip = shutil.which("ip") or "/usr/sbin/ip"
    subprocess.run([ip, "netns", "add", netns], check=True, timeout=10)
    try:
        print(f"load average {os.getloadavg()[0]:.2f}")
        for count in args.pods:
            for old, new in (("iptables", "nft"), ("nft", "iptables")):
                runs = [one(netns, count, old, new) for _ in range(args.rounds)]
                took, window = (statistics.median(r[i] for r in runs) * 1e3 for i in (0, 1))
                print(f"{count:5d} pods {old:>8} -> {new:<8} migration {took:7.1f} ms, lost window {window:6.1f} ms "
                      f"(median of {args.rounds})")
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        subprocess.run([ip, "netns", "del", netns], check=False, timeout=10)


if __name__ == "__main__":
    main()
