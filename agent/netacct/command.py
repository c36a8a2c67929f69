"""`gpu-node-agent netacct cleanup`: remove everything netacct installed, for uninstalling the agent.

It removes exactly the chains with netacct's prefix, the rules that jump into them and netacct's named sets, on
both iptables backends and both families, whatever the configuration says now, and nothing else. Running it
twice is harmless. The agent must be stopped first, or its next sync installs everything again.
"""

from __future__ import annotations

import logging
from typing import TextIO

from agent.config.netacct import NetacctConfig
from agent.host.netfilter import CommandError, Host
from agent.netacct.engine import Netacct

log = logging.getLogger(__name__)


def cleanup_command(config: NetacctConfig, out: TextIO | None = None, host: Host | None = None) -> int:
    """Remove netacct's chains, jump rules and sets; 0 on success, 1 when something could not be removed."""
    engine = Netacct(config, host or Host(lock_wait=config.lock_wait_seconds))
    try:
        removed = engine.remove_all()
    except (CommandError, OSError) as exc:
        log.error("netacct cleanup failed: %s", exc)
        if out is not None:
            out.write(f"netacct cleanup failed: {exc}\n")
        return 1
    finally:
        engine.close()
    if out is not None:
        out.write("removed: " + ", ".join(removed) + "\n" if removed else "nothing to remove\n")
    log.info("netacct cleanup removed %d objects", len(removed))
    return 0
