"""Files named by settings (the config file, NVIDIA's and the SR-IOV plugin's config files, the pods file): read
without ever waiting on one, and regular files only.

A plain `open()` of a FIFO blocks until a writer comes, which may be never: `config`, `run` and `doctor` hung on a
FIFO given as `--config` (and the pods file was re-read on the event loop, which froze with it). A character
device such as /dev/zero never ends. So a file is opened with O_NONBLOCK (an open that cannot wait), checked to be
a regular file on the descriptor itself (no race between a check and the open), and read up to a bound.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
          (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"))


class NotRegularFileError(OSError):
    """The path names something other than a regular file; the message says what it is."""


def kind_of(mode: int) -> str:
    """What a non-regular file is, in words ("a FIFO")."""
    return next((word for test, word in _KINDS if test(mode)), "not a regular file")


def not_regular(path: str | Path) -> str | None:
    """Why `path` cannot be read as a file when it exists and is not a regular file ("a FIFO, not a regular
    file"); None when it is one or does not exist (callers decide whether a missing file is an error). `stat`
    never waits on a FIFO."""
    try:
        mode = os.stat(path).st_mode
    except (OSError, ValueError):  # ValueError: a NUL byte in the path
        return None
    return None if stat.S_ISREG(mode) else f"{kind_of(mode)}, not a regular file"


def check_files(*settings: tuple[str, str | Path | None]) -> None:
    """ValueError naming the setting and the path for the first (setting, path) whose path exists and is not a
    regular file; unset and missing paths pass (whoever reads the file says what is missing)."""
    for name, path in settings:
        problem = not_regular(path) if path else None
        if problem:
            raise ValueError(f"{name}: {str(path)!r} is {problem}")


def check_dirs(*settings: tuple[str, str], required: bool = False) -> None:
    """ValueError naming the setting for the first (setting, directory) that is relative (it would follow the
    agent's working directory) or `/` (the agent writes sockets and files there). "" passes unless `required`
    (elsewhere it means "none" or "the default", and the setting says so)."""
    for name, path in settings:
        if required and not path:
            raise ValueError(f"{name}: must be set (an absolute directory)")
        if path and (not path.startswith("/") or not path.strip("/")):
            raise ValueError(f"{name}: {path[:200]!r} must be an absolute directory other than / (the agent writes "
                             "sockets or files in it)")


def read_regular(path: str | Path, limit: int) -> bytes:
    """At most `limit + 1` bytes of the regular file at `path` (so a caller sees that it is over `limit`).

    Raises NotRegularFileError when it is anything else, and OSError when it cannot be opened; never blocks on
    the open.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    except ValueError as exc:  # a NUL byte in the path
        raise OSError(f"not a path: {exc}") from None
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):  # checked on the descriptor: no race between a check and the open
            raise NotRegularFileError(f"{kind_of(mode)}, not a regular file")
    except BaseException:
        os.close(fd)
        raise
    with os.fdopen(fd, "rb") as handle:
        return handle.read(limit + 1)
