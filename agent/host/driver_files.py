"""Files the NVIDIA driver keeps under /proc, found through one root so a simulated node can carry them.

On a node the root is `/proc`. Under `--simulate` it is the simulated node's `proc/` directory, next to the `sys/`
tree that plays `/sys`: the readers are the same, only the root differs, exactly as for sysfs.
"""

from __future__ import annotations

import os

PROC_ROOT = "/proc"
# The capability minors of every GPU and compute instance (`gpu0/gi1/access 12`, `gpu0/gi1/ci0/access 13`):
# NVIDIA's plugin reads it to pass `/dev/nvidia-caps/nvidia-cap<N>` for a MIG device (internal/mig/mig-dp.go).
MIG_MINORS = "driver/nvidia-caps/mig-minors"


def proc_path(relative: str, proc_root: str | os.PathLike[str] = PROC_ROOT) -> str:
    """`relative` (a path under /proc, e.g. MIG_MINORS) under `proc_root`."""
    return os.path.join(os.fspath(proc_root), relative.lstrip("/"))


def mig_minors_path(proc_root: str | os.PathLike[str] = PROC_ROOT) -> str:
    """Where the driver's MIG capability minors file is under `proc_root`."""
    return proc_path(MIG_MINORS, proc_root)
