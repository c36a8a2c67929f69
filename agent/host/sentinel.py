"""The reboot sentinel: a file whose existence asks the cluster's reboot operator (kured) to reboot this node.

kured only tests that the file exists (`--reboot-sentinel`, default `/var/run/reboot-required`, on the host's
tmpfs `/run`, so the reboot itself removes it). The agent sees the host's directory through a hostPath mount, so
the configured path is the one inside the container. The path comes from config (checked at load: absolute,
normalised, no `..`); the file is created without following a symlink at its name, so whoever can write that
directory cannot point the agent's write elsewhere.
"""

from __future__ import annotations

import os
from pathlib import Path


def write_sentinel(path: str | Path, text: str) -> None:
    """Create (or rewrite) the sentinel with a line saying why; raises OSError (the caller reports it)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        os.write(fd, text.encode("utf-8", errors="replace")[:4096])
    finally:
        os.close(fd)


def sentinel_exists(path: str | Path) -> bool:
    """Whether the sentinel is there (kured has not rebooted yet, or someone else asked too)."""
    return os.path.lexists(path)
