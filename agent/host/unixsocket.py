"""Unix-socket paths the kubelet dials: the AF_UNIX length limit, and which socket file is ours.

The device-plugin servers and the DRA plugin both serve on sockets in kubelet directories: a path over the
kernel's limit can never work (a startup error, exit 2), and a socket deleted or replaced behind our back (the
kubelet wipes its device-plugin directory when it restarts) is told apart from ours by inode and ctime.
"""

from __future__ import annotations

import os
import stat

MAX_SOCKET_PATH = 107  # AF_UNIX sun_path minus the terminating NUL


class SocketPathError(ValueError):
    """A unix socket path longer than the kernel allows."""


def check_socket_path(path: str | os.PathLike[str], hint: str = "use a shorter directory") -> str:
    """Return `path` as a string, or raise SocketPathError when it exceeds the 107-byte AF_UNIX limit."""
    text = os.fspath(path)
    size = len(text.encode())
    if size > MAX_SOCKET_PATH:
        raise SocketPathError(f"unix socket path {text!r} is {size} bytes; the limit is {MAX_SOCKET_PATH}: {hint}")
    return text


def socket_identity(path: str) -> tuple[int, int] | None:
    """(inode, ctime) of a unix socket, None when absent or not a socket."""
    try:
        info = os.lstat(path)
    except OSError:
        return None
    return (info.st_ino, info.st_ctime_ns) if stat.S_ISSOCK(info.st_mode) else None
