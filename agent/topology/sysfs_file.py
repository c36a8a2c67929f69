"""One read of a file in a sysfs tree, safe against what may be planted in a tree the agent is pointed at.

Opened non-blocking and refused unless a regular file (sysfs attributes are): a FIFO or device in the tree must
not block the topology scan. Read until its end or `limit` bytes, whichever comes first: a device attribute such
as `vpd` may answer in pieces (every read of it goes to the device), a text attribute answers at once.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path


def read_sysfs_file(path: Path, limit: int) -> bytes | None:
    """Up to `limit` bytes of the file, None when it does not exist; OSError when it cannot be read, or is not a
    regular file (its message, or `strerror`, says why)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError("not a regular file")
        chunks: list[bytes] = []
        size = 0
        while size < limit:
            chunk = os.read(fd, limit - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)
