"""Whether the native nftables layout works here: one probe packet through a counted set, not a version check.

The layout needs `nft`, nf_tables, base chains at priority -300 in an inet table, sets whose definition gives
every element a counter (NFTA_SET_EXPR, Linux 5.7: kernel commit 65038428b2c6 "allow to specify stateful
expression in set definition"), and lookups that bump those counters. Rather than trusting a kernel version
(distributions backport), `probe` builds a throw-away table with exactly that shape on the output hook, sends
one UDP datagram to a socket of its own on 127.0.0.1, and checks that the element counted it. The table is
removed whatever happens. Used by `layout: auto`; the answer is logged.
"""

from __future__ import annotations

import contextlib
import socket

from agent.host.netfilter import CommandError, Host
from agent.host.netns import entered
from agent.host.nft_netlink import NftReader
from agent.netacct.nft_layout import PRIORITY

PROBE_TABLE = "gpu_node_agent_netacct_probe"


def _table(port: int) -> str:
    return (f"table inet {PROBE_TABLE}\ndelete table inet {PROBE_TABLE}\n"  # a leftover of a killed probe goes
            f"table inet {PROBE_TABLE} {{\n"
            f"  set probe {{ type inet_service; counter; elements = {{ {port} }} }}\n"
            f"  chain output {{ type filter hook output priority {PRIORITY}; policy accept; "
            f"ip daddr 127.0.0.1 udp dport @probe; }}\n}}\n")


def probe(host: Host, timeout: float = 2.0) -> str | None:
    """None when the native layout works in `host`'s namespace, else why not (for the log)."""
    why = host.nft_usable()
    if why is not None:
        return why
    with entered(host.netns):
        rx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        tx = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    reader = NftReader(PROBE_TABLE, host.netns, timeout)
    try:
        rx.bind(("127.0.0.1", 0))
        rx.settimeout(timeout)
        port = rx.getsockname()[1]
        try:
            host.nft_apply(_table(port))
        except CommandError as exc:
            return f"nft rejected a table with a counted set and a priority {PRIORITY} chain: {exc}"
        try:
            tx.sendto(b"gpu-node-agent netacct probe", ("127.0.0.1", port))
            rx.recv(64)
            elements = reader.elements("probe")
        finally:
            with contextlib.suppress(CommandError):
                host.nft_apply(f"delete table inet {PROBE_TABLE}\n")
        counts = elements.counted.get(port.to_bytes(2, "big")) if elements is not None else None
        if not counts or counts[0] < 1:
            return ("this kernel does not count set-element lookups (set element counters need Linux 5.7 or "
                    f"later): the probe element read {counts}")
        return None
    except OSError as exc:
        return f"probe failed: {exc}"
    finally:
        reader.close()
        rx.close()
        tx.close()
