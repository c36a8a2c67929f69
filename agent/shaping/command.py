"""`gpu-node-agent shaping cleanup`: remove every shaper and IFB shaping installed, for uninstalling the agent.

It removes exactly our objects (root handle `7a17:`, our filter priorities on ingress hooks, IFBs named
`gnas...`) and nothing else, whatever the configuration says now; running it twice is harmless. The agent must
be stopped first, or its next sync installs everything again. It is the only command that removes them:
`netacct cleanup` removes netacct's objects alone (and says so when shapers remain, `remaining`).
"""

from __future__ import annotations

import logging
from typing import TextIO

from agent.host.tc import TcError, TcPort
from agent.shaping.engine import Shaper

log = logging.getLogger(__name__)


def _open(port: TcPort | None) -> TcPort:
    if port is not None:
        return port
    from agent.host.tc_netlink import NetlinkTc

    return NetlinkTc()


def remaining(port: TcPort | None = None) -> int | None:
    """How many of shaping's objects are in the namespace (shaped interfaces and IFBs), read-only; None when tc
    cannot be read (no NET_ADMIN, no netlink): the caller then says nothing rather than guess."""
    try:
        port = _open(port)
    except (TcError, OSError):
        return None
    try:
        state = port.read()
    except (TcError, OSError):
        return None
    finally:
        port.close()
    return len(state.devices) + len(state.ifbs)


def cleanup_command(out: TextIO | None = None, port: TcPort | None = None) -> int:
    """Remove shaping's tc objects; 0 on success, 1 when something could not be removed."""
    try:
        port = _open(port)
    except (TcError, OSError) as exc:
        log.error("shaping cleanup failed: %s", exc)
        if out is not None:
            out.write(f"shaping cleanup failed: {exc}\n")
        return 1
    shaper = Shaper(port, [], {})
    try:
        removed = shaper.remove_all()
    except (TcError, OSError) as exc:
        log.error("shaping cleanup failed: %s", exc)
        if out is not None:
            out.write(f"shaping cleanup failed: {exc}\n")
        return 1
    finally:
        shaper.close()
    if out is not None:
        out.write("shaping removed: " + ", ".join(removed) + "\n" if removed else "shaping: nothing to remove\n")
    log.info("shaping cleanup removed %d objects", len(removed))
    return 0
