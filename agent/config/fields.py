"""`setting()`: a dataclass field that carries how an operator sets it (help, flag, env, choices)."""

from __future__ import annotations

import logging
from dataclasses import Field, field
from typing import Any

# The project's domain for resource names, taints, labels and annotations. No dashes, so SR-IOV DP-style env
# keys derived from resource names (PCIDEVICE_GPUNODEAGENT_IO_SRIOV_RDMA) stay usable from a shell.
PROJECT_DOMAIN = "gpunodeagent.io"

log = logging.getLogger(__name__)


def setting(default: Any = None, *, help: str, flag: str | None = None, env: str | None = None,
            factory: Any = None, choices: tuple[str, ...] | None = None, repeat: bool = False,
            zero_ok: bool = False, floor: float | None = None) -> Any:
    """A dataclass field carrying its help text, flag, environment variable and allowed values.

    A number must be finite, and a `*_seconds` number must be at least 0.01 (10 ms, `load.MIN_SECONDS`) unless
    `zero_ok`, where 0 means "off" or "once" (the help says so) and anything else is at least 0.01 too.
    `floor` (intervals of periodic work): a value from 0.01 up to it is raised to it, with one warning; what the
    work costs sets it (a full hardware rescan at most once a second)."""
    meta = {"help": help, "flag": flag, "env": env, "choices": choices, "repeat": repeat, "zero_ok": zero_ok,
            "floor": floor}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def floored(f: Field, value: Any, where: str) -> Any:
    """An interval below its setting's `floor` raised to it, with a warning (0, "off", stays). Raised, not refused:
    such values were accepted before (configs in use keep working), and the floor only slows periodic work."""
    floor = f.metadata.get("floor")
    if floor is None or not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < floor:
        return value
    log.warning("%s: %s seconds is more often than this work should run; using its floor, %s seconds", where,
                value, floor)
    return type(value)(floor)
