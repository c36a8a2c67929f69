"""The reboot sentinel: a file whose existence asks the cluster's reboot operator (kured) to reboot this node.

kured only tests that the file exists (`--reboot-sentinel`, default `/var/run/reboot-required`, on the host's
tmpfs `/run`, so the reboot itself removes it). The agent sees the host's directory through a hostPath mount, so
the configured path is the one inside the container.

The path comes from config and is checked at load: absolute, normalised, no `..`, strictly under the allowed
directory (`rebootSentinelDir`, else `stateDir`; never a system directory). Here, at write time:

- the allowed directory is opened as configured (it is the operator's own mount); every directory below it and
  the file itself are opened relative to it with `O_NOFOLLOW`, so a symlink anywhere under it — a parent
  directory or the file — is refused, and whoever can write that directory cannot point the write elsewhere;
- every open is `O_NONBLOCK`, and the file is created with `O_CREAT | O_EXCL`: an existing FIFO, device, socket or
  directory at the path is never opened (so nothing blocks), it is refused with an OSError naming what it is;
- an existing regular file is never opened or overwritten: it already asks kured for the reboot (the agent's own
  earlier request, or someone else's), so the request stands and the file is left as it is.
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
_KINDS = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"))


def _parts_below(directory: str, path: str) -> list[str]:
    """The components of `path` below `directory` (at least one); OSError when it is not strictly under it."""
    directory = directory.rstrip("/")
    if not directory or not path.startswith(directory + "/"):
        raise OSError(errno.EINVAL, f"{path} is not under the allowed directory {directory or '(none)'}")
    parts = path[len(directory) + 1:].split("/")
    if any(p in ("", ".", "..") for p in parts):
        raise OSError(errno.EINVAL, f"{path} is not a normalised path under {directory}")
    return parts


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def write_sentinel(directory: str | Path, path: str | Path, text: str) -> bool:
    """Create the sentinel under `directory` with a line saying why; True when created, False when a regular file
    was already there (left untouched: the request stands). Raises OSError (the caller reports it) for anything
    else: a path outside `directory`, a symlinked or missing parent, a FIFO/device/symlink at the path. Never
    blocks on what it finds."""
    parts = _parts_below(str(directory), str(path))
    dir_fd = os.open(directory, _DIR_FLAGS)
    try:
        for part in parts[:-1]:
            try:
                below = os.open(part, _DIR_FLAGS | os.O_NOFOLLOW, dir_fd=dir_fd)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.ENOTDIR):
                    raise OSError(exc.errno, f"{part} in {path} is a symlink or not a directory; refused") from None
                raise
            os.close(dir_fd)
            dir_fd = below
        name = parts[-1]
        try:
            fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC,
                         0o644, dir_fd=dir_fd)
        except FileExistsError:
            mode = os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode
            if stat.S_ISREG(mode):
                return False
            raise OSError(errno.EEXIST, f"{path} exists and is {_kind(mode)}, not a regular file; refused") from None
        try:
            os.write(fd, text.encode("utf-8", errors="replace")[:4096])
        finally:
            os.close(fd)
        return True
    finally:
        os.close(dir_fd)


def sentinel_exists(path: str | Path) -> bool:
    """Whether the sentinel is there (kured has not rebooted yet, or someone else asked too)."""
    return os.path.lexists(path)
